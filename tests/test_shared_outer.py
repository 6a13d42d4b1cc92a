"""``ShardConfig(share_outer_slot=True)``: the embedding and the lm_head gather into the buffer the
two layer slots share (``layout.outer_arena``) instead of an outer slot of their own. Only where
the weights and gradients wait changes, so a run is bitwise the default's: losses, gradient norms,
every step's gradients and the final weights, at worlds 2 to 4, fp32 and bf16 (gradient slots in
bf16, reduced in chunks), with a vocabulary larger than both layer slots together and one smaller,
checkpointed, with accumulation and an unused parameter, partly frozen, qwZ, hybrid and hpZ. The
plan is what is held, the pure planner says the same, and no buffer ever moves."""

import pytest
import torch

import yashard
from harness import run_distributed
from models import build
from workers import run_many, scenario
from yashard.layout import outer_arena

BIG_VOCAB = {"vocab_size": 640}  # embedding 20480 elements > both tiny layer slots (2 x 9216)

VARIANTS = {
    "fp32": dict(),
    "bf16": dict(dtype="bf16"),
    "bf16, large vocabulary": dict(dtype="bf16", overrides=BIG_VOCAB),
    "fp32, large vocabulary, checkpointed, accumulation": dict(overrides=BIG_VOCAB, ckpt=2, accum=2, micro=1),
    "accumulation, unused": dict(accum=2, micro=1, unused=1),
    "frozen q_proj": dict(dtype="bf16", freeze=("q_proj",)),
    "frozen lm_head": dict(freeze=("lm_head",), overrides=BIG_VOCAB),
    "bf16, comm hook": dict(dtype="bf16", hook="reduce_scatter", overrides=BIG_VOCAB),
}
BY_WORLD = {
    2: {"qwZ": dict(dtype="bf16", shard_kw={"quantized_weights": 8, "quant_block": 64})},
    3: {"bf16 chunked": dict(dtype="bf16", reduce_chunk=(1200, 16), overrides=BIG_VOCAB)},
    4: {"hybrid": dict(shard_kw={"shard_group_size": 2}),
        "hpZ": dict(dtype="bf16", shard_kw={"secondary_group_size": 2}, overrides=BIG_VOCAB)},
}


def _variants(world: int) -> dict:
    return {**VARIANTS, **BY_WORLD.get(world, {})} if world != 3 else {**BY_WORLD[3], "fp32": dict()}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_shared_outer_slot_trains_bitwise_as_the_outer_slot(world):
    variants = _variants(world)
    scenarios = []
    for kw in variants.values():
        kw = dict(kw)
        shard_kw = kw.pop("shard_kw", {})
        base = dict(steps=3, log_step=1, grads_every_step=True, **kw)
        scenarios += [scenario(shard_kw={**shard_kw, "share_outer_slot": True}, **base),
                      scenario(shard_kw=shard_kw, **base)]
    results = run_distributed(run_many, world, scenarios)
    for rank_results in results:
        for i, name in enumerate(variants):
            shared, own = rank_results[2 * i: 2 * i + 2]
            assert shared["losses"] == own["losses"], (name, shared["losses"], own["losses"])
            assert shared["norms"] == own["norms"], name
            for got, want in zip(shared["grads"], own["grads"]):
                assert all(torch.equal(got[k], want[k]) for k in want), name
            assert all(torch.equal(shared["params"][k], own["params"][k]) for k in own["params"]), name
            assert shared["plan"] == shared["allocated"], name   # the plan is what is held
            assert shared["plan"] < own["plan"], name            # and less than with an outer slot
            assert all(p == shared["ptrs"][0] for p in shared["ptrs"]), name  # and it never moves


def _other_paths(rank, world, share):
    """Training steps with a no-grad forward between forward and backward (an evaluation), the
    input embedding called ahead of the model (``inputs_embeds``), and greedy ``generate()``."""
    torch.manual_seed(0)
    sm = yashard.shard(build(**BIG_VOCAB), config=yashard.ShardConfig(share_outer_slot=share, checkpoint_layers=1))
    opt = torch.optim.AdamW(sm.param_groups(0.1), lr=1e-2)
    g = torch.Generator().manual_seed(rank)
    out = {"losses": [], "evals": []}
    for step in range(3):
        ids = torch.randint(0, 640, (2, 12), generator=g)
        if step == 1:
            embeds = sm.get_input_embeddings()(ids) * 1.5
            loss = sm(inputs_embeds=embeds, labels=ids).loss
        else:
            loss = sm(input_ids=ids, labels=ids).loss
        with torch.no_grad():  # every unit gathered again, the lm_head's weights included
            out["evals"].append(sm(input_ids=ids.flip(1), labels=ids).loss)
        loss.backward()
        out["losses"].append(loss.detach())
        out["norm"] = sm.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
    out["generated"] = sm.generate(torch.randint(0, 640, (1, 4), generator=g), max_new_tokens=4, do_sample=False)
    out["params"] = sm.full_state_dict()
    return out


def test_evaluation_between_forward_and_backward_inputs_embeds_and_generate_are_as_the_outer_slots():
    shared = run_distributed(_other_paths, 2, True)
    own = run_distributed(_other_paths, 2, False)
    for a, b in zip(shared, own):
        for k in ("losses", "evals"):
            assert all(torch.equal(x, y) for x, y in zip(a[k], b[k])), k
        assert torch.equal(a["norm"], b["norm"]) and torch.equal(a["generated"], b["generated"])
        assert all(torch.equal(a["params"][k], b["params"][k]) for k in b["params"])


