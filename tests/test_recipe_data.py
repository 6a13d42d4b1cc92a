"""Unit tests for the recipe helpers (recipes/data.py, recipes/schedule.py); no process group."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))

import data  # noqa: E402
from schedule import lr_at  # noqa: E402


def test_byte_tokenizer_round_trip():
    tok = data.ByteTokenizer()
    text = "def f(x):\n    return x  # héllo, 世界 🙂"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode([tok.bos_id] + ids + [tok.eos_id, tok.pad_id]) == text
    assert len({tok.pad_id, tok.bos_id, tok.eos_id}) == 3
    assert min(tok.pad_id, tok.bos_id, tok.eos_id) >= 256 and tok.vocab_size == 259


def test_tokenize_documents_wraps_each_document():
    tok = data.ByteTokenizer()
    stream = data.tokenize_documents(["ab", "c"], tok)
    assert stream.tolist() == [tok.bos_id, 97, 98, tok.eos_id, tok.bos_id, 99, tok.eos_id]


def test_stdlib_documents_deterministic_and_capped():
    a = data.stdlib_documents(max_bytes=50_000)
    b = data.stdlib_documents(max_bytes=50_000)
    assert a == b and len(a) > 1
    assert sum(len(d.encode("utf-8", errors="replace")) for d in a) <= 60_000  # replacement chars may grow
    assert any("def " in d for d in a)


def test_split_train_eval():
    stream = torch.arange(1000)
    train, held = data.split_train_eval(stream, 0.05)
    assert len(held) == 50 and torch.equal(torch.cat([train, held]), stream)


def _stream(n=5000, seq_len=16):
    return data.TokenStream(torch.arange(n), seq_len)


def test_batches_deterministic_for_seed_and_step():
    ds = _stream()
    a = ds.global_batch(seed=3, step=7, size=8)
    b = ds.global_batch(seed=3, step=7, size=8)
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])
    assert not torch.equal(a["input_ids"], ds.global_batch(seed=3, step=8, size=8)["input_ids"])
    assert not torch.equal(a["input_ids"], ds.global_batch(seed=4, step=7, size=8)["input_ids"])
    eval_batch = ds.global_batch(seed=3, step=7, size=8, stream=data.EVAL_STREAM)
    assert not torch.equal(a["input_ids"], eval_batch["input_ids"])


def test_windows_are_contiguous_and_labels_match_inputs():
    ds = _stream(seq_len=16)
    batch = ds.global_batch(seed=0, step=0, size=32)
    ids = batch["input_ids"]
    assert ids.shape == (32, 16)
    assert torch.equal(ids[:, 1:] - ids[:, :-1], torch.ones(32, 15, dtype=torch.long))
    assert torch.equal(batch["labels"], ids)  # HF shifts labels itself
    assert int(ids.max()) < 5000


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_rank_slices_partition_the_global_batch(world_size):
    global_batch = _stream().global_batch(seed=1, step=0, size=4 * world_size)
    slices = [data.rank_slice(global_batch, r, world_size) for r in range(world_size)]
    for key in global_batch:
        assert torch.equal(torch.cat([s[key] for s in slices]), global_batch[key])
    # Disjoint rows: each rank owns its own block of row positions.
    rows = torch.arange(4 * world_size)
    row_sets = [set(data.rank_slice({"r": rows}, r, world_size)["r"].tolist()) for r in range(world_size)]
    assert sum(len(s) for s in row_sets) == len(set().union(*row_sets)) == 4 * world_size


def test_rank_slice_rejects_uneven_batch():
    with pytest.raises(ValueError):
        data.rank_slice({"x": torch.zeros(5, 2)}, 0, 2)


def test_micro_batches_split_in_order():
    batch = {"x": torch.arange(12).view(6, 2)}
    micros = data.micro_batches(batch, 3)
    assert len(micros) == 3 and all(m["x"].shape == (2, 2) for m in micros)
    assert torch.equal(torch.cat([m["x"] for m in micros]), batch["x"])
    with pytest.raises(ValueError):
        data.micro_batches(batch, 4)


def test_sft_label_masking_and_padding():
    tok = data.ByteTokenizer()
    ids, labels, mask, cut = data.encode_sft_example(tok, "Q:", "ok", seq_len=10)
    assert cut is None and ids == [tok.bos_id, ord("Q"), ord(":"), ord("o"), ord("k"), tok.eos_id] + [tok.pad_id] * 4
    assert labels == [-100, -100, -100, ord("o"), ord("k"), tok.eos_id] + [-100] * 4
    assert mask == [1] * 6 + [0] * 4


def test_sft_truncation_keeps_the_response():
    """Too long for seq_len, the prompt is cut from the left (down to one token of context), then
    the response from the right (it was cut from the right first: the response and its EOS went)."""
    tok = data.ByteTokenizer()
    ids, labels, mask, cut = data.encode_sft_example(tok, "a long prompt", "ok", seq_len=9)
    assert cut == "prompt" and ids == [tok.bos_id, *b"rompt", *b"ok", tok.eos_id] and all(mask)
    assert labels == [-100] * 6 + [*b"ok", tok.eos_id]
    ids, labels, mask, cut = data.encode_sft_example(tok, "prompt", "a long response", seq_len=9)
    assert cut == "response" and len(ids) == len(labels) == len(mask) == 9 and all(mask)
    assert ids[:2] == [tok.bos_id, ord("t")] and labels == [-100, -100, *b"a long "]


class _NoBosTokenizer(data.ByteTokenizer):
    bos_id = None


def test_sft_without_bos_and_without_prompt_still_scores_the_first_response_token():
    """Position 0 is never scored (the labels are shifted): with no BOS and an empty prompt the
    first response token sat there and was never learned; EOS now stands before it."""
    tok = _NoBosTokenizer()
    ids, labels, _, _ = data.encode_sft_example(tok, "", "hi", seq_len=6)
    assert ids[:4] == [tok.eos_id, *b"hi", tok.eos_id] and labels[:4] == [-100, *b"hi", tok.eos_id]


def test_sft_prompt_and_response_are_split_where_the_joint_text_splits(tmp_path):
    """A SentencePiece-style tokenizer (Metaspace) encoding the response on its own starts it with a
    word boundary ("▁4") that the text "Q: 2+2=4" does not have: the model learned an extra space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.BPE(unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    t.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    t.train_from_iterator(["Q: 2+2=4", "Answer:4", "the answer is 4", "hello world"] * 10,
                          trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"]))
    PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>", unk_token="<unk>").save_pretrained(tmp_path)
    tok = data.load_tokenizer(str(tmp_path))
    ids, labels, mask, _ = data.encode_sft_example(tok, "Q: 2+2=", "4", seq_len=16)
    text = [i for i, m in zip(ids, mask) if m][1:-1]  # (less BOS and EOS)
    assert text == tok.encode("Q: 2+2=4")  # what the model reads at inference
    # the tokens that end in the response are learned (one across the boundary too), the prompt's not
    pieces = tok.tok.convert_ids_to_tokens([i for i in labels if i != -100])
    assert pieces[-1] == "</s>" and pieces[-2].endswith("4") and "\u2581Q:" not in pieces, pieces


def test_build_datasets_from_files(tmp_path):
    tok = data.ByteTokenizer()
    txt = tmp_path / "corpus.txt"
    txt.write_text("hello world\n" * 200)
    train, held, desc = data.build_datasets(str(txt), tok, seq_len=16, eval_fraction=0.1)
    assert isinstance(train, data.TokenStream) and "LM" in desc
    assert len(train) + len(held) == 200 * 12 + 2

    jsonl = tmp_path / "sft.jsonl"
    jsonl.write_text("\n".join(json.dumps({"prompt": f"q{i}", "response": f"a{i}"}) for i in range(20)) + "\n")
    train, held, desc = data.build_datasets(str(jsonl), tok, seq_len=16, eval_fraction=0.1)
    assert isinstance(train, data.SFTExamples) and (len(train), len(held)) == (18, 2)
    batch = train.global_batch(seed=0, step=0, size=4)
    assert set(batch) == {"input_ids", "labels", "attention_mask"}
    masked = batch["labels"] == -100
    assert torch.all(masked[batch["attention_mask"] == 0])  # padding never scored
    assert torch.all(batch["input_ids"][~masked] == batch["labels"][~masked])


def test_sequences_longer_than_the_text_are_refused_naming_the_fixes(tmp_path):
    tok = data.ByteTokenizer()
    txt = tmp_path / "corpus.txt"
    txt.write_text("hello world\n" * 200)   # 2402 tokens: 2162 train, 240 held out
    data.build_datasets(str(txt), tok, seq_len=240, eval_fraction=0.1)
    with pytest.raises(ValueError, match=r"--seq-len 241 is longer than the held-out text of .*corpus\.txt \(240 tokens; "
                                         r"--eval-fraction 0\.1 of 2,402 is held out\): lower --seq-len, or give more "
                                         r"text \(--max-bytes, a larger --data file\) or hold out more \(--eval-fraction\)"):
        data.build_datasets(str(txt), tok, seq_len=241, eval_fraction=0.1)
    with pytest.raises(ValueError, match=r"--seq-len 5000 is longer than the training text .*\(2,162 tokens;.*a larger "
                                         r"--data file\)$"):
        data.build_datasets(str(txt), tok, seq_len=5000, eval_fraction=0.1)


def test_sft_examples_without_a_response_token_are_left_out_or_refused(tmp_path):
    tok = data.ByteTokenizer()
    jsonl = tmp_path / "sft.jsonl"
    rows = [{"prompt": "p" * (30 if i % 2 else 3), "response": "ok" * (10 if i % 4 == 1 else 1)} for i in range(20)]
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    train, held, desc = data.build_datasets(str(jsonl), tok, seq_len=16, eval_fraction=0.1)
    assert (len(train), len(held)) == (18, 2), desc
    assert desc.endswith("(5 with the prompt cut from the left to fit --seq-len 16; 5 with the response cut too "
                         "(its end and EOS not learned))"), desc
    assert all((train.labels[i, 1:] != -100).any() for i in range(len(train)))
    jsonl.write_text("\n".join(json.dumps({"prompt": "p" * 4, "response": ""}) for _ in range(20)) + "\n")
    with pytest.raises(ValueError, match=r"none of the 18 training examples has a response token to learn at --seq-len "
                                         r"16 \(each needs a non-empty response, or an EOS token the tokenizer has"):
        data.build_datasets(str(jsonl), _NoEosTokenizer(), seq_len=16, eval_fraction=0.1)


def test_lr_schedule_shape():
    kw = dict(lr=1e-3, warmup_steps=5, total_steps=50, min_lr_ratio=0.1)
    lrs = [lr_at(s, **kw) for s in range(50)]
    warm, decay = lrs[:5], lrs[4:]
    assert all(a < b for a, b in zip(warm, warm[1:]))  # warmup rises
    assert warm[0] == pytest.approx(1e-3 / 5) and warm[-1] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(decay, decay[1:]))  # cosine never rises
    assert lrs[-1] == pytest.approx(1e-4)  # reaches the floor at the last step
    assert min(lrs[5:]) >= 1e-4 - 1e-12
    mid = 5 + (50 - 1 - 5) // 2
    assert lrs[mid] == pytest.approx(1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * (mid - 5) / 44)))


