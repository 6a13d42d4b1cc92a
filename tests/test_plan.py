"""``yashard.plan``: with no process group and no allocation, the same memory plan, row for row, as
the live runtime's ``memory_plan()`` on every rank, for every ``ShardConfig`` variant the other
tests train with, at world sizes 1 to 4."""

import pytest
import torch

import yashard
from harness import run_distributed
from models import build, tiny_config

# name -> (ShardConfig keywords, parameter-name substrings frozen before shard(), family)
CASES = {
    "default": ({}, (), "llama"),
    "bf16": ({"param_dtype": torch.bfloat16}, (), "llama"),
    "bf16 reduce": ({"param_dtype": torch.bfloat16, "reduce_dtype": torch.bfloat16}, (), "llama"),
    "no reshard": ({"reshard_after_forward": False}, (), "llama"),
    "checkpointed": ({"checkpoint_layers": 2}, (), "llama"),
    "qwZ": ({"quantized_weights": 8, "quant_block": 64}, (), "llama"),
    "tied": ({}, (), "gemma"),
    "frozen embedding": ({}, ("embed_tokens",), "llama"),
    "frozen q_proj": ({"param_dtype": torch.bfloat16}, ("q_proj",), "llama"),
    # the embedding and layer 0 wholly frozen: bf16 masters (the norm group, partly frozen, fp32)
    "frozen layer bf16": ({"param_dtype": torch.bfloat16}, ("embed_tokens", "layers.0."), "llama"),
    "shared outer": ({"share_outer_slot": True}, (), "llama"),
    "shared outer, bf16, frozen lm_head": ({"share_outer_slot": True, "param_dtype": torch.bfloat16}, ("lm_head",),
                                           "llama"),
    "step in backward": ({"step_in_backward": True}, (), "llama"),
    "step in backward, bf16, frozen q_proj": ({"step_in_backward": True, "param_dtype": torch.bfloat16}, ("q_proj",),
                                              "llama"),
}
# only where they apply: hybrid sharding and hpZ need the world size to divide
BY_WORLD = {
    2: {"hybrid 1": {"shard_group_size": 1}, "hybrid 1, step in backward": {"shard_group_size": 1,
                                                                         "step_in_backward": True}},
    4: {"hybrid 2": {"shard_group_size": 2}, "hpZ": {"secondary_group_size": 2},
        "hybrid hpZ": {"shard_group_size": 2, "secondary_group_size": 1}},
}


def cases(world: int) -> dict:
    out = dict(CASES)
    out.update({name: (kw, (), "llama") for name, kw in BY_WORLD.get(world, {}).items()})
    return out


def _model(family: str, frozen: tuple, meta: bool):
    if meta:
        with torch.device("meta"):
            from transformers import AutoModelForCausalLM
            model = AutoModelForCausalLM.from_config(tiny_config(family))
    else:
        model = build(family)
    for name, p in model.named_parameters():
        if any(f in name for f in frozen):
            p.requires_grad_(False)
    return model


def _live_plans(rank, world):
    out = {}
    for name, (kw, frozen, family) in cases(world).items():
        sm = yashard.shard(_model(family, frozen, meta=False), config=yashard.ShardConfig(**kw))
        plan = sm.memory_plan()
        out[name] = (str(plan), plan.rows, plan.total_bytes, plan.adamw_bytes)
        del sm
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_the_plan_equals_the_live_runtimes_on_every_rank(world):
    live = run_distributed(_live_plans, world)
    for rank in range(world):
        for name, (kw, frozen, family) in cases(world).items():
            source = _model(family, frozen, meta=True) if frozen else tiny_config(family)
            planned = yashard.plan(source, world_size=world, config=yashard.ShardConfig(**kw), rank=rank,
                                   backend="gloo")
            text, rows, total, adamw = live[rank][name]
            assert planned.rows == rows, (world, rank, name, str(planned), text)
            assert (str(planned), planned.total_bytes, planned.adamw_bytes) == (text, total, adamw), (world, name)


