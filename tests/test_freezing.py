"""Frozen parameters (``requires_grad=False`` before ``yashard.shard``) against an unsharded
reference that freezes the same parameters: same losses, gradients and weights step by step, the
frozen weights bitwise unchanged, and no gradient buffer, reduction or backward gather spent on
what does not train."""

from collections import Counter

import pytest
import torch

from ckpt_workers import run_segments, segment
from harness import run_distributed
from test_parity import assert_params_close, check_fp32
from workers import loss_rel_err, run_many, run_reference, scenario

# what each case freezes (substrings of HF parameter names)
CASES = {
    # a whole outer unit that nothing flows into (its input is token ids)
    "embed": ("embed_tokens",),
    # whole decoder layers with their norms (the norm group is then partly frozen); the trained
    # embedding below them still needs their backward (input gradients), but they reduce nothing
    "first_layers": ("layers.0.", "layers.1."),
    # part of every layer: those weights see zero gradients and weight decay 0.1, and must not move
    "q_proj": ("q_proj",),
    # only the lm_head and the final norm train: the backward stops above the decoder layers
    "head_only": ("embed_tokens", "layers."),
    # the bottom of the model: the backward stops above layer 2, which must not prefetch layer 1
    "bottom": ("embed_tokens", "layers.0.", "layers.1."),
}


def frozen_names(params: dict, patterns: tuple) -> list:
    return [k for k in params if any(p in k for p in patterns)]


def check_frozen(res: dict, ref: dict, patterns: tuple) -> None:
    check_fp32(res, ref)
    names = frozen_names(ref["params"], patterns)
    assert names
    for k in names:
        # never moved (the reference's frozen weights are its initial ones), and no gradient
        assert torch.equal(res["params"][k], ref["params"][k]), k
        assert torch.count_nonzero(res["grads"][0][k]) == 0, k
    assert res["plan"] == res["allocated"]  # the memory plan still says exactly what is held


@pytest.mark.parametrize("world", [2, 3])
def test_frozen_parameters_match_the_reference(world):
    scenarios = [scenario(freeze=f, steps=4, log_step=2) for f in CASES.values()] + [scenario(steps=4, log_step=2)]
    results = run_distributed(run_many, world, scenarios)[0]
    *frozen, trained = results
    for (case, patterns), s, res in zip(CASES.items(), scenarios, frozen):
        check_frozen(res, run_reference({**s, "world": world}), patterns)
        if case != "q_proj":  # (a whole unit frozen: no gradient buffer; q_proj keeps its values over the step)
            assert res["plan"] < trained["plan"], case
    bwd_reduced = {case: Counter(r[2] for r in res["log"] if r[0] == "bwd" and r[1] == "reduce_scatter")
                   for case, res in zip(CASES, frozen)}
    bwd_gathered = {case: Counter(r[2] for r in res["log"] if r[0] == "bwd" and r[1] == "all_gather")
                    for case, res in zip(CASES, frozen)}
    layers = [f"layer_{i}" for i in range(4)]
    assert set(bwd_reduced["embed"]) == {*layers, "lm_head", "small"}
    assert set(bwd_reduced["first_layers"]) == {"embed", "layer_2", "layer_3", "lm_head", "small"}
    assert set(bwd_reduced["q_proj"]) == {"embed", *layers, "lm_head", "small"}
    assert set(bwd_reduced["head_only"]) == {"lm_head", "small"}
    assert set(bwd_reduced["bottom"]) == {"layer_2", "layer_3", "lm_head", "small"}
    # frozen layers are re-gathered in backward only where a gradient must pass through them
    assert {"layer_0", "layer_1"} <= set(bwd_gathered["first_layers"])
    assert not set(bwd_gathered["head_only"]) & set(layers), bwd_gathered["head_only"]
    assert not {"layer_0", "layer_1"} & set(bwd_gathered["bottom"]), bwd_gathered["bottom"]


def test_frozen_parameters_with_accumulation_checkpointing_bf16_and_per_unit_buffers():
    patterns = ("q_proj", "layers.2.", "embed_tokens")
    scenarios = [
        # layers 0-2 checkpointed: 0 and 1 partly frozen, 2 wholly (its recompute reads plain views)
        scenario(freeze=patterns, steps=4, micro=1, accum=2, ckpt=3),
        scenario(freeze=patterns, steps=4, micro=1, accum=2, no_sync=True, log_step=2,
                 shard_kw={"reshard_after_forward": False}),
        scenario(freeze=patterns, steps=4, dtype="bf16"),
    ]
    results = run_distributed(run_many, 2, scenarios)[0]
    for s, res in zip(scenarios[:2], results[:2]):
        check_frozen(res, run_reference({**s, "world": 2}), patterns)
    # with a slot per unit, wholly frozen units stay gathered across optimizer steps: only the
    # others are gathered again after one
    gathered = Counter(r[2] for r in results[1]["log"] if r[1] == "all_gather")
    assert "embed" not in gathered and "layer_2" not in gathered and gathered["layer_3"] == 1, gathered
    bf16, ref = results[2], run_reference({**scenarios[2], "world": 2})
    assert loss_rel_err(bf16["losses"], ref["losses"]) < 1e-2
    assert_params_close(bf16["params"], ref["params"], 2e-2, noise_rtol=None, tensor_rtol=5e-2)
    for k in frozen_names(ref["params"], patterns):  # the masters of frozen weights never move
        # (a wholly frozen unit, layer 2 and the embedding, keeps its master in bf16: test_frozen_masters.py)
        whole = "layers.2." in k or "embed_tokens" in k
        want = ref["params"][k].to(torch.bfloat16).float() if whole else ref["params"][k]
        assert torch.equal(bf16["params"][k], want), k


def test_checkpoints_of_a_partly_frozen_model_resume_and_reshard(tmp_path):
    """Frozen units hold no optimizer state; a save must still resume bitwise and reshard."""
    patterns = ("embed_tokens", "q_proj")
    straight = run_distributed(run_segments, 2, [segment(freeze=patterns, saves={3: str(tmp_path / "ck")})])[0][0]
    resumed = run_distributed(run_segments, 2, [segment(freeze=patterns, start=3, load=str(tmp_path / "ck"))])[0][0]
    assert resumed["losses"] == straight["losses"][3:]
    assert all(torch.equal(resumed["params"][k], straight["params"][k]) for k in straight["params"])
    w3 = run_distributed(run_segments, 3, [segment(freeze=patterns, start=3, load=str(tmp_path / "ck"))])[0][0]
    assert loss_rel_err(w3["losses"], straight["losses"][3:]) < 1e-5
    assert_params_close(w3["params"], straight["params"], 1e-5)
    initial = run_distributed(run_segments, 1, [segment(freeze=patterns, stop=0)])[0][0]["params"]
    for k in frozen_names(initial, patterns):
        assert torch.equal(w3["params"][k], initial[k]), k
