"""A sharded run must match a single-process, unsharded reference step by step.

Same initial weights, same global batch per step, same AdamW and clipping. fp32 is held to 1e-5
relative; bf16 (weights and compute in bf16, fp32 masters and reduction) to bf16 tolerance.
"""

from collections import Counter

import pytest
import torch

from harness import run_distributed
from workers import loss_rel_err, max_rel_err, rel_err, run_many, run_reference, scenario

FAMILIES = ["llama", "qwen2"]

# Biases start at zero, so after a few steps their norm is only ~lr * steps and Adam's m/sqrt(v)
# turns last-bit differences of tiny gradients into visible relative differences (k_proj.bias is
# the extreme: softmax is shift invariant per query, so its exact gradient is 0 and autograd returns
# pure rounding noise). Their gradients are still checked to 1e-5 at step one, and the whole
# parameter vector to 1e-5; the final per-tensor bound for biases is looser.
NOISE_ONLY = ("bias",)


def assert_params_close(got: dict, ref: dict, rtol: float, noise_rtol: float = 1e-3, tensor_rtol: float | None = None,
                        noise_only: tuple = NOISE_ONLY):
    """The whole parameter vector within ``rtol`` (norm-wise); each tensor within ``tensor_rtol``
    (default ``10 * rtol``: one small tensor after 10 Adam steps carries more relative noise); the
    ``noise_only`` tensors within ``noise_rtol`` (None: not checked one by one)."""
    assert set(got) == set(ref)
    flat_got = torch.cat([got[k].flatten() for k in sorted(ref)])
    flat_ref = torch.cat([ref[k].flatten() for k in sorted(ref)])
    assert rel_err(flat_got, flat_ref) < rtol, rel_err(flat_got, flat_ref)
    for k in ref:
        if k.endswith(noise_only) and noise_rtol is None:
            continue
        bound = noise_rtol if k.endswith(noise_only) else (tensor_rtol or 10 * rtol)
        assert rel_err(got[k], ref[k]) < bound, (k, rel_err(got[k], ref[k]))


def check_fp32(res: dict, ref: dict):
    assert loss_rel_err(res["losses"], ref["losses"]) < 1e-5, (res["losses"], ref["losses"])
    assert loss_rel_err(res["norms"], ref["norms"]) < 1e-5
    err, name = max_rel_err(res["grads"][0], ref["grads"][0])
    assert err < 1e-5, (name, err)
    assert_params_close(res["params"], ref["params"], 1e-5)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_fp32_parity_llama_and_qwen2(world):
    # hidden_size 44 is not divisible by 3: every unit is padded and shards cut through params.
    scenarios = [scenario(family=f, overrides={"hidden_size": 44, "num_attention_heads": 2,
                                                "num_key_value_heads": 1}) for f in FAMILIES]
    results = run_distributed(run_many, world, scenarios)
    for s, res in zip(scenarios, results[0]):
        check_fp32(res, run_reference({**s, "world": world}))
    # Every rank saw the same global losses and the same full parameters.
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert a["losses"] == b["losses"]
            assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])


def test_bf16_parity_within_bf16_tolerance():
    # the last one accumulates: the bf16 copies are cast once per optimizer step, not per micro-batch
    scenarios = [scenario(family=f, dtype="bf16") for f in FAMILIES] + [scenario(dtype="bf16", micro=1, accum=2)]
    results = run_distributed(run_many, 2, scenarios)[0]
    for s, res in zip(scenarios, results):
        ref = run_reference({**s, "world": 2})
        assert loss_rel_err(res["losses"], ref["losses"]) < 1e-2
        # per tensor, biases are left out: their zero-mean gradient noise is what bf16 rounds
        assert_params_close(res["params"], ref["params"], 2e-2, noise_rtol=None, tensor_rtol=5e-2)
        # and it is genuinely bf16: not bitwise the fp32 trajectory
        assert res["losses"] != ref["losses"]