def test_a_plan_needs_no_process_group_and_reads_a_config_json(tmp_path):
    """From a config.json on disk, with no process group initialised: the rows of 256 ranks."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    cfg = tiny_config("llama", num_hidden_layers=6)
    cfg.save_pretrained(tmp_path)
    plan = yashard.plan(tmp_path / "config.json", world_size=256,
                        config=yashard.ShardConfig(param_dtype=torch.bfloat16))
    assert plan.world == 256
    assert [r.name for r in plan.rows] == ["slot layer_even", "slot layer_odd", "slot outer", "slot small",
                                           "reduce-scatter out", "reduce-scatter staging", "fp32 master shards",
                                           "fp32 grad shards"]
    same = yashard.plan(cfg, world_size=256, config=yashard.ShardConfig(param_dtype=torch.bfloat16))
    assert yashard.plan(tmp_path, world_size=256, config=yashard.ShardConfig(param_dtype=torch.bfloat16)).rows \
        == same.rows == plan.rows
    assert not dist.is_initialized()


def test_plan_refuses_what_it_cannot_plan(tmp_path):
    with pytest.raises(ValueError, match=r"world_size=0.*int >= 1"):
        yashard.plan(tiny_config("llama"), world_size=0)
    with pytest.raises(ValueError, match=r"backend='mpi'.*'nccl', 'gloo'"):
        yashard.plan(tiny_config("llama"), world_size=2, backend="mpi")
    with pytest.raises(FileNotFoundError, match=r"does not exist"):
        yashard.plan(tmp_path / "missing.json", world_size=2)
    with pytest.raises(TypeError, match=r"nn.Module, a transformers PretrainedConfig"):
        yashard.plan({"hidden_size": 8}, world_size=2)
    with pytest.raises(TypeError, match=r"config must be a yashard.ShardConfig, got dict"):
        yashard.plan(tiny_config("llama"), world_size=2, config={"param_dtype": torch.bfloat16})
    with pytest.raises(ValueError, match=r"shard_group_size=3 does not divide the world size 4"):
        yashard.plan(tiny_config("llama"), world_size=4, config=yashard.ShardConfig(shard_group_size=3))


def test_the_command_line_prints_the_plan_of_a_preset_marked_fixed_or_1_over_w():
    """``python -m yashard.plan``: the same rows as ``yashard.plan`` of the preset, each marked fixed
    (the slots) or 1/W, and the model state with AdamW against the GPU's memory."""
    import os
    import subprocess
    import sys

    from yashard.plan.presets import preset_config

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    out = subprocess.run([sys.executable, "-m", "yashard.plan", "--config", "mistral-7b", "--world", "8",
                          "--gpu-memory", "24GiB"], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and not out.stderr, out.stderr
    planned = yashard.plan(preset_config("mistral-7b"), world_size=8,
                           config=yashard.ShardConfig(param_dtype=torch.bfloat16))
    lines = out.stdout.splitlines()
    for r in planned.rows:
        kind = "fixed" if r.name.startswith(("slot ", "reduce-scatter staging")) else "1/W"
        assert any(line.split()[:len(r.name.split())] == r.name.split() and f"{r.bytes / 2**30:.3f} GiB  {kind}" in line
                   for line in lines), (r.name, out.stdout)
    state = (planned.total_bytes + planned.adamw_bytes) / 2**30
    assert f"model state leaves {24 - state:.3f} GiB of 24.000 GiB" in out.stdout
    # then the activations of one 4096-token sequence, the peaks, and the communication of a step
    from yashard.plan.activations import activations, shape_of, yashard_peak

    shape = shape_of(preset_config("mistral-7b"))
    peak = yashard_peak(planned.total_bytes + planned.adamw_bytes, shape,
                        activations(shape, seq=4096, micro_batch=1, param_bytes=2))
    assert any(line.split()[:3] == ["yashard", f"{state:.2f}", f"{peak.bytes / 2**30:.2f}"] for line in lines), out.stdout
    assert any(line.split()[0] == "FSDP2" for line in lines) and "DeepSpeed ZeRO-3" in out.stdout
    assert "communication per rank and step, 4096 tokens" in out.stdout and "+ qwZ int8" in out.stdout


@pytest.mark.parametrize("args, message", [
    (["--config", "nope", "--world", "2"], "--config nope: neither a preset (llama-3-8b, "),
    (["--config", "llama-3-8b", "--world", "8", "--gpu-memory", "80XB"], "'80XB' is not a size"),
    (["--config", "llama-3-8b", "--world", "8", "--mfu", "2"], "--mfu in (0, 1]"),
    (["--config", "llama-3-8b", "--world", "8", "--bandwidth", "fast"], "'fast' is not a size"),
    (["--config", "llama-3-8b", "--world", "8", "--no-reshard", "--share-outer-slot"],
     "drop --share-outer-slot or --no-reshard"),
])
def test_the_command_line_names_a_bad_argument(args, message, capsys):
    from yashard.plan.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_sizes_parse_as_written():
    from yashard.plan.__main__ import parse_bytes

    assert parse_bytes("80GiB") == 80 * 2**30 and parse_bytes("141GB") == 141 * 10**9 and parse_bytes("1024") == 1024
    with pytest.raises(ValueError, match="is not a size"):
        parse_bytes("lots")


def test_the_largest_micro_batch_that_fits():
    from yashard.plan.__main__ import largest_micro_batch

    assert largest_micro_batch(lambda mb: 10 * mb, 35) == 3
    assert largest_micro_batch(lambda mb: 10 * mb, 9) == 0
    assert largest_micro_batch(lambda mb: 10 * mb, 10 * 1000) == 1000
