"""The planner's activation and peak estimates against RSS measured on CPU at world 2, for one
small Llama (4 layers, hidden 256, 4 x 256 tokens per rank, fp32), yashard and FSDP2 (as torchtitan
wraps it: the embedding alone, each decoder layer, [norm, lm_head] kept, the root): within 10%, as ``recipes/plan_check.py`` checks on the benchmark models.
Linux only (VmHWM is reset through ``/proc/self/clear_refs``)."""

import pytest

import yashard
from harness import run_distributed
from plan_peak_workers import MICRO_BATCH, SEQ, config, measure
from yashard.plan.activations import activations, shape_of, yashard_peak
from yashard.plan.peers import fsdp2_forward_end, fsdp2_peak


@pytest.mark.parametrize("engine", ["yashard", "fsdp2"])
def test_estimated_peak_is_within_10_percent_of_the_measured_one(engine):
    measured = run_distributed(measure, 2, engine)
    if measured[0]["peak"] is None:
        pytest.skip("VmHWM cannot be reset here (/proc/self/clear_refs)")
    shape = shape_of(config())
    acts = activations(shape, seq=SEQ, micro_batch=MICRO_BATCH, param_bytes=4)
    if engine == "yashard":
        plan = yashard.plan(config(), world_size=2, backend="gloo")
        forward, peak = acts.forward_end, yashard_peak(plan.total_bytes + plan.adamw_bytes, shape, acts).bytes
    else:
        forward = fsdp2_forward_end(shape, acts, param_bytes=4)
        peak = fsdp2_peak(shape, acts, world=2, param_bytes=4, backend="gloo").bytes
    for rank, m in enumerate(measured):
        assert 0.9 <= m["forward"] / forward <= 1.1, (rank, m["forward"], forward)
        assert 0.9 <= m["peak"] / peak <= 1.1, (rank, m["peak"], peak)
