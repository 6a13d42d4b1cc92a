"""Gradient slots in ``param_dtype`` (``build.compact_grads``): with 16-bit compute and an fp32
reduction, the alternating slots keep their gradients in the 16-bit dtype autograd hands them in,
and each unit is reduce-scattered through one fp32 staging buffer, a chunk at a time. The values on
the wire are the same, so a run is bitwise the run with fp32 gradient slots (a registered comm hook
keeps those: it reads ``reduce_dtype`` buffers), with one chunk per unit and with many, at world
sizes 2 to 4, tied, checkpointed, partly frozen, hybrid, hpZ and qwZ. The plan, the live plan and
the tensors held agree, and the planned collectives are the logged ones, chunk for chunk."""

from collections import Counter

import pytest
import torch

import yashard
from harness import run_distributed
from models import build, tiny_config
from workers import run_many, scenario
from yashard import layout
from yashard.plan.comm import unit_sizes, yashard_collectives

# Elements of a chunk over all ranks and at least per rank: a tiny llama layer (9216 elements) is
# reduced in several chunks, the last one shorter (400 per rank at world 3: 3072 = 7 * 400 + 272).
SMALL = (1200, 16)

VARIANTS = {
    "llama": dict(),
    "tied, checkpointed": dict(family="gemma", ckpt=2),
    "frozen q_proj": dict(freeze=("q_proj",)),
    "accumulation, unused": dict(accum=2, micro=1, unused=1),
}
BY_WORLD = {
    2: {"qwZ": dict(shard_kw={"quantized_weights": 8, "quant_block": 64})},
    4: {"hybrid": dict(shard_kw={"shard_group_size": 2}), "hpZ": dict(shard_kw={"secondary_group_size": 2})},
}


