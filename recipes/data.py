"""Data helpers for recipes/finetune.py: tokenizers, text sources, batching.

Nothing here touches torch.distributed. Every rank builds the same data and draws the same global
batch from a generator seeded by (seed, step); each rank then keeps only its own rows. That keeps
ranks in step with no data communication, and the results don't depend on the world size: with 1
or 8 ranks, step k trains on the same global batch.

Label convention: HuggingFace causal-LM models shift labels internally (position t is scored
against labels[t + 1]), so a batch holds ``input_ids`` and ``labels`` of the same length, and
``labels`` is a copy of ``input_ids`` with -100 wherever no loss should be taken. A window of
seq_len tokens therefore gives seq_len - 1 next-token predictions.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from pathlib import Path

import torch

IGNORE_INDEX = -100  # the label value HF losses skip


# --------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------


class ByteTokenizer:
    """Byte-level tokenizer: ids 0-255 are the UTF-8 bytes, followed by PAD, BOS and EOS."""

    pad_id = 256
    bos_id = 257
    eos_id = 258
    vocab_size = 259

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_pair(self, prompt: str, response: str) -> tuple[list[int], list[int]]:
        """(prompt ids, response ids): bytes split where the text splits."""
        return self.encode(prompt), self.encode(response)

    def decode(self, ids) -> str:
        """Bytes back to text; special ids are dropped and invalid UTF-8 is replaced."""
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else ids
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """Gives a HuggingFace tokenizer the same small interface as ByteTokenizer."""

    def __init__(self, tok):
        self.tok = tok
        self.vocab_size = len(tok)
        self.bos_id = tok.bos_token_id
        self.eos_id = tok.eos_token_id
        # Many decoder tokenizers have no pad token; padding is never scored, so EOS stands in.
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        if self.pad_id is None:
            self.pad_id = 0

    def encode(self, text: str) -> list[int]:
        # verbose=False: don't warn when a whole document is longer than model_max_length.
        return self.tok(text, add_special_tokens=False, verbose=False)["input_ids"]

    def encode_pair(self, prompt: str, response: str) -> tuple[list[int], list[int]]:
        """(prompt ids, response ids) as the tokenizer splits ``prompt + response``, the text the
        model reads at inference: tokenized apart, the response would start a word of its own
        (SentencePiece's leading "▁": an extra space the data does not have). A token across the
        boundary counts as response. Tokenizers without offsets (slow ones) encode them apart."""
        if not prompt or not getattr(self.tok, "is_fast", False):
            return self.encode(prompt), self.encode(response)
        enc = self.tok(prompt + response, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        cut = next((i for i, (_, end) in enumerate(offsets) if end > len(prompt)), len(ids))
        return ids[:cut], ids[cut:]

    def decode(self, ids) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


def load_tokenizer(path: str | None):
    """``None`` gives the byte-level tokenizer; otherwise ``AutoTokenizer.from_pretrained(path)``."""
    if path is None:
        return ByteTokenizer()
    from transformers import AutoTokenizer

    return HFTokenizer(AutoTokenizer.from_pretrained(path))


def _with_specials(tok, ids: list[int]) -> list[int]:
    """Wrap one document in BOS ... EOS (for the ids the tokenizer has)."""
    head = [tok.bos_id] if tok.bos_id is not None else []
    tail = [tok.eos_id] if tok.eos_id is not None else []
    return head + ids + tail


# --------------------------------------------------------------------------------------------
# Text sources
# --------------------------------------------------------------------------------------------

# Left out of the default text: test suites and installed packages; "encodings" (about a hundred
# generated, nearly identical codec tables: split between training and held-out text, the held-out
# loss measured recall of the training copies); and files an installation writes for itself
# (_sysconfigdata* with its install paths, config-3.x-*/, Debian's _distutils_system_mod.py)
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "encodings"}
_SKIP_FILES = ("_sysconfigdata", "_distutils_system_mod")


def _stdlib_file_ok(rel: Path) -> bool:
    dirs = rel.parts[:-1]
    return not (_SKIP_DIRS.intersection(dirs) or any(d.startswith("config-") for d in dirs)
                or rel.name.startswith(_SKIP_FILES))


def stdlib_documents(max_bytes: int = 4_000_000) -> list[str]:
    """Source files of the Python standard library: real text found on any machine.

    Takes the .py files in sorted path order (what ``_stdlib_file_ok`` leaves out aside) until
    ``max_bytes`` of source is collected; the same files in the same order on every rank of one
    installation. Another Python release or build has other files (recipes/train_setup.py checks that
    every rank, and a resumed run, reads the same text).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if _stdlib_file_ok(p.relative_to(root)))
    docs, total = [], 0
    for path in files:
        if total >= max_bytes:
            break
        raw = _whole_characters(path.read_bytes()[: max_bytes - total])
        docs.append(raw.decode("utf-8", errors="replace"))
        total += len(raw)
    if not docs:
        raise FileNotFoundError(f"no .py files found under the standard library at {root}")
    return docs


