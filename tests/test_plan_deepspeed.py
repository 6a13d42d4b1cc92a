"""The planner's DeepSpeed ZeRO-3 model (``yashard.plan.peers``) against ZeRO-3 itself, measured as
``recipes/plan_check.py`` measures it: RSS on CPU at world 2, the benchmark's small Llama, fp32.
Skipped where DeepSpeed is not installed (it is not in the test extra) or VmHWM cannot be reset
(``/proc/self/clear_refs``, Linux only). About a minute: DeepSpeed's startup dominates."""

import os
import sys

import pytest

from plan_peak_workers import reset_peak

RECIPES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes")


def test_zero3_estimate_is_within_10_percent_of_the_measured_peak():
    pytest.importorskip("deepspeed")
    if not reset_peak():
        pytest.skip("VmHWM cannot be reset here (/proc/self/clear_refs)")
    sys.path.insert(0, RECIPES)
    try:
        import plan_check
    finally:
        sys.path.remove(RECIPES)
    res = plan_check.run_worker("deepspeed", "small", "fp32", plan_check.MODELS["small"], steps=2)
    measured = plan_check.measured(res)
    estimated = plan_check.estimate("deepspeed", "small", "fp32", plan_check.MODELS["small"])
    assert 0.9 <= measured["forward"] / estimated["forward"] <= 1.1, (measured, estimated)
    assert 0.9 <= measured["peak"] / estimated["peak"].bytes <= 1.1, (measured, estimated["peak"])


def test_zero3_state_counts_what_stage3_allocates():
    """Between steps: (2p + 12) N/W for the partitions, fp32 masters, gradient partitions and
    AdamW, the persistent parameters whole, and the bucket: whole on a GPU, as far as written on
    the CPU."""
    from models import build
    from yashard.plan.activations import shape_of
    from yashard.plan.peers import DS_REDUCE_BUCKET, deepspeed_persistent_numel, deepspeed_state_bytes

    shape = shape_of(build("llama"))
    persistent = deepspeed_persistent_numel(shape)
    assert persistent == shape.total_numel  # a tiny model: every parameter under 1e5 elements
    n = shape.total_numel
    assert deepspeed_state_bytes(shape, world=2, param_bytes=2, reduce_bytes=4, backend="gloo") == \
        16 * n // 2 + 2 * persistent + 4 * n
    assert deepspeed_state_bytes(shape, world=2, param_bytes=2, reduce_bytes=2) == \
        16 * n // 2 + 2 * persistent + 2 * DS_REDUCE_BUCKET
