"""``ShardConfig(step_in_backward=True)``: each unit's optimizer steps in backward, from the
reduce-scatter output. Step for step equal to the ordinary step (fp32, 1e-6) at worlds 1-3, with
an LR schedule; memory fixed from step one and equal to the plan, with no gradient-shard row;
checkpoints (yashard's and DCP) resume and reshard across world sizes and across the two modes;
every refusal by its message."""

import pytest
import torch

import yashard
from harness import run_distributed
from models import tiny_config
from step_bwd_workers import checkpoints, parity, refusals, unreached
from workers import rel_err

# name -> (ShardConfig keywords, parameter-name substrings frozen before shard(), family)
CASES = {
    "default": ({}, (), "llama"),
    "bf16, checkpointed": ({"param_dtype": torch.bfloat16, "checkpoint_layers": 2}, (), "llama"),
    "tied": ({}, (), "gemma"),
    "frozen q_proj": ({}, ("q_proj",), "llama"),
    "shared outer": ({"share_outer_slot": True}, (), "llama"),
}
BY_WORLD = {1: {}, 3: {},
            2: {"hybrid 1": ({"shard_group_size": 1}, (), "llama"),
                "hpZ": ({"secondary_group_size": 1}, (), "llama"),
                "qwZ": ({"quantized_weights": 8, "quant_block": 64}, (), "llama"),
                "no reshard": ({"reshard_after_forward": False}, (), "llama"),
                "PEFT LoRA": ({}, (), "lora")}}


@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_step_in_backward_equals_the_ordinary_step_with_fixed_memory(world):
    cases = {**CASES, **BY_WORLD[world]}
    res = run_distributed(parity, world, cases)
    for rank in range(world):
        for name in cases:
            ref, got = res[rank][name][False], res[rank][name][True]
            for step, (p_ref, p_got) in enumerate(zip(ref["params"], got["params"])):
                err = max((p_ref[k] - p_got[k]).abs().max().item() / max(p_ref[k].abs().max().item(), 1e-12)
                          for k in p_ref)
                assert err <= 1e-6, (world, name, step, err)
            assert ref["losses"] == pytest.approx(got["losses"], rel=1e-6), (world, name)
            # the LR schedule reached the steps: the container's groups are the inner optimizer's
            assert got["lrs"] == got["inner_lrs"] == ref["lrs"] and got["lrs"][0] == pytest.approx(1e-2 / 4)
            # memory: no fp32 gradient shard, what is held adds up to the plan, pointers fixed from step one
            assert "fp32 grad shards" in ref["rows"] and "fp32 grad shards" not in got["rows"], (name, got["rows"])
            assert got["held"] == got["plan"] < ref["plan"], (world, name, got["held"], got["plan"], ref["plan"])
            assert all(p == got["ptrs"][0] for p in got["ptrs"]), (world, name)
            assert not any(got["grads"]), "no master keeps a .grad between steps"


def test_units_no_rank_reached_skip_their_step_as_in_the_ordinary_step():
    got = run_distributed(unreached, 2)[0]
    init, ref, sib = got["init"], got[False], got[True]
    for k in ref:
        assert rel_err(sib[k], ref[k]) <= 1e-6, k
    assert torch.equal(ref["lm_head.weight"], init["lm_head.weight"])  # (skipped: no weight decay either)
    assert torch.equal(sib["model.layers.3.mlp.up_proj.weight"], init["model.layers.3.mlp.up_proj.weight"])
    assert not torch.equal(sib["model.layers.0.mlp.up_proj.weight"], init["model.layers.0.mlp.up_proj.weight"])


def test_the_plan_drops_the_gradient_shards_and_equals_yashard_plan():
    """The plan: the ordinary plan less the ``fp32 grad shards`` row, at 256 ranks too."""
    cfg = tiny_config("llama")
    for kw in ({}, {"param_dtype": torch.bfloat16}, {"shard_group_size": 8}):
        on = yashard.plan(cfg, world_size=256, config=yashard.ShardConfig(step_in_backward=True, **kw))
        off = yashard.plan(cfg, world_size=256, config=yashard.ShardConfig(**kw))
        grads = next(r for r in off.rows if r.name == "fp32 grad shards")
        assert [(r.name, r.numel, r.bytes) for r in on.rows] == \
            [(r.name, r.numel, r.bytes) for r in off.rows if r is not grads]
        assert on.total_bytes == off.total_bytes - grads.bytes
        assert on.adamw_bytes == off.adamw_bytes
        assert "step_in_backward" in next(r for r in on.rows if r.name == "reduce-scatter out").formula


def test_checkpoints_resume_and_reshard_across_world_sizes_and_modes(tmp_path):
    """Saved at W=2 with the step in backward (yashard's checkpoint and DCP), loaded at W=3 and
    W=1 into the step in backward and into the ordinary step: the next two steps are those the
    saving run took."""
    whole = run_distributed(checkpoints, 2, str(tmp_path), "save")[0]
    for world in (3, 1):
        got = run_distributed(checkpoints, world, str(tmp_path), "resume")[0]
        for key, run in got.items():
            assert run["losses"] == pytest.approx(whole["losses"], rel=1e-5), (world, key)
            for p_run, p_whole in zip(run["params"], whole["params"]):
                for k in p_whole:  # (another world size sums the gradients in another order)
                    assert rel_err(p_run[k], p_whole[k]) < (1e-3 if k.endswith("bias") else 1e-5), (world, key, k)


def test_the_mode_refuses_what_it_would_get_wrong():
    got = run_distributed(refusals, 1)[0]
    expect = {
        "no optimizer": "no optimizer steps it: each unit's gradient lives only until its optimizer step",
        "not the mode": "optimizer_in_backward on a model sharded without ShardConfig(step_in_backward=True)",
        "missing": "the optimizer leaves out the trained master shard(s)",
        "foreign": "holds a tensor of shape (3,) that is not a master shard of this model",
        "shape aware": "LBFGS over yashard master shards",
        "closure": "a closure that re-evaluates the loss cannot be used",
        "add group": "the model's masters are fixed at shard()",
        "clip": "clip_grad_norm_ with ShardConfig(step_in_backward=True): each unit already stepped in backward",
        "no_sync": "no_sync() with ShardConfig(step_in_backward=True): gradient accumulation needs",
        "scaler": "ShardedGradScaler with ShardConfig(step_in_backward=True)",
        "full_grads": "full_grads() with ShardConfig(step_in_backward=True): no gradient is kept",
        "comm hook": "register_comm_hook with ShardConfig(step_in_backward=True)",
        "second backward": "a second backward before opt.step() with ShardConfig(step_in_backward=True): gradient "
                           "accumulation above 1",
        "other optimizer": "AdamW.step() over the master shards of a model sharded with "
                           "ShardConfig(step_in_backward=True)",
        "other optimizer after step": "AdamW.step() over the master shards",
        "grad set": "has a .grad with ShardConfig(step_in_backward=True)",
        "penalty": "the loss reads the master shard",
        "bf16 reduce": "must be fp32 like the master shards it steps",
        "skip": "on_nonfinite='skip'): each unit steps during the backward",
        "not a bool": "ShardConfig.step_in_backward must be a bool",
        "nan": "NonFiniteError: yashard: NaN/inf",
        "replaced": "this one is an older optimizer_in_backward, replaced by a later call",
        "after nan": "no error",
    }
    for name, message in expect.items():
        assert message in got[name], (name, got[name])
    assert got["unchanged"] and got["trains on"] and got["state dict"]