def text_file_documents(path: str | Path, max_bytes: int | None = None) -> list[str]:
    """A plain .txt file as one document (first ``max_bytes`` bytes when given)."""
    raw = Path(path).read_bytes()
    if max_bytes is not None:
        raw = _whole_characters(raw[:max_bytes])
    return [raw.decode("utf-8", errors="replace")]


def _whole_characters(raw: bytes) -> bytes:
    """``raw`` less a UTF-8 character that a byte cap cut in two at its end (decoded, its first bytes
    became a U+FFFD, text that is not in the file)."""
    for back in range(1, min(4, len(raw)) + 1):
        byte = raw[-back]
        if byte & 0xC0 != 0x80:  # the last character's first byte: its length from the lead bits
            length = 1 if byte < 0x80 else 2 if byte >> 5 == 0b110 else 3 if byte >> 4 == 0b1110 else 4
            return raw[:-back] if byte >= 0xC0 and length > back else raw
    return raw


def read_jsonl_pairs(path: str | Path) -> list[tuple[str, str]]:
    """(prompt, response) pairs from a .jsonl file with one {"prompt", "response"} object a line."""
    pairs = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno}); every line must be "
                                 "one {\"prompt\": ..., \"response\": ...} object") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{lineno}: expected a {{\"prompt\": ..., \"response\": ...}} object, got "
                                 f"a JSON {type(obj).__name__}")
            if "prompt" not in obj or "response" not in obj:
                raise ValueError(f"{path}:{lineno}: expected keys 'prompt' and 'response', got {sorted(obj)}")
            for key in ("prompt", "response"):  # (str() would train on "None" or a list's repr)
                if not isinstance(obj[key], str):
                    raise ValueError(f"{path}:{lineno}: '{key}' must be a string, got "
                                     f"{'null' if obj[key] is None else 'a JSON ' + type(obj[key]).__name__}")
            pairs.append((obj["prompt"], obj["response"]))
    if not pairs:
        raise ValueError(f"{path}: no examples")
    return pairs


def tokenize_documents(docs: list[str], tok) -> torch.Tensor:
    """One 1-D token stream: BOS doc EOS BOS doc EOS ..."""
    ids: list[int] = []
    for doc in docs:
        ids.extend(_with_specials(tok, tok.encode(doc)))
    return torch.tensor(ids, dtype=torch.long)


def split_documents(docs: list[str], tok, eval_fraction: float, source: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(training stream, held-out stream) of several documents: whole documents are held out,
    spread through the list (each one that keeps the held-out share of the tokens so far nearest
    ``eval_fraction``), so the held-out text is neither a piece of a training document nor one
    corner of the collection (the stdlib's sorted tail was one package). One document: its last
    ``eval_fraction`` of tokens (:func:`split_train_eval`)."""
    if len(docs) < 2:
        return split_train_eval(tokenize_documents(docs, tok), eval_fraction, "tokens", source)
    train: list[int] = []
    held: list[int] = []
    total = 0
    for doc in docs:
        ids = _with_specials(tok, tok.encode(doc))
        total += len(ids)
        (held if len(held) + len(ids) / 2 < eval_fraction * total else train).extend(ids)
    if not held or not train:  # (one document holds nearly all the text)
        return split_train_eval(torch.tensor(train + held, dtype=torch.long), eval_fraction, "tokens", source)
    return torch.tensor(train, dtype=torch.long), torch.tensor(held, dtype=torch.long)


# --------------------------------------------------------------------------------------------
# Datasets: both answer ``global_batch(seed, step, size)`` with a dict of [size, seq_len] tensors
# --------------------------------------------------------------------------------------------

TRAIN_STREAM, EVAL_STREAM = 0, 1


def batch_generator(seed: int, step: int, stream: int = TRAIN_STREAM) -> torch.Generator:
    """A generator that depends only on (seed, step, stream): same draws on every rank.

    Seeding per step (rather than advancing one generator) makes batch k independent of how many
    batches were drawn before it, e.g. by evaluation.
    """
    return torch.Generator().manual_seed(seed * 1_000_003 + stream * 100_003 + step)


class TokenStream:
    """Plain language modelling on a 1-D token stream: random contiguous windows of seq_len."""

    def __init__(self, tokens: torch.Tensor, seq_len: int):
        if tokens.dim() != 1:
            raise ValueError("tokens must be a 1-D stream")
        if tokens.numel() < seq_len:
            raise ValueError(f"only {tokens.numel()} tokens, fewer than seq_len={seq_len}")
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return self.tokens.numel()

    def global_batch(self, seed: int, step: int, size: int, stream: int = TRAIN_STREAM) -> dict:
        g = batch_generator(seed, step, stream)
        starts = torch.randint(0, self.tokens.numel() - self.seq_len + 1, (size,), generator=g)
        windows = self.tokens[starts[:, None] + torch.arange(self.seq_len)]
        return {"input_ids": windows, "labels": windows.clone()}


def encode_sft_example(tok, prompt: str, response: str, seq_len: int) -> tuple[list[int], list[int], list[int], str | None]:
    """(input_ids, labels, attention_mask, cut) for one prompt/response pair, padded to seq_len.

    Layout: BOS prompt response EOS PAD...; labels are -100 on BOS, the prompt and the padding, so
    only the response (and its EOS) is learned. The model learns a token from the one before it,
    so something always precedes the response: BOS, else the prompt, else (no BOS, empty prompt)
    EOS as the separator it is between documents. Too long for seq_len, the prompt is cut from the
    left first, down to one token (``cut`` = "prompt"), then the response from the right, its EOS
    first (``cut`` = "response").
    """
    head = [tok.bos_id] if tok.bos_id is not None else []
    prompt_ids, response_ids = tok.encode_pair(prompt, response)
    if not head and not prompt_ids and tok.eos_id is not None:
        head = [tok.eos_id]
    response_ids = response_ids + ([tok.eos_id] if tok.eos_id is not None else [])
    room, cut = seq_len - len(head), None
    if len(prompt_ids) + len(response_ids) > room:
        keep = max(min(1, len(prompt_ids)), room - len(response_ids))
        cut = "prompt" if keep < len(prompt_ids) else None
        prompt_ids = prompt_ids[len(prompt_ids) - keep:]
        if len(prompt_ids) + len(response_ids) > room:
            response_ids, cut = response_ids[: max(0, room - len(prompt_ids))], "response"
    ids = head + prompt_ids + response_ids  # (fits: cut above)
    labels = [IGNORE_INDEX] * (len(head) + len(prompt_ids)) + response_ids
    n_pad = seq_len - len(ids)
    mask = [1] * len(ids) + [0] * n_pad
    return ids + [tok.pad_id] * n_pad, labels + [IGNORE_INDEX] * n_pad, mask, cut


class SFTExamples:
    """Supervised fine-tuning on fixed prompt/response examples, each padded to seq_len."""

    def __init__(self, pairs: list[tuple[str, str]], tok, seq_len: int, what: str = "examples"):
        rows = [encode_sft_example(tok, p, r, seq_len) for p, r in pairs]
        self.cut_prompts = sum(r[3] == "prompt" for r in rows)
        self.cut_responses = sum(r[3] == "response" for r in rows)
        # An example with no token to learn (an empty response and no EOS, or --seq-len 2 and a
        # BOS): a micro-batch of only such examples would average the loss over zero tokens (NaN).
        # They are left out. (Position 0 is never scored: HF shifts the labels by one.)
        kept = [r for r in rows if any(label != IGNORE_INDEX for label in r[1][1:])]
        self.dropped = len(rows) - len(kept)
        if not kept:
            raise ValueError(
                f"none of the {len(rows)} {what} has a response token to learn at --seq-len {seq_len} (each needs a "
                "non-empty response, or an EOS token the tokenizer has, after at least one token of context): "
                "check the responses, or raise --seq-len"
            )
        rows = kept
        self.input_ids = torch.tensor([r[0] for r in rows], dtype=torch.long)
        self.labels = torch.tensor([r[1] for r in rows], dtype=torch.long)
        self.attention_mask = torch.tensor([r[2] for r in rows], dtype=torch.long)
        self.seq_len = seq_len

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def global_batch(self, seed: int, step: int, size: int, stream: int = TRAIN_STREAM) -> dict:
        g = batch_generator(seed, step, stream)
        idx = torch.randint(0, len(self), (size,), generator=g)
        return {"input_ids": self.input_ids[idx], "labels": self.labels[idx],
                "attention_mask": self.attention_mask[idx]}


def split_train_eval(items, eval_fraction: float, what: str = "items", source: str | None = None):
    """Last ``eval_fraction`` of a token stream or example list is held out (at least one item, and at
    least one is left to train on); ``what`` and ``source`` name the items and where they come from in
    the error."""
    n = len(items)
    n_eval = max(1, int(round(n * eval_fraction)))
    if n_eval >= n:
        if n < 2:
            count = f"{n} {what[:-1] if n == 1 and what.endswith('s') else what}"
            raise ValueError(f"{source + ' has' if source else 'the data has'} only {count}: at least 2 are needed, one "
                             "held out for evaluation (--eval-fraction) and at least one to train on; give more data")
        raise ValueError(f"--eval-fraction {eval_fraction} of the {n} {what} {f'in {source} ' if source else ''}holds out "
                         f"{n_eval}, leaving none to train on: lower --eval-fraction, or give more data")
    return items[: n - n_eval], items[n - n_eval :]


def build_datasets(data: str | None, tok, seq_len: int, eval_fraction: float = 0.05,
                   max_bytes: int = 4_000_000):
    """(train, held_out, description) for the --data option.

    None: Python standard library sources; *.txt: plain LM on the file; *.jsonl: SFT pairs.
    """
    if data is not None and data.endswith(".jsonl"):
        train, held = split_train_eval(read_jsonl_pairs(data), eval_fraction, "examples", data)
        train, held = SFTExamples(train, tok, seq_len, "training examples"), SFTExamples(held, tok, seq_len, "held-out examples")
        notes = [f"{n} {what}" for n, what in (
            (train.cut_prompts + held.cut_prompts, f"with the prompt cut from the left to fit --seq-len {seq_len}"),
            (train.cut_responses + held.cut_responses, "with the response cut too (its end and EOS not learned)"),
            (train.dropped + held.dropped, "left out: no response token to learn")) if n]
        note = f" ({'; '.join(notes)})" if notes else ""
        return train, held, f"SFT {data}: {len(train)} train / {len(held)} held-out examples{note}"
    if data is None:
        docs, name = stdlib_documents(max_bytes), "Python stdlib sources"
    else:
        docs, name = text_file_documents(data, max_bytes), data
    train, held = split_documents(docs, tok, eval_fraction, name)
    for part, n in (("training", train.numel()), ("held-out", held.numel())):
        if n < seq_len:
            raise ValueError(
                f"--seq-len {seq_len} is longer than the {part} text of {name} ({n:,} tokens; --eval-fraction "
                f"{eval_fraction} of {train.numel() + held.numel():,} is held out): lower --seq-len, or give more text "
                "(--max-bytes, a larger --data file)" + (" or hold out more (--eval-fraction)" if part == "held-out" else "")
            )
    return (TokenStream(train, seq_len), TokenStream(held, seq_len),
            f"LM {name}: {train.numel():,} train / {held.numel():,} held-out tokens")


def data_digest(*datasets) -> str:
    """A short hash of the token ids (and labels) of ``datasets``: equal on ranks, and across runs,
    that read the same text the same way."""
    h = hashlib.sha256()
    for d in datasets:
        for t in ((d.tokens,) if isinstance(d, TokenStream) else (d.input_ids, d.labels, d.attention_mask)):
            h.update(t.numpy().tobytes())
    return h.hexdigest()[:16]


# --------------------------------------------------------------------------------------------
# Slicing a global batch
# --------------------------------------------------------------------------------------------


def rank_slice(batch: dict, rank: int, world_size: int) -> dict:
    """This rank's contiguous block of rows of the global batch."""
    size = next(iter(batch.values())).shape[0]
    if size % world_size:
        raise ValueError(f"global batch of {size} rows does not divide over {world_size} ranks")
    per = size // world_size
    return {k: v[rank * per : (rank + 1) * per] for k, v in batch.items()}


def micro_batches(batch: dict, accum_steps: int) -> list[dict]:
    """Split a rank's rows into ``accum_steps`` equal micro-batches."""
    size = next(iter(batch.values())).shape[0]
    if size % accum_steps:
        raise ValueError(f"{size} rows do not split into {accum_steps} micro-batches")
    per = size // accum_steps
    return [{k: v[i * per : (i + 1) * per] for k, v in batch.items()} for i in range(accum_steps)]
