"""``TrainingArguments(torch_compile=True)`` through yashard.hf.Trainer compiles each decoder layer,
with its ``torch_compile_backend`` and ``torch_compile_mode``, and trains as the uncompiled run.

Two gloo ranks on CPU, a tiny Llama, gradient accumulation 2, 2 steps; the eager run and the
compiled one in one process. The backend is ``aot_eager`` (Dynamo and AOTAutograd, what yashard's hooks meet, without inductor's C++ builds,
too slow for the suite; tests/test_compile.py runs inductor on the layers). Workers in
tests/hf_init_workers.py."""

from __future__ import annotations

import math

import pytest

import hf_init_workers
from harness import run_distributed

pytestmark = pytest.mark.slow


def test_torch_compile_compiles_each_layer_and_trains_as_eager(tmp_path):
    eager, got = run_distributed(hf_init_workers.compiled_runs, 2, str(tmp_path),
                                 [{}, dict(torch_compile_backend="aot_eager", torch_compile_mode="reduce-overhead")])[0]
    assert eager["compiled_layers"] == 0 and eager["calls"] == []
    assert got["compiled_layers"] == 4  # (every decoder layer, and nothing else)
    # (either argument turns torch_compile on, as in transformers; aot_eager ignores the mode, with a warning)
    assert got["calls"] == [{"backend": "aot_eager", "mode": "reduce-overhead"}] * 4, got["calls"]
    assert got["graphs"] > 0  # (Dynamo compiled them)
    assert [s["step"] for s in got["steps"]] == [1, 2]
    for g, w in zip(got["steps"], eager["steps"]):
        for k in ("loss", "grad_norm"):
            assert math.isclose(g[k], w[k], rel_tol=1e-5, abs_tol=1e-6), (k, g, w)
