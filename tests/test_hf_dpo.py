"""TRL's DPOTrainer through ``yashard.hf.sharded_trainer`` matches its DDP run step for step.

Two gloo ranks on CPU, a tiny Llama, an in-memory preference dataset, fp32, 2 steps; workers in
tests/hf_workers.py. With ``peft_config`` the reference is the base model with the adapter disabled
(yashard.hf names it: TRL does not see the PeftModel inside a sharded model); without PEFT, TRL loads
the reference from the model's folder, which Accelerate prepares for evaluation only: unsharded."""

from __future__ import annotations

import math

import pytest

import hf_workers
from harness import run_distributed

pytestmark = pytest.mark.slow

KEYS = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
        "logps/rejected", "entropy")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("dpo")
    cases = ["peft", "folder"]
    return (run_distributed(hf_workers.dpo_run, 2, "ddp", str(out / "ddp"), cases)[0],
            run_distributed(hf_workers.dpo_run, 2, "yashard", str(out / "yashard"), cases)[0])


def assert_same_steps(got: list[dict], want: list[dict], tol: float = 1e-5) -> None:
    assert [s["step"] for s in got] == [s["step"] for s in want] == [1, 2]
    for g, w in zip(got, want):
        for k in KEYS:
            # (rel 1e-5; margins are differences of nearly equal rewards: abs 1e-5 near zero)
            assert math.isclose(g[k], w[k], rel_tol=tol, abs_tol=tol), (k, g, w)


def test_dpo_with_peft_config_matches_ddp(runs):
    want, got = (r["peft"] for r in runs)
    assert want["ref_model"] == "NoneType"  # (TRL on DDP: the adapter disabled)
    assert got["model"] == "ShardedModel" and got["ref_model"] == "AdapterOffReference"
    assert got["steps"][0]["rewards/chosen"] != 0  # (OLoRA moves the base weights: the reference differs at step 1)
    assert_same_steps(got["steps"], want["steps"])


def test_dpo_without_peft_matches_ddp_with_an_unsharded_reference(runs):
    want, got = (r["folder"] for r in runs)
    assert got["model"] == "ShardedModel" and got["ref_model"] == want["ref_model"] == "LlamaForCausalLM"
    assert got["steps"][1]["rewards/chosen"] != 0
    assert_same_steps(got["steps"], want["steps"])