def test_the_arena_places_each_outer_unit_over_the_layer_slot_needed_last():
    # smaller than a layer slot: the embedding over layer 1's slot, the lm_head over layer L-2's
    a = outer_arena({"layer_even": 100, "layer_odd": 100, "embed": 60, "lm_head": 60}, n_layers=4, align=1)
    assert a.numel == 200 and a.span("layer_odd") == (100, 200)
    assert a.span("embed") == (140, 200) and a.overlaps("embed") == ("layer_odd",)
    assert a.span("lm_head") == (0, 60) and a.overlaps("lm_head") == ("layer_even",)
    odd = outer_arena({"layer_even": 100, "layer_odd": 100, "embed": 60, "lm_head": 60}, n_layers=5, align=1)
    assert odd.span("lm_head") == (140, 200)  # layer 3 is odd
    assert odd.overlaps("lm_head") == ("layer_odd", "embed")
    # larger than both: the buffer grows by the difference, every slot overlaps the outer ones
    big = outer_arena({"layer_even": 100, "layer_odd": 90, "embed": 250, "lm_head": 250}, n_layers=80, align=1)
    assert big.numel == 250 and big.span("embed") == (0, 250)
    assert big.overlaps("layer_even") == ("embed", "lm_head")
    # a slot of no gradients (frozen units) takes no memory and overlaps nothing
    grads = outer_arena({"layer_even": 100, "layer_odd": 100, "embed": 0, "lm_head": 60}, n_layers=4, align=1)
    assert grads.overlaps("embed") == () and "embed" not in grads.overlaps("lm_head")
    assert big.draw(10).splitlines()[1] == "layer_odd   |....####..|"
    # every slot starts where a buffer of its own would be aligned: 16 elements by default
    sizes = {"layer_even": 100, "layer_odd": 100, "embed": 250, "lm_head": 60}
    aligned = outer_arena(sizes, n_layers=5)
    assert all(lo % 16 == 0 for lo, _ in map(aligned.span, sizes)) and aligned.numel == 256
    assert aligned.span("layer_odd") == (112, 212) and aligned.span("lm_head") == (192, 252)


def test_share_outer_slot_refuses_tied_embeddings_and_no_reshard():
    with pytest.raises(ValueError, match=r"share_outer_slot=True needs an lm_head of its own.*ties it"):
        yashard.plan(build("gemma"), world_size=2, config=yashard.ShardConfig(share_outer_slot=True))
    with pytest.raises(ValueError, match=r"reshard_after_forward=False gives every unit a buffer of its own"):
        yashard.ShardConfig(share_outer_slot=True, reshard_after_forward=False)
    with pytest.raises(TypeError, match=r"share_outer_slot must be a bool, got int"):
        yashard.ShardConfig(share_outer_slot=1)


def test_the_command_line_offers_and_plans_the_shared_outer_slot():
    from yashard.plan.__main__ import main
    import contextlib
    import io

    for flags in ([], ["--share-outer-slot"]):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert main(["--config", "llama-3-70b", "--world", "256", "--checkpoint-layers", "80", *flags]) == 0
        text = buf.getvalue()
        if flags:
            assert "slot embed+lm_head          0.000 GiB  fixed" in text and "slot outer" not in text
            assert "yashard total               8.699 GiB" in text
        else:
            assert "with --share-outer-slot: yashard total 8.699 GiB, 3.914 GiB less" in text


def _lora_both(rank, world):
    from peft_workers import run_lora

    return [run_lora(rank, world, param_dtype=torch.bfloat16, share_outer_slot=share) for share in (True, False)]


def test_peft_lora_with_the_shared_outer_slot_trains_bitwise_as_with_its_own():
    """LoRA: the decoder layers and the outer units are frozen (no gradient buffers at all), the
    adapter group resident in its own slot; only where the frozen weights are gathered moves."""
    for shared, own in run_distributed(_lora_both, 2):
        assert shared["losses"] == own["losses"] and shared["norms"] == own["norms"]
        assert torch.equal(shared["logits"], own["logits"])
        assert all(torch.equal(shared["params"][k], v) for k, v in own["params"].items())
        assert shared["plan"] == shared["allocated"] < own["plan"]


def _without_the_prefetch_rule(rank, world):
    """A schedule that prefetched over weights compute still reads (the rule off) is stopped by the
    gather itself, loudly, before any rank writes: never a silently wrong result."""
    from yashard.errors import OrderError
    from yashard.gathers import Gathers

    def prefetch(self, unit):
        if unit is not None and (unit.slot.owner is not unit or unit.gathered is None):
            self.gather(unit)

    Gathers.prefetch = prefetch
    sm = yashard.shard(build(**BIG_VOCAB), config=yashard.ShardConfig(share_outer_slot=True))
    ids = torch.randint(0, 640, (2, 8), generator=torch.Generator().manual_seed(0))
    try:
        sm(input_ids=ids, labels=ids)
    except OrderError as e:
        return str(e)
    return None


def test_a_gather_over_weights_still_read_raises():
    for message in run_distributed(_without_the_prefetch_rule, 2):
        assert message is not None and "needs its weights while embed's, which share its buffer" in message
        assert "share_outer_slot=False" in message
