"""The communication plan (``yashard.plan.comm``) against the runtime's own ``CollectiveLog``: one
logged step of a tiny model at world 2, for the default config and each ZeRO++ variant the runtime
runs on CPU, tied embeddings (Gemma), frozen units and gradient accumulation; the byte counts and
message sizes agree collective for collective."""

from collections import Counter

import pytest
import torch

import yashard
from harness import run_distributed
from models import build
from workers import run_many, scenario
from yashard.plan.activations import shape_of
from yashard.plan.comm import Qgz, peer_collectives, step_seconds, summarize, unit_sizes, yashard_collectives

# name -> (scenario keywords, ShardConfig keywords, qgZ settings)
MODES = {
    "default": ({}, {}, None),
    "bf16": ({"dtype": "bf16"}, {"param_dtype": torch.bfloat16}, None),
    "no reshard": ({"shard_kw": {"reshard_after_forward": False}}, {"reshard_after_forward": False}, None),
    "qwZ": ({"shard_kw": {"quantized_weights": 8, "quant_block": 64}}, {"quantized_weights": 8, "quant_block": 64},
            None),
    "hpZ": ({"shard_kw": {"secondary_group_size": 1}}, {"secondary_group_size": 1}, None),
    "hybrid": ({"shard_kw": {"shard_group_size": 1}}, {"shard_group_size": 1}, None),
    "qgZ across nodes": ({"hook": "qgz", "hook_kw": {"ranks_per_node": 1, "bits": 8, "block": 64}}, {},
                         Qgz(1, 8, 64)),
    "qgZ in a node": ({"hook": "qgz", "hook_kw": {"ranks_per_node": 2, "bits": 4, "block": 64}}, {}, Qgz(2, 4, 64)),
    # tied embeddings (Gemma), frozen units, gradient accumulation (a reduction per micro-batch)
    "tied": ({"family": "gemma"}, {}, None),
    "frozen": ({"freeze": ("embed_tokens", "layers.1.", "layers.3.")}, {}, None),
    "frozen, no reshard": ({"freeze": ("layers.1.", "layers.3."), "shard_kw": {"reshard_after_forward": False}},
                           {"reshard_after_forward": False}, None),
    "accumulation": ({"accum": 3}, {}, None),
    "tied, frozen, accumulation": ({"family": "gemma", "freeze": ("layers.0.",), "accum": 2}, {}, None),
    "frozen, accumulation, no reshard": ({"freeze": ("layers.0.",), "accum": 2,
                                         "shard_kw": {"reshard_after_forward": False}},
                                        {"reshard_after_forward": False}, None),
    # share_outer_slot: the embedding and the lm_head in the layer slots' buffer, smaller than both
    # layer slots and (vocabulary 640) larger
    "shared outer": ({"shard_kw": {"share_outer_slot": True}}, {"share_outer_slot": True}, None),
    "shared outer, large vocabulary, bf16, accumulation": (
        {"dtype": "bf16", "overrides": {"vocab_size": 640}, "accum": 2, "shard_kw": {"share_outer_slot": True}},
        {"param_dtype": torch.bfloat16, "share_outer_slot": True}, None),
    "shared outer, frozen, hpZ": (
        {"freeze": ("embed_tokens", "layers.2."), "shard_kw": {"share_outer_slot": True, "secondary_group_size": 1}},
        {"share_outer_slot": True, "secondary_group_size": 1}, None),
    "shared outer, frozen lm_head, accumulation, qwZ": (
        {"freeze": ("lm_head",), "overrides": {"vocab_size": 640}, "accum": 2,
         "shard_kw": {"share_outer_slot": True, "quantized_weights": 8, "quant_block": 64}},
        {"share_outer_slot": True, "quantized_weights": 8, "quant_block": 64}, None),
}
PHASES = {"pre": "forward", "fwd": "forward", "bwd": "backward"}


@pytest.fixture(scope="module")
def logs():
    scenarios = [scenario(steps=2, log_step=1, **kw) for kw, _, _ in MODES.values()]
    return dict(zip(MODES, run_distributed(run_many, 2, scenarios)[0]))


@pytest.mark.parametrize("mode", list(MODES))
def test_planned_collectives_are_the_logged_ones(logs, mode):
    run, kw, qgz = MODES[mode]
    config = yashard.ShardConfig(**kw)
    shard = config.shard_group_size or 2
    model = build(run.get("family", "llama"), **run.get("overrides", {}))
    for name, p in model.named_parameters():
        if any(f in name for f in run.get("freeze", ())):
            p.requires_grad_(False)
    planned = yashard_collectives(unit_sizes(model, config, shard), world=2, config=config, qgz=qgz,
                                  micro_batches=run.get("accum", 1))
    logged = Counter((PHASES[ph], op, unit, group, numel, nbytes) for ph, op, unit, numel, nbytes, group in logs[mode]["log"])
    assert Counter((c.phase, c.kind, c.unit, c.group, c.numel, c.nbytes) for c in planned) == logged


def test_summaries_and_peers():
    from yashard.plan.presets import preset_config

    shape = shape_of(build("llama"))
    big = shape_of(preset_config("llama-3-8b"))
    for engine in ("fsdp2", "deepspeed-zero3"):
        cs = peer_collectives(big, world=4, param_bytes=2, engine=engine)
        kinds = {s.kind: s for s in summarize(cs)}
        assert kinds["all_gather"].count >= big.layers + 1 and kinds["reduce_scatter"].sent > 0
    # ZeRO-3 keeps parameters under 1e5 elements whole: a tiny model gathers nothing, and reduces everything
    tiny = {s.kind: s for s in summarize(peer_collectives(shape, world=4, param_bytes=2, engine="deepspeed-zero3"))}
    assert "all_gather" not in tiny and tiny["reduce_scatter"].nbytes == 4 * shape.total_numel  # (fp32)
    fsdp2 = {s.kind: s for s in summarize(peer_collectives(shape, world=4, param_bytes=2))}
    # every layer gathered in forward and in backward, the root once, in bf16; reduced in fp32
    assert fsdp2["all_gather"].nbytes == 2 * (shape.total_numel + shape.layers * shape.layer_numel)
    assert fsdp2["reduce_scatter"].nbytes == 4 * shape.total_numel
    assert step_seconds(shape, tokens=10, tflops=1, mfu=0.5) == 6 * shape.total_numel * 10 / 0.5e12
