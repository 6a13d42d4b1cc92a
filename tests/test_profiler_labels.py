"""Profiler labels name the unit, as FSDP2's do: a trace of a sharded step reads
``yashard::all_gather (model.layers.3)``, ``yashard::reduce_scatter (lm_head)``,
``yashard::post_divide (model.embed_tokens)``, and ``(norm group)`` for the group of 1-D parameters."""

import collections

import torch

import yashard
from harness import run_distributed
from models import batches, build

LAYERS = 4
PATHS = ["model.embed_tokens"] + [f"model.layers.{i}" for i in range(LAYERS)] + ["lm_head", "norm group"]


def _profiled_steps(rank, world):
    from torch.profiler import ProfilerActivity, profile

    model = build("llama", num_hidden_layers=LAYERS)
    sm = yashard.shard(model)
    ids = batches(1, 2 * world, 16, 96)[0].chunk(world)[rank]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        sm(input_ids=ids, labels=ids).loss.backward()
    names = collections.Counter(e.name for e in prof.events() if e.name.startswith("yashard::"))
    return dict(paths=[u.path for u in sm.runtime.units], names=dict(names))


def test_profiled_step_labels_every_units_collectives_with_its_hf_path():
    for r in run_distributed(_profiled_steps, 2):
        assert r["paths"] == PATHS
        names = r["names"]
        for path in PATHS:
            for op in ("all_gather", "reduce_scatter", "post_divide"):
                assert names.get(f"yashard::{op} ({path})", 0) >= 1, (op, path, sorted(names))
        # the backward re-gathers (every layer but the last two, which stay resident) go through the
        # same labelled gather: those layers are gathered twice, once per pass
        for i in range(LAYERS - 2):
            assert names[f"yashard::all_gather (model.layers.{i})"] == 2, sorted(names)
        for i in range(LAYERS - 2, LAYERS):
            assert names[f"yashard::all_gather (model.layers.{i})"] == 1, sorted(names)
        # one reduction per unit; no unlabelled or old-style collective label is left
        assert all(names[f"yashard::reduce_scatter ({p})"] == 1 for p in PATHS)
        assert not {n for n in names if n.split(" (")[0] in ("yashard::all_gather", "yashard::reduce_scatter",
                                                             "yashard::post_divide") and " (" not in n}
        assert not any("norm_group_" in n for n in names)


def test_labels_are_made_once_when_units_are_built(pg):
    sm = yashard.shard(build("llama", num_hidden_layers=2))
    units = sm.runtime.units
    assert [u.gather_label for u in units] == [
        "yashard::all_gather (model.embed_tokens)", "yashard::all_gather (model.layers.0)",
        "yashard::all_gather (model.layers.1)", "yashard::all_gather (lm_head)", "yashard::all_gather (norm group)"]
    assert units[-1].reduce_label == "yashard::reduce_scatter (norm group)"
    assert units[1].post_divide_label == "yashard::post_divide (model.layers.0)"