def test_gradient_accumulation_gives_the_same_trajectory():
    """(micro, accum) = (4,1), (2,2), (1,4) per rank: same global batch, same grads, same params."""
    shapes = [(4, 1), (2, 2), (1, 4)]
    scenarios = [scenario(micro=m, accum=a, steps=6, grads_every_step=True, log_step=2) for m, a in shapes]
    results = run_distributed(run_many, 2, scenarios)
    ref = run_reference({**scenarios[0], "world": 2})
    for (_, accum), res in zip(shapes, results[0]):
        assert loss_rel_err(res["losses"], ref["losses"]) < 1e-5
        # Full gradients before every optimizer step. full_grads() assembles every rank's own
        # reduced shard, so this checks that each rank holds its part of the one global gradient
        # (no micro-batch of any rank left out of the reduction).
        for got, want in zip(res["grads"], ref["grads"]):
            err, name = max_rel_err(got, want)
            assert err < 1e-5, (name, err)
        assert_params_close(res["params"], ref["params"], 1e-5)
        # Collectives of step 2 ("pre": issued by step 1's optimizer step for step 2). The norm group,
        # the embedding and layers 0 and 1 (the first unit of every slot) are gathered right after
        # the step and never again during it; the norm group is reduced once per backward. Layers 0
        # and 1 stay in their slots from one micro-batch's backward to the next forward (masters
        # unchanged); layers 2 and 3 are gathered by every forward.
        pre = Counter(r[2] for r in res["log"] if r[0] == "pre" and r[1] == "all_gather")
        fwd_gathers = Counter(r[2] for r in res["log"] if r[0] == "fwd" and r[1] == "all_gather")
        reductions = Counter(r[2] for r in res["log"] if r[1] == "reduce_scatter")
        assert pre == Counter(["small", "embed", "layer_0", "layer_1"]), pre
        assert fwd_gathers["small"] == 0 and reductions["small"] == accum, (fwd_gathers, reductions)
        assert fwd_gathers["layer_0"] == fwd_gathers["layer_1"] == 0, fwd_gathers
        assert fwd_gathers["layer_2"] == fwd_gathers["layer_3"] == accum, fwd_gathers


def test_tied_embeddings_unused_params_checkpointing_and_zero_grad_modes():
    scenarios = [
        scenario(overrides={"tie_word_embeddings": True}, steps=5),
        # layer 1's up_proj gets no gradient; slot 1's previous owner (layer 3) wrote one there
        scenario(unused=1, wd=0.0, steps=5, grads_every_step=True),
        scenario(ckpt=3, steps=5),
        scenario(zero_grad_none=False, steps=5),
    ]
    results = run_distributed(run_many, 2, scenarios)[0]
    for s, res in zip(scenarios, results):
        ref = run_reference({**s, "world": 2})
        check_fp32(res, ref)
    tied = results[0]["params"]
    assert tied["lm_head.weight"] is tied["model.embed_tokens.weight"] or torch.equal(
        tied["lm_head.weight"], tied["model.embed_tokens.weight"])
    for g in results[1]["grads"]:
        assert torch.count_nonzero(g["model.layers.1.mlp.up_proj.weight"]) == 0
        assert torch.count_nonzero(g["model.layers.3.mlp.up_proj.weight"]) > 0


def test_two_runs_are_bitwise_equal_and_buffers_never_move():
    s = scenario(steps=4, accum=2, micro=1)
    a = run_distributed(run_many, 2, [s, s])[0]
    assert a[0]["losses"] == a[1]["losses"]
    assert all(torch.equal(a[0]["params"][k], a[1]["params"][k]) for k in a[0]["params"])
    for res in a:
        assert all(p == res["ptrs"][0] for p in res["ptrs"])  # data pointers fixed after step one
        assert res["plan"] == res["allocated"]                 # the plan is what is allocated


def test_mistral_qwen3_gemma_and_sdpa_parity():
    """Mistral (sliding-window config), Qwen3 (q/k norms inside attention; also tied), Gemma
    (tied, scaled embeddings, (1 + w) norms), and Llama with SDPA attention (the others: eager)."""
    scenarios = [scenario(family="mistral", steps=4), scenario(family="qwen3", steps=4),
                 scenario(family="qwen3", overrides={"tie_word_embeddings": True}, steps=4),
                 scenario(family="gemma", steps=4),
                 scenario(overrides={"attn_implementation": "sdpa"}, steps=4)]
    results = run_distributed(run_many, 2, scenarios)[0]
    for s, res in zip(scenarios, results):
        check_fp32(res, run_reference({**s, "world": 2}))


ALL_FAMILIES = ["llama", "qwen2", "mistral", "qwen3", "gemma"]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_family_at_every_world_size_with_and_without_accumulation(world):
    """The matrix: every supported family x world 1-4 x (2 sequences per rank in one micro-batch, or
    1 x 2 micro-batches), fp32, against the unsharded single-process run of the same global batches."""
    scenarios = [scenario(family=f, micro=m, accum=a, steps=4) for f in ALL_FAMILIES for m, a in ((2, 1), (1, 2))]
    for s, res in zip(scenarios, run_distributed(run_many, world, scenarios)[0]):
        ref = run_reference({**s, "world": world})
        assert loss_rel_err(res["losses"], ref["losses"]) < 1e-5, (s["family"], s["accum"], res["losses"], ref["losses"])
        err, name = max_rel_err(res["grads"][0], ref["grads"][0])
        assert err < 1e-5, (s["family"], s["accum"], name, err)
        assert_params_close(res["params"], ref["params"], 1e-5)


