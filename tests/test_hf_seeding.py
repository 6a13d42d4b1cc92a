"""yashard.hf's trainers build the model in TRL's order: ``set_seed(args.seed)``, the folder loaded
with ``model_init_kwargs``, ``peft_config`` applied; so the adapters, and the whole run, are those of
TRL's SFTTrainer on DDP with the same ``seed``, whatever the script drew before.

Two gloo ranks on CPU, a tiny 2-layer Gemma2 (tied embeddings), LoRA on every linear layer with
PEFT's default init (lora_A random), gradient accumulation 2, 2 steps; workers in
tests/hf_init_workers.py."""

from __future__ import annotations

import math

import pytest

import hf_init_workers
from harness import run_distributed

pytestmark = pytest.mark.slow

CASES = ["object", "object", "folder", "folder-bf16"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("seeding")
    # (TRL builds the same model and adapters from the folder as from the object: DDP's object run is the
    # reference of both yashard runs)
    ddp = run_distributed(hf_init_workers.sft_cases, 2, "ddp", str(out / "ddp"), ["object", "folder-bf16"],
                          timeout=600)[0]
    got = run_distributed(hf_init_workers.sft_cases, 2, "yashard", str(out / "y"), CASES, timeout=600)[0]
    return {r["case"]: r for r in ddp}, got


def close(a: float, b: float, tol: float) -> bool:
    return math.isclose(a, b, rel_tol=tol, abs_tol=tol)


def assert_same_steps(got, want, tol=1e-5, keys=("loss", "grad_norm")):
    assert [s["step"] for s in got] == [s["step"] for s in want] == [1, 2]
    for g, w in zip(got, want):
        for k in keys:
            assert close(g[k], w[k], tol), (k, g, w)


def test_a_peft_config_run_is_the_same_run_twice_bitwise(runs):
    _, got = runs
    first, second = got[0]["steps"], got[1]["steps"]
    assert [(s["loss"], s["grad_norm"]) for s in first] == [(s["loss"], s["grad_norm"]) for s in second]


def test_a_peft_config_run_equals_trl_on_ddp_with_the_same_seed(runs):
    ddp, got = runs
    assert_same_steps(got[0]["steps"], ddp["object"]["steps"])


def test_a_folder_with_peft_config_trains_as_trl_on_ddp(runs):
    ddp, got = runs
    assert got[2]["case"] == "folder" and got[2]["dtype"] == ddp["object"]["dtype"] == "torch.float32"
    assert_same_steps(got[2]["steps"], ddp["object"]["steps"])
    assert_same_steps(got[2]["steps"], got[0]["steps"], tol=1e-6)  # (the folder holds the object's weights)


def test_a_folder_with_a_bf16_model_init_dtype_computes_in_bf16_as_ddp(runs):
    """DDP trains the bf16 weights themselves, yashard computes in bf16 over fp32 masters: step 1's
    forward is the same bf16 model; later steps differ by the masters' precision."""
    ddp, got = runs
    want, mine = ddp["folder-bf16"], got[3]
    assert mine["dtype"] == want["dtype"] == "torch.bfloat16"
    assert close(mine["steps"][0]["loss"], want["steps"][0]["loss"], 1e-3), (mine["steps"], want["steps"])
    assert not [m for m in mine["warnings"] if "ShardConfig" in m or "param_dtype" in m], mine["warnings"]


def test_what_building_the_model_refuses_names_the_fix(tmp_path):
    got = run_distributed(hf_init_workers.init_refusals, 1, str(tmp_path))[0]
    assert got["peft_model"].startswith("peft_config= with a PeftModel: merge and unload its adapter"), got
    assert got["quantization"].startswith("quantization_config= with a loaded model: TRL would ignore it. Load "
                                          "the model quantised"), got
    assert got["quantization_twice"].startswith("quantization_config= and model_init_kwargs['quantization_config'] "
                                                "both given"), got
    assert got["quantization_8bit"].startswith("yashard.from_pretrained(quantization_config=...) asks for "
                                               "bitsandbytes 8-bit (load_in_8bit)"), got
    for name in ("float16", "float16_peft"):
        assert "yashard.hf computes in fp32 or bf16; pass model_init_kwargs={'dtype': 'bfloat16'}" in got[name], got
    assert got["bad_dtype"] == "model_init_kwargs dtype='int8': pass 'float32', 'bfloat16' or 'auto'", got
    assert got["chat_template"].startswith(f"chat_template_path={str(tmp_path / 'gemma2')!r} with yashard.hf: TRL "
                                           "would copy that tokenizer's chat template"), got
    assert "trl.clone_chat_template(model, tokenizer, path)" in got["chat_template"]