def test_lr_schedule_without_warmup():
    lrs = [lr_at(s, lr=1.0, warmup_steps=0, total_steps=10, min_lr_ratio=0.0) for s in range(10)]
    assert lrs[0] == pytest.approx(1.0) and lrs[-1] == pytest.approx(0.0)


def test_finetune_config_from_command_line():
    import finetune

    cfg = finetune.parse_config(["--steps", "20", "--lr", "3e-4", "--param-dtype", "bf16",
                                 "--model", "/some/path", "--micro_batch", "2"])
    assert (cfg.steps, cfg.lr, cfg.param_dtype, cfg.model, cfg.micro_batch) == (20, 3e-4, "bf16", "/some/path", 2)
    assert finetune.parse_config([]) == finetune.FinetuneConfig()
    with pytest.raises(SystemExit):
        finetune.parse_config(["--param-dtype", "fp8"])


def test_checkpoint_layers_beyond_the_model_are_refused_before_the_run(tmp_path, capsys):
    """--checkpoint-layers is checked against the chosen model's config when the command line is
    parsed, before the data is read or anything is built."""
    import finetune
    import pretrain

    with pytest.raises(SystemExit):
        pretrain.parse_config(["--checkpoint-layers", "5"])  # the tiny preset has 4 layers
    assert "--checkpoint-layers 5 but the tiny preset has 4 decoder layers: pass at most 4" in capsys.readouterr().err
    assert pretrain.parse_config(["--checkpoint-layers", "4"]).checkpoint_layers == 4
    with pytest.raises(SystemExit):
        pretrain.parse_config(["--model-size", "small", "--checkpoint-layers", "9"])
    assert "the small preset has 8 decoder layers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        pretrain.parse_config(["--checkpoint-layers", "-1"])
    assert "--checkpoint-layers -1 must be >= 0" in capsys.readouterr().err
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    with pytest.raises(SystemExit):
        finetune.parse_config(["--model", str(folder), "--checkpoint-layers", "3"])
    assert f"--checkpoint-layers 3 but --model {folder} has 2 decoder layers: pass at most 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        pretrain.parse_config(["--config", str(folder / "config.json"), "--checkpoint-layers", "3"])
    assert "has 2 decoder layers" in capsys.readouterr().err
    assert finetune.parse_config(["--model", str(folder), "--checkpoint-layers", "2"]).checkpoint_layers == 2