@pytest.mark.parametrize("world", [2, 3])
def test_every_family_in_bf16(world):
    """bf16 weights and compute (fp32 masters and reduction) for every family, with accumulation, to
    bf16 tolerance; and genuinely bf16 (not the fp32 trajectory). Per tensor, what starts at zero is
    left out (biases; Gemma's norm weights, used as 1 + w): after 4 steps it is a few lr of rounding."""
    scenarios = [scenario(family=f, dtype="bf16", micro=1, accum=2, steps=4) for f in ALL_FAMILIES]
    for s, res in zip(scenarios, run_distributed(run_many, world, scenarios)[0]):
        ref = run_reference({**s, "world": world})
        assert loss_rel_err(res["losses"], ref["losses"]) < 1e-2, (s["family"], res["losses"], ref["losses"])
        zero_init = NOISE_ONLY + (("norm.weight",) if s["family"] == "gemma" else ())
        assert_params_close(res["params"], ref["params"], 2e-2, noise_rtol=None, tensor_rtol=5e-2, noise_only=zero_init)
        assert res["losses"] != ref["losses"]


PER_UNIT = {"reshard_after_forward": False}


@pytest.mark.parametrize("world", [2, 3])
def test_per_unit_buffers_and_no_sync_accumulation(world):
    """reshard_after_forward=False (every unit keeps its own buffers) with and without no_sync():
    the same trajectory as the reference, every unit gathered at most once per step, nothing
    re-gathered in backward, and with no_sync each unit reduced once per step, not per micro-batch."""
    units = 7  # embed, 4 layers, lm_head, the norm group
    cases = [((4, 1), False), ((2, 2), True), ((2, 2), False)]  # 4 sequences per rank in every case
    if world == 2:
        cases += [((1, 4), True)]
    scenarios = [scenario(micro=m, accum=a, steps=4, grads_every_step=True, log_step=2, shard_kw=PER_UNIT,
                          no_sync=ns, overrides={"hidden_size": 44, "num_attention_heads": 2,
                                                 "num_key_value_heads": 1}) for (m, a), ns in cases]
    results = run_distributed(run_many, world, scenarios)
    ref = run_reference({**scenarios[0], "world": world})
    for ((_, accum), ns), res in zip(cases, results[0]):
        assert loss_rel_err(res["losses"], ref["losses"]) < 1e-5
        for got, want in zip(res["grads"], ref["grads"]):
            err, name = max_rel_err(got, want)
            assert err < 1e-5, (name, err)
        assert_params_close(res["params"], ref["params"], 1e-5)
        assert res["plan"] == res["allocated"] and all(p == res["ptrs"][0] for p in res["ptrs"])
        gathers = Counter((r[0], r[2]) for r in res["log"] if r[1] == "all_gather")
        reductions = Counter(r[2] for r in res["log"] if r[1] == "reduce_scatter")
        # Every unit has a slot of its own, so step 1's optimizer step gathers them all for step 2
        # ("pre"), once; nothing is gathered in any forward or backward of the step.
        assert gathers == Counter(("pre", u) for u in ["small", "embed", "layer_0", "layer_1", "layer_2",
                                                       "layer_3", "lm_head"]), gathers
        assert len(reductions) == units and set(reductions.values()) == {1 if ns else accum}, reductions


def test_per_unit_buffers_with_no_sync_tied_unused_bf16():
    cases = [scenario(overrides={"tie_word_embeddings": True}, micro=1, accum=2, no_sync=True, steps=4),
             # layer 1's up_proj gets no gradient in any micro-batch: its range is zeroed once and
             # must stay zero while the other micro-batches accumulate around it
             scenario(unused=1, wd=0.0, micro=1, accum=3, no_sync=True, steps=4, grads_every_step=True),
             scenario(dtype="bf16", micro=1, accum=2, no_sync=True),
             # qwZ: one codes workspace serves every unit's slot
             scenario(dtype="bf16", micro=1, accum=2, no_sync=True, shard_kw={"quantized_weights": 8,
                                                                               "quant_block": 64})]
    cases = [{**s, "shard_kw": {**PER_UNIT, **s["shard_kw"]}} for s in cases]
    results = run_distributed(run_many, 2, cases)[0]
    for s, res in zip(cases[:2], results[:2]):
        check_fp32(res, run_reference({**s, "world": 2}))
    for g in results[1]["grads"]:
        assert torch.count_nonzero(g["model.layers.1.mlp.up_proj.weight"]) == 0
    ref = run_reference({**cases[2], "world": 2})
    assert loss_rel_err(results[2]["losses"], ref["losses"]) < 1e-2
    assert_params_close(results[2]["params"], ref["params"], 2e-2, noise_rtol=None, tensor_rtol=5e-2)
    qwz = results[3]
    assert loss_rel_err(qwz["losses"], ref["losses"]) < 2e-2 and qwz["losses"] != results[2]["losses"]
    assert qwz["plan"] == qwz["allocated"] > results[2]["plan"]


