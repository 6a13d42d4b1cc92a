"""QLoRA on yashard: LoRA on a bitsandbytes 4-bit base (NF4, uint8 and bf16 storage, with and without
double quantisation) trains at W=1, 2 and 3 as the same training on one process, step by step; the
4-bit layers are gathered as packed bytes with their quantisation state, bitwise what the unsharded
model holds; ``prepare_model_for_kbit_training`` and its gradient checkpointing work; the saved
adapter loads onto the 4-bit base with the same logits; the plan equals what is held; what yashard
cannot shard of a quantised base is refused by name."""

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

import yashard  # noqa: E402
from harness import run_distributed  # noqa: E402
from qlora_workers import VARIANTS, bnb_config, qlora_model, save_tiny, train_reference, train_sharded, train_variants  # noqa: E402
from yashard.packed import Record, byte_shard_align, record  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny(str(tmp_path_factory.mktemp("tiny") / "llama"))


_REFS: dict = {}


def reference(folder: str, variant: str) -> dict:
    if variant not in _REFS:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            _REFS[variant] = train_reference(folder, variant)
        finally:
            torch.set_num_threads(threads)
    return _REFS[variant]


def check(res: dict, ref: dict, variant: str) -> None:
    bf16 = VARIANTS[variant][2] == torch.bfloat16  # (bf16 compute: bf16 tolerance)
    rel = [abs(a - b) / abs(b) for a, b in zip(res["losses"], ref["losses"])]
    assert max(rel) < (5e-4 if bf16 else 1e-5), (variant, res["losses"], ref["losses"])
    # (bf16: the sharded model's fused chunked loss rounds its bf16 logits per chunk, the reference's
    # HF loss all at once: gradient norms 2.6e-3 apart were seen, a third of bf16's 7.8e-3 epsilon)
    assert max(abs(a - b) / b for a, b in zip(res["norms"], ref["norms"])) < (5e-3 if bf16 else 1e-4), variant
    for step, (got, want) in enumerate(zip(res["steps"], ref["steps"])):
        assert set(got) == set(want)
        worst = max((got[k] - want[k]).abs().max().item() / want[k].abs().max().item() for k in want)
        assert worst < (1e-2 if bf16 else 2e-3), (variant, step, worst)
    assert (res["logits"] - ref["logits"]).abs().max().item() < (1e-2 if bf16 else 2e-3), variant
    # the gathered layer is bitwise the unsharded 4-bit weights and state, as views of the byte slot
    assert all(res["same_weights"]), res["same_weights"]
    assert res["slot_dtypes"]["layer_even"] == torch.uint8 and res["slot_dtypes"]["outer"] == torch.float32
    # a layer's gather moves its packed bytes: under a third of the same layer in bf16
    assert res["layer_gathers"] == [res["layer_bytes"]]
    assert res["layer_bytes"] < 0.4 * res["layer_bf16_bytes"]
    # only the adapters train: AdamW's state is theirs alone, and the plan is what the runtime holds
    assert res["trained_units"] == ["adapters"]
    assert res["opt_bytes"] == res["adamw_bytes"]
    assert res["plan"] == res["allocated"]
    assert res["rows"]["4-bit shards"] > 0
    assert res["planned"] == res["rows"]  # yashard.plan, from the model alone, row for row