class _NoEosTokenizer(data.ByteTokenizer):
    eos_id = None


def test_the_default_held_out_text_is_whole_documents_spread_through_the_library():
    """The held-out text was the sorted tail of the standard library, the codec tables
    encodings/cp86x.py, 83% of whose 32-byte windows were in the training text (its other cp*.py)."""
    docs = data.stdlib_documents(max_bytes=1_000_000)
    tok = data.ByteTokenizer()
    train, held = data.split_documents(docs, tok, 0.05, "stdlib")
    assert 0.04 < held.numel() / (train.numel() + held.numel()) < 0.06
    streams = [bytes(x for x in t.tolist() if x < 256) for t in (train, held)]
    seen = {streams[0][i:i + 32] for i in range(len(streams[0]) - 32)}
    windows = [streams[1][i:i + 32] for i in range(0, len(streams[1]) - 32, 97)]
    assert sum(w in seen for w in windows) / len(windows) < 0.2
    assert not any("_sysconfigdata" in d[:2000] and "BINDIR" in d for d in docs)  # (install paths)


def test_a_byte_cap_never_cuts_a_character_in_two(tmp_path):
    txt = tmp_path / "t.txt"
    txt.write_text("a\u20ac", encoding="utf-8")  # 1 + 3 bytes
    assert data.text_file_documents(txt, max_bytes=3) == ["a"]  # (was "a\ufffd", a character not in the file)
    assert data.text_file_documents(txt, max_bytes=4) == ["a\u20ac"]