def _variants(world: int) -> dict:
    return {**VARIANTS, **BY_WORLD.get(world, {})}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_param_dtype_gradient_slots_train_bitwise_as_fp32_ones(world):
    variants = _variants(world)
    scenarios = []
    for kw in variants.values():
        base = dict(dtype="bf16", steps=4, log_step=1, grads_every_step=True, **kw)
        scenarios += [scenario(**base), scenario(reduce_chunk=SMALL, **base),
                      scenario(hook="reduce_scatter", **base)]
    results = run_distributed(run_many, world, scenarios)
    for rank_results in results:
        for i, name in enumerate(variants):
            whole, chunked, fp32_slots = rank_results[3 * i: 3 * i + 3]
            for res in (whole, chunked):
                assert res["losses"] == fp32_slots["losses"], (name, res["losses"], fp32_slots["losses"])
                assert res["norms"] == fp32_slots["norms"], name
                for got, want in zip(res["grads"], fp32_slots["grads"]):
                    assert all(torch.equal(got[k], want[k]) for k in want), name
                assert all(torch.equal(res["params"][k], fp32_slots["params"][k]) for k in fp32_slots["params"]), name
                assert res["plan"] == res["allocated"], name       # the plan is what is held
                assert all(p == res["ptrs"][0] for p in res["ptrs"]), name  # and it never moves
            # each rank's share of the gradients is reduce-scattered in chunks of at most 400 elements
            shard = world if name not in ("hybrid",) else 2
            reduced = Counter(r[3] for r in chunked["log"] if r[1] == "reduce_scatter" and r[2] == "layer_2")
            assert max(reduced) <= shard * (SMALL[0] // shard // 16 * 16), (name, reduced)
            assert sum(reduced.values()) > 1, (name, reduced)
            whole_rs = [r for r in whole["log"] if r[1] == "reduce_scatter" and r[2] == "layer_2"]
            assert len(whole_rs) == (2 if name.startswith("accumulation") else 1), (name, whole_rs)
            # the param_dtype slots hold less than the fp32 ones
            assert whole["plan"] < fp32_slots["plan"] and chunked["plan"] < whole["plan"], name


def _live(rank, world, cases):
    out = {}
    for name, (kw, sizes) in cases.items():
        old = layout.REDUCE_CHUNK_NUMEL, layout.REDUCE_CHUNK_MIN_PER_RANK
        layout.REDUCE_CHUNK_NUMEL, layout.REDUCE_CHUNK_MIN_PER_RANK = sizes
        try:
            sm = yashard.shard(build(), config=yashard.ShardConfig(**kw))
        finally:
            layout.REDUCE_CHUNK_NUMEL, layout.REDUCE_CHUNK_MIN_PER_RANK = old
        held = sm.runtime.allocated_tensors()
        out[name] = (sm.memory_plan().rows, sum(t.numel() * t.element_size() for t in held.values()),
                     sm.memory_plan().total_bytes)
    return out


PLAN_CASES = {
    "bf16": ({"param_dtype": torch.bfloat16}, SMALL),
    "bf16, one chunk": ({"param_dtype": torch.bfloat16}, (layout.REDUCE_CHUNK_NUMEL, layout.REDUCE_CHUNK_MIN_PER_RANK)),
    "bf16, qwZ": ({"param_dtype": torch.bfloat16, "quantized_weights": 8, "quant_block": 64}, SMALL),
    "bf16, no reshard": ({"param_dtype": torch.bfloat16, "reshard_after_forward": False}, SMALL),
}


@pytest.mark.parametrize("world", [2, 3])
def test_the_plan_of_param_dtype_gradient_slots_is_the_live_one(world, monkeypatch):
    live = run_distributed(_live, world, PLAN_CASES)
    for name, (kw, sizes) in PLAN_CASES.items():
        monkeypatch.setattr(layout, "REDUCE_CHUNK_NUMEL", sizes[0])
        monkeypatch.setattr(layout, "REDUCE_CHUNK_MIN_PER_RANK", sizes[1])
        planned = yashard.plan(tiny_config("llama"), world_size=world, config=yashard.ShardConfig(**kw),
                               backend="gloo")
        for rank in range(world):
            rows, held, total = live[rank][name]
            assert planned.rows == rows, (name, str(planned))
            assert held == total == planned.total_bytes, name
        names = {r.name for r in planned.rows}
        compact = "no reshard" not in name
        assert ("reduce-scatter staging" in names) == compact, names
        slot = next(r for r in planned.rows if r.name.startswith("slot layer"))
        assert slot.bytes == slot.numel * (2 + (2 if compact else 4)), slot
        # gloo over three ranks reduce-scatters through a receive buffer: one chunk's, not a unit's
        scratch = [r for r in planned.rows if r.name == "comm hook reduce_scatter"]
        assert len(scratch) == (world == 3), planned.rows
        if scratch and compact:
            assert scratch[0].numel == next(r for r in planned.rows if r.name == "reduce-scatter staging").numel


def test_planned_collectives_are_the_logged_chunks():
    s = scenario(dtype="bf16", steps=2, log_step=1, reduce_chunk=SMALL)
    res = run_distributed(run_many, 2, [s])[0][0]
    config = yashard.ShardConfig(param_dtype=torch.bfloat16)
    old = layout.REDUCE_CHUNK_NUMEL, layout.REDUCE_CHUNK_MIN_PER_RANK
    layout.REDUCE_CHUNK_NUMEL, layout.REDUCE_CHUNK_MIN_PER_RANK = SMALL
    try:
        planned = yashard_collectives(unit_sizes(build("llama"), config, 2), world=2, config=config)
    finally:
        layout.REDUCE_CHUNK_NUMEL, layout.REDUCE_CHUNK_MIN_PER_RANK = old
    phases = {"pre": "forward", "fwd": "forward", "bwd": "backward"}
    logged = Counter((phases[ph], op, unit, group, numel, nbytes) for ph, op, unit, numel, nbytes, group in res["log"])
    assert Counter((c.phase, c.kind, c.unit, c.group, c.numel, c.nbytes) for c in planned) == logged
    assert sum(1 for c in planned if c.kind == "reduce_scatter" and c.unit == "layer_0") > 1


def test_chunks():
    assert layout.chunk_bounds(10, 4) == [(0, 4), (4, 4), (8, 2)]
    assert layout.chunk_bounds(8, 4) == [(0, 4), (4, 4)]
    assert layout.chunk_bounds(0, 0) == []
    # a chunk over all ranks is bounded, each rank's part of it is not too small, both aligned
    assert layout.reduce_chunk(10**9, 256, 16) == layout.REDUCE_CHUNK_NUMEL // 256
    assert layout.reduce_chunk(10**9, 4096, 16) == layout.REDUCE_CHUNK_MIN_PER_RANK
    assert layout.reduce_chunk(1000, 8, 16) == 1000  # never more than the largest shard