def test_per_unit_buffers_with_no_sync_under_hybrid_sharding():
    """World 4 as 2 shard groups of 2: the one reduction per step under no_sync() is reduce-scattered
    inside the shard group and all-reduced across the replicas, as every reduction is."""
    s = scenario(micro=1, accum=2, no_sync=True, steps=4, log_step=2,
                 shard_kw={**PER_UNIT, "shard_group_size": 2})
    res = run_distributed(run_many, 4, [s])[0][0]
    check_fp32(res, run_reference({**s, "world": 4}))
    reductions = Counter((r[1], r[2]) for r in res["log"] if r[1] in ("reduce_scatter", "all_reduce"))
    assert {n for (op, _), n in reductions.items()} == {1}, reductions  # once per unit and step
    assert {u for op, u in reductions if op == "all_reduce"} == {u for op, u in reductions if op == "reduce_scatter"}


def test_other_decoder_families_of_the_same_shape():
    """Every other HF decoder family of the same shape (fused projections, extra and post norms,
    LayerNorm biases, softcapping, experts, attention sinks, hybrid linear-attention, Mamba and
    convolution layers; Llama 4 reads its embedding's device outside the embedding's unit), world 2,
    two micro-batches per step, fp32, against the unsharded run: those this transformers knows."""
    from models import OTHER_FAMILIES, known_families

    # The unsharded models' own gradients differ in the last bits between one batch of 4 sequences
    # and 4 micro-batches of 1 (transformers 5.24), by up to 8e-5 for Qwen3-Next's decay parameters
    # (A_log, dt_bias: one value per head, summed over every token of its gated delta rule) and 6e-5
    # for DiffLlama's lambda vectors; everything else is held to 1e-5.
    grad_rtol = {"qwen3_next": 2e-4, "diffllama": 2e-4}
    families = known_families(OTHER_FAMILIES)
    assert {"phi3", "gemma2", "olmo2", "mixtral", "qwen3_moe"} <= set(families)
    scenarios = [scenario(family=f, micro=1, accum=2, steps=2) for f in families]
    for s, res in zip(scenarios, run_distributed(run_many, 2, scenarios, timeout=600)[0]):
        ref = run_reference({**s, "world": 2})
        assert loss_rel_err(res["losses"], ref["losses"]) < 1e-5, (s["family"], res["losses"], ref["losses"])
        err, name = max_rel_err(res["grads"][0], ref["grads"][0])
        assert err < grad_rtol.get(s["family"], 1e-5), (s["family"], name, err)
        got, want = (torch.cat([r["params"][k].flatten() for k in sorted(ref["params"])]) for r in (res, ref))
        assert rel_err(got, want) < 1e-5, (s["family"], rel_err(got, want))


@pytest.mark.parametrize("world", [1, 2])
def test_a_parameter_no_rank_gave_a_gradient_is_named_once(world):
    """A trainable parameter that no rank's loss reached between two optimizer steps is stepped with a
    zero gradient (its flat shard holds others that got one), where torch skips a parameter without
    a gradient: rank 0 names it, once. One that another rank's loss reached got its gradient."""
    from workers import run_no_gradient_warning

    for optimizers in (1, 2):  # (two: the second one's step checks see the flags the first one's saw)
        every = run_distributed(run_no_gradient_warning, world, "every", optimizers)[0]
        assert len(every) == 1, every
        assert "1 trainable parameter got no gradient on any rank since the last optimizer step: " \
               "model.layers.1.mlp.up_proj.weight. " in every[0]
        assert run_distributed(run_no_gradient_warning, world, "none", optimizers)[0] == []
    # the zero-gradient step that creates a fresh optimizer's state names nothing (it trains nothing)
    # and leaves the real step to name the parameter
    with_state = run_distributed(run_no_gradient_warning, world, "every", 1, True)[0]
    assert len(with_state) == 1 and "model.layers.1.mlp.up_proj.weight. " in with_state[0], with_state
    if world > 1:
        assert run_distributed(run_no_gradient_warning, world, "one")[0] == []