def test_two_ranks_match_one_process_and_the_adapter_loads_onto_the_4bit_base(folder, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    variants = ["u8", "bf16-dq-prepared", "bf16"]
    out = run_distributed(train_variants, 2, folder, variants, str(tmp_path), timeout=480)[0]
    for v in variants:
        check(out[v], reference(folder, v), v)
    # the saved adapter, on the 4-bit base in one process: the sharded model's logits
    base = AutoModelForCausalLM.from_pretrained(folder, quantization_config=bnb_config("u8"), dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, str(tmp_path / "u8")).eval()
    from qlora_workers import _data

    with torch.no_grad():
        logits = loaded(input_ids=_data()[0]).logits.float()
    assert (logits - out["u8"]["logits"]).abs().max().item() < 1e-4


def test_three_ranks_match_one_process(folder):
    # fp32 compute: with bf16 compute the backward rounds its bf16 gradients at another scale than the
    # reference (the loss of 2 of 6 rows, divided by 3 after the reduction, against the loss of all 6),
    # so they differ by a bf16 rounding (4e-3 of a gradient) from the first step on; at W=2 the scale
    # is a power of two and rounds the same
    variants = ["u8-dq", "u8-dq-prepared"]
    out = run_distributed(train_variants, 3, folder, variants, None, timeout=480)[0]
    for v in variants:
        check(out[v], reference(folder, v), v)


def test_one_rank_matches_one_process(pg, folder):
    res = train_sharded(0, 1, folder, "u8")
    ref = reference(folder, "u8")
    assert res["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    assert all(res["same_weights"])
    assert res["plan"] == res["allocated"] and res["planned"] == res["rows"]


def test_full_state_dict_holds_the_4bit_weights_as_transformers_saves_them(pg, folder):
    pm = qlora_model(folder, "u8-dq")
    want = {k: v.clone() for k, v in pm.get_base_model().state_dict().items()}
    sm = yashard.shard(pm)
    got = sm.full_state_dict()
    name = "model.layers.1.mlp.up_proj.weight"
    assert got[name].dtype == torch.uint8 and torch.equal(got[name], want[name])
    for k in want:
        if k.startswith(name + ".") and torch.is_tensor(want[k]):
            assert torch.equal(got[k], want[k]), k


def test_what_a_4bit_base_cannot_do_is_refused(pg, folder, tmp_path):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    with pytest.raises(ValueError, match="quantized_weights \\(qwZ\\) does not work with a 4-bit base"):
        yashard.shard(qlora_model(folder, "u8"), config=yashard.ShardConfig(quantized_weights=8))
    sm = yashard.shard(qlora_model(folder, "u8"))
    with pytest.raises(ValueError, match="export_hf cannot write a 4-bit base"):
        yashard.export_hf(sm, str(tmp_path / "export"))
    q = dict(load_in_4bit=True, bnb_4bit_quant_type="nf4")
    part = AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=BitsAndBytesConfig(**q, llm_int8_skip_modules=["lm_head", "down_proj"]))
    with pytest.raises(ValueError, match="down_proj.weight is not 4-bit but shares its decoder layer"):
        yashard.shard(part)
    head = AutoModelForCausalLM.from_pretrained(folder, quantization_config=BitsAndBytesConfig(
        **q, llm_int8_skip_modules=["nothing"]))
    with pytest.raises(ValueError, match="lm_head.weight is a 4-bit weight outside the decoder layers"):
        yashard.shard(head)
    half = AutoModelForCausalLM.from_pretrained(folder, quantization_config=BitsAndBytesConfig(**q))
    half.model.layers[1] = AutoModelForCausalLM.from_pretrained(folder).model.layers[1]  # (a float layer)
    with pytest.raises(ValueError, match="decoder layer 1 has no 4-bit weight while others have"):
        yashard.shard(half)
    with pytest.raises(ValueError, match="a 4-bit base is sharded from its live quantised weights"):
        yashard.shard(qlora_model(folder, "u8"), weights=folder)
    trained = qlora_model(folder, "bf16")
    trained.get_base_model().model.layers[0].mlp.up_proj.weight.requires_grad_(True)
    with pytest.raises(ValueError, match="up_proj.weight is a 4-bit weight that requires grad"):
        yashard.shard(trained)


def test_other_quantised_bases_are_refused_by_name(pg, folder):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    m8 = AutoModelForCausalLM.from_pretrained(folder, quantization_config=BitsAndBytesConfig(load_in_8bit=True))
    with pytest.raises(ValueError, match="quantised with bitsandbytes 8-bit"):
        yashard.shard(m8)
    with pytest.raises(ValueError, match="quantised with bitsandbytes 8-bit"):
        yashard.plan(m8, world_size=2, backend="gloo")
    import bitsandbytes as bnb

    raw = AutoModelForCausalLM.from_pretrained(folder)
    raw.model.layers[0].mlp.up_proj = bnb.nn.Linear4bit(64, 128, bias=False)  # (never moved: not quantised)
    with pytest.raises(ValueError, match="a bitsandbytes 4-bit weight not quantised yet"):
        yashard.shard(raw)


def test_records_align_every_part():
    rec = record([("data", 1, (2048, 1)), ("qs.absmax", 1, (64,)), ("qs.offset", 4, ()), ("qs.state2.code", 4, (256,))])
    assert isinstance(rec, Record)
    assert [(p.offset, p.nbytes) for p in rec.parts] == [(0, 2048), (2048, 64), (2112, 4), (2176, 1024)]
    assert rec.nbytes == 3200 and rec.part("qs.offset").end == 2116
    assert record([("data", 2, (3, 1))], align=64).nbytes == 64
    assert byte_shard_align(16) == 64
    with pytest.raises(ValueError, match="appears twice"):
        record([("a", 1, (1,)), ("a", 1, (1,))])
    with pytest.raises(ValueError, match="negative dimension"):
        record([("a", 1, (-1,))])


def test_from_pretrained_loads_a_4bit_base_with_a_peft_config(pg, folder):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from qlora_workers import LORA, _data

    torch.manual_seed(100)
    sm = yashard.from_pretrained(folder, quantization_config=bnb_config("u8-dq"), peft_config=LoraConfig(**LORA))
    torch.manual_seed(100)
    ref = get_peft_model(AutoModelForCausalLM.from_pretrained(folder, quantization_config=bnb_config("u8-dq"),
                                                              dtype=torch.float32), LoraConfig(**LORA))
    ids = _data()[0]
    assert sm.runtime.layers[0].rebuild is not None
    assert torch.equal(sm(input_ids=ids, labels=ids).loss, ref(input_ids=ids, labels=ids).loss)


def test_from_pretrained_refuses_other_quantisations_by_name(pg, folder):
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig

    with pytest.raises(ValueError, match="asks for bitsandbytes 8-bit \\(load_in_8bit\\); yashard shards bitsandbytes 4-bit"):
        yashard.from_pretrained(folder, quantization_config=BitsAndBytesConfig(load_in_8bit=True))
    with pytest.raises(TypeError, match="load_in_4bit=...\\): in transformers it is the old spelling of quantization_config"):
        yashard.from_pretrained(folder, load_in_4bit=True)
    with pytest.raises(ValueError, match="peft_config=...\\) goes with a 4-bit base"):
        yashard.from_pretrained(folder, peft_config=LoraConfig(r=4))


def test_a_checkpoint_resumes_at_another_world_size(folder, tmp_path):
    from qlora_workers import checkpoint_round_trip

    path = str(tmp_path / "ckpt")
    saved = run_distributed(checkpoint_round_trip, 2, folder, path, True, timeout=480)[0]
    resumed = run_distributed(checkpoint_round_trip, 3, folder, path, False, timeout=480)[0]
    assert resumed["loss"] == pytest.approx(saved["loss"], rel=1e-5)
    assert set(resumed["state"]) == set(saved["state"])
    for k, v in saved["state"].items():
        if ".lora_" in k:
            assert (resumed["state"][k] - v).abs().max() <= 2e-3 * v.abs().max(), k
        else:  # the 4-bit weights and their state, the norms, the embedding: bitwise
            assert torch.equal(resumed["state"][k], v), k


def test_the_finetune_recipe_refuses_freeze_with_qlora():
    import test_recipes  # noqa: F401  (puts recipes/ on the path)

    import finetune

    with pytest.raises(ValueError, match="--qlora trains LoRA adapters on a frozen 4-bit base: --freeze embed"):
        finetune.FinetuneConfig(qlora=True, freeze="embed").validate()


def test_the_finetune_recipe_trains_qlora_and_writes_the_adapter(tmp_path):
    from peft import PeftConfig
    from safetensors.torch import load_file
    from test_recipes import COMMON, read_log, run_recipe

    out = tmp_path / "out"
    stdout = run_recipe("finetune.py", "--qlora", "--steps", "2", "--eval-every", "0", "--eval-batches", "1",
                        "--save-every", "0", "--out-dir", str(out), *COMMON)
    assert "4-bit shards" in stdout  # (the memory plan, printed by rank 0)
    log = read_log(out / "log.jsonl")
    assert [r["step"] for r in log if "loss" in r] == [1, 2]
    assert PeftConfig.from_pretrained(str(out / "final")).r == 16
    assert all(".lora_" in k for k in load_file(out / "final" / "adapter_model.safetensors"))


def test_the_hf_trainer_trains_qlora_and_saves_the_adapter(folder, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from qlora_workers import _data, train_with_trainer

    out = str(tmp_path / "out")
    res = run_distributed(train_with_trainer, 2, folder, out, timeout=480)[0]
    assert res["steps"] == 2 and res["loss"] > 0
    base = AutoModelForCausalLM.from_pretrained(folder, quantization_config=bnb_config("u8"), dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, out).eval()
    with torch.no_grad():
        logits = loaded(input_ids=_data()[0][:2]).logits.float()
    assert (logits - res["logits"]).abs().max().item() < 2e-3


def test_sft_trainer_takes_a_folder_with_a_4bit_quantization_config_and_peft_config(folder, tmp_path):
    """TRL's QLoRA call: the adapters keep fp32 masters (TRL's bf16 cast of a quantised model's
    adapters does not reach them), and the saved adapter loads onto the 4-bit base with the
    sharded model's logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from qlora_workers import _data, train_with_sft_trainer

    out = str(tmp_path / "sft")
    res = run_distributed(train_with_sft_trainer, 2, folder, out, timeout=480)[0]
    assert res["steps"] == 2 and res["loss"] > 0 and res["dtypes"] == ["torch.float32"], res
    base = AutoModelForCausalLM.from_pretrained(folder, quantization_config=bnb_config("u8-dq"), dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, out).eval()
    with torch.no_grad():
        logits = loaded(input_ids=_data()[0][:2]).logits.float()
    assert (logits - res["logits"]).abs().max().item() < 2e-3
