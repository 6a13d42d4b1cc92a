"""``torch.compile`` over a sharded model: the layers (or the whole model) compile, yashard's
hooks stay out of every graph, and training matches the unsharded reference.

yashard's forward hooks gather, install views and issue collectives; they are opaque to Dynamo
(``torch.compiler.disable``), so each is one graph break and the module bodies between them
compile on the views the hooks installed. Without that, Dynamo traced into the hooks: graphs
holding yashard's own code, recompiled per layer until the recompile limit sent them back to eager.
``aot_eager`` runs Dynamo and AOTAutograd (what the hooks meet) without a C++ compiler; one run
uses inductor, where one is installed.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from harness import run_distributed
from workers import loss_rel_err, max_rel_err, run_compiled_optimizer_step, run_many, run_reference, scenario


def _check(res: dict, ref: dict, tol: float) -> None:
    assert loss_rel_err(res["losses"], ref["losses"]) < tol, (res["losses"], ref["losses"])
    err, name = max_rel_err(res["grads"][0], ref["grads"][0])
    assert err < tol, (name, err)
    err, name = max_rel_err(res["params"], ref["params"])
    assert err < tol, (name, err)


@pytest.mark.slow
def test_compiled_layers_forwards_and_model_train_as_the_reference_without_tracing_yashard():
    """World 2, two micro-batches per step: per-layer ``module.compile()``, each layer's forward
    compiled with ``fullgraph=True``, and the whole ``ShardedModel``; with activation checkpointing
    and with ``reshard_after_forward=False``."""
    base = dict(steps=3, micro=1, accum=2)
    cases = {
        "layers": scenario(compile=("layers", "aot_eager"), **base),
        "forwards, fullgraph": scenario(compile=("forwards", "aot_eager"), **base),
        "layers, fullgraph": scenario(compile=("layers-fullgraph", "aot_eager"), **base),
        "model": scenario(compile=("model", "aot_eager"), **base),
        "layers, checkpointed": scenario(compile=("layers", "aot_eager"), ckpt=2, **base),
        "model, no reshard": scenario(compile=("model", "aot_eager"), shard_kw={"reshard_after_forward": False},
                                      **base),
    }
    results = run_distributed(run_many, 2, list(cases.values()))[0]
    for (name, s), res in zip(cases.items(), results):
        assert res["traced"]["graphs"] > 0, name  # it did compile
        # no graph holds yashard's code; a checkpointed layer's forward is the wrapper that calls
        # torch.utils.checkpoint on the layer, which Dynamo traces as such
        allowed = ["activation_checkpointing.py:checkpointed_forward"] if s["ckpt"] else []
        assert [f for f in res["traced"]["yashard_code"] if f not in allowed] == [], name
        _check(res, run_reference({**s, "world": 2}), 1e-5)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="inductor on CPU needs a C++ compiler")
def test_layers_compiled_by_inductor_train_as_the_reference():
    s = scenario(compile=("layers", "inductor"), steps=3)
    res = run_distributed(run_many, 2, [s])[0][0]
    assert res["traced"]["graphs"] > 0 and res["traced"]["yashard_code"] == []
    _check(res, run_reference({**s, "world": 2}), 1e-4)  # (inductor fuses: fp32 rounding differs)


@pytest.mark.slow
def test_a_compiled_fused_optimizer_step_refreshes_the_bf16_weights():
    """``torch.compile(opt.step)`` with fused AdamW and bf16 compute: the step's hooks (step checks,
    the version bump that tells the runtime a fused step wrote the masters, the next forward's
    gathers) are opaque to Dynamo, so the run is bitwise the eager one. Traced, the bump was lost:
    every later forward ran on the first step's bf16 weights (params 4e-2 off after 5 steps)."""
    eager = run_distributed(run_compiled_optimizer_step, 2, False)[0]
    compiled = run_distributed(run_compiled_optimizer_step, 2, True)[0]
    assert compiled["losses"] == eager["losses"]
    assert all(torch.equal(compiled["params"][k], eager["params"][k]) for k in eager["params"])
    assert compiled["traced"] == [], compiled["traced"]


def test_compiled_autograd_is_refused_with_the_reason(pg):
    ca = pytest.importorskip("torch._dynamo.compiled_autograd")
    import yashard
    from models import batches, build

    sm = yashard.shard(build(num_hidden_layers=2))
    x = batches(1, 2, 8, 96)[0]
    loss = sm(input_ids=x, labels=x).loss
    with pytest.raises(RuntimeError, match=r"a sharded model's backward ran under compiled autograd .* Run backward\(\) "
                                           r"without it; the forward can still be compiled"):
        with (getattr(ca, "_enable", None) or ca.enable)(torch.compile(backend="aot_eager")):
            loss.backward()
    # the model is usable afterwards: a plain backward of a new forward works
    sm(input_ids=x, labels=x).loss.backward()
    assert all(p.grad is not None for p in sm.parameters())
