"""Failing loudly and early: non-finite values, diverging ranks, dead or stalled ranks, misuse.

(Crash-safe checkpoints and refusing pickles are in test_checkpoint.py; bad input to shard() and
ShardConfig in test_errors.py.)
"""

import math
import re

import pytest
import torch

import yashard

from harness import run_distributed, run_until_exit
from reliability_workers import (backward_raises_then_training_goes_on, clip_p_norms, discarded_batch, reads_after_eval_and_load, unreached_layers_are_skipped, gradients_of_inputs_only, penalty_on_the_shards, inputs_embeds_from_the_input_embedding, ranks_build_different_models, generate_uneven_lengths, torch_clip_on_masters, scaler_floor, default_backend_step, die_or_stall, fp16_nonfinite_without_scaler, fp16_scaler_misuse,
                                 guard_run, lm_head_too_early, nonfinite, nonfinite_skip_then_train,
                                 optimizer_before_shard, prefetch_after_step, reads_between_step_and_forward, scaler_lifetime, scaler_steps, uneven_layers,
                                 uneven_micro_batches)


@pytest.mark.parametrize("where,clip,accum", [("forward", True, 1), ("grad", True, 1), ("grad", False, 1),
                                              ("grad", False, 2), ("grad", True, 2)])
def test_nonfinite_raises_naming_the_layer_and_the_rank(where, clip, accum):
    # the gradient check reads the clip's partial norms (taken before the clip spreads a NaN), or
    # sums each gradient at the step when nothing clipped; with accumulation, a NaN from the first
    # micro-batch only is still in the gradients the optimizer would step on
    results = run_distributed(nonfinite, 2, "raise", where, clip, accum)
    for res in results:  # every rank raises the same error (the flags are all-gathered)
        msg = res["error"]
        assert msg == results[0]["error"]
        if where == "forward":
            assert re.search(r"the forward output of model\.layers\.2 was the first non-finite one \(on rank 1\)", msg), msg
        else:
            assert "forward output" not in msg
            assert re.search(r"non-finite gradients in model\.layers\.2, model\.layers\.1, .*\(first in backward "
                             r"order: model\.layers\.2, on every rank; a NaN/inf, or values whose squared norm overflows\)",
                             msg), msg
        assert "ShardConfig(on_nonfinite='skip') skips such steps instead" in msg


def test_nonfinite_skip_leaves_the_weights_and_trains_on():
    for res in run_distributed(nonfinite_skip_then_train, 2):
        assert res["skipped"] and res["moved"] and res["count"] == 1
    for res in run_distributed(nonfinite, 2, "ignore", "forward"):
        assert not res["unchanged"]  # ignore: the step ran (and poisoned the weights)


@pytest.mark.parametrize("mode", ["raise", "skip"])
@pytest.mark.parametrize("how", ["forward", "backward", "backward_in_place", "eval"])
def test_a_batch_thrown_away_for_its_nonfinite_loss_leaves_no_trace(mode, how):
    """The usual loop skips a batch whose loss is not finite (no backward, or a backward and then
    zero_grad(), and no step). Its forward's NaN/inf counted until the next step, which raised
    (blaming a forward the user had thrown away) or was skipped without a word; only forwards whose
    gradients the step uses count, as does a grad-enabled forward never backwarded (an evaluation)."""
    for error, skipped, same in run_distributed(discarded_batch, 2, mode, how):
        assert error is None and skipped == 0, (error, skipped)
        assert same in (True, None)  # bitwise the run that never saw the batch


def test_weights_read_after_an_evaluation_or_a_load_are_the_current_ones(tmp_path):
    """A checkpointed layer's weight read after a no-grad forward showed another layer's values (the
    slot's next owner), and a norm weight read after load_checkpoint the values before the load."""
    for wrong in run_distributed(reads_after_eval_and_load, 2, str(tmp_path / "ckpt")):
        assert wrong == [], wrong


def test_collective_order_guard():
    plain, guarded = (run_distributed(guard_run, 2, debug, False) for debug in (False, True))
    assert [r["losses"] for r in plain] == [r["losses"] for r in guarded]  # the guard changes nothing
    results = run_distributed(guard_run, 2, True, True)
    for res in results:
        # #1 to #4: the norm group, embedding, layer 0 and layer 1 gathers issued right after the last step
        assert re.search(r"ranks issued different collectives since the last optimizer step: collective #5 was "
                         r"all_gather of layer_1 \(\d+ elements, \d+ bytes, world group\) on rank 0 but all_gather of "
                         r"layer_2 .* on rank 1", res["error"]), res["error"]


@pytest.mark.parametrize("action", ["die", "stall"])
def test_a_dead_or_stalled_rank_makes_the_others_raise_in_bounded_time(action):
    timeout = 4.0
    out = run_until_exit(die_or_stall, 2, action, 3, timeout, timeout=90, grace=60, wait_for=(0,))
    code, report = out[0]
    assert report is not None, out
    ok, res = report
    assert ok and res["error"], out
    assert re.search(r"yashard: (all_gather|gradient reduction \(\w+\)) of \w+ \((backward of )?forward #3\) "
                     r"on rank 0 of 2 failed: ", res["error"]), res["error"]
    assert "A peer rank died, stalled, or issued a different sequence of collectives" in res["error"]
    assert re.search(r"compare the collective, layer and phase each rank names here .*debug_collectives=True\) finds a "
                     r"divergence that does not hang, at the next optimizer step; ShardConfig\(collective_timeout=\.\.\.\) "
                     r"bounds the wait", res["error"]), res["error"]
    if action == "stall":
        assert "timed out" in res["error"].lower() and timeout <= res["seconds"] < timeout + 10, res
    else:
        assert out[1][0] == 3 and res["seconds"] < 30, out  # the victim's own exit code


def test_optimizer_built_before_shard_is_refused():
    msg = run_distributed(optimizer_before_shard, 1)[0]
    assert re.search(r"AdamW holds model\.embed_tokens\.weight, a parameter yashard\.shard removed from the model "
                     r"\(the optimizer was built before yashard\.shard\): stepping it trains nothing\. Build the "
                     r"optimizer after yashard\.shard", msg), msg


def test_lm_head_before_every_layer_ran():
    msg = run_distributed(lm_head_too_early, 1)[0]
    assert msg.startswith("lm_head ran after 3 of the 4 decoder layers (model.layers.3 was expected next)"), msg


def test_gathers_issued_after_the_step_are_redone_when_the_masters_change():
    for res in run_distributed(prefetch_after_step, 2):
        assert res["tail"] == [("all_gather", u) for u in ("small", "embed", "layer_0", "layer_1")]  # by opt.step()
        assert abs(res["loss"] - res["ref"]) < 1e-5 * abs(res["ref"]), res


@pytest.mark.parametrize("tied,reshard", [(False, True), (True, True), (False, False)])
def test_weights_read_between_the_step_and_the_next_forward(tied, reshard):
    """The step's post-hook gathers again what the next forward needs first. The norm weights, which
    stay readable between forwards, show the stepped values; the embedding (whose views stay on its
    module where its slot is its own: tied, or reshard_after_forward=False) is a stub that raises
    until the next forward puts this step's views back, never the weights before the step or a
    gather in flight (gathers here land only when waited for, as NCCL's may)."""
    for res in run_distributed(reads_between_step_and_forward, 2, tied, reshard):
        assert torch.equal(res["norm"], res["full"]["model.norm.weight"])
        assert res["embed_error"] is not None and res["embed_error"].startswith("ShardedStub: ")
        assert "model.embed_tokens.weight" in res["embed_error"]
        assert torch.equal(res["after"]["norm"], res["full"]["model.norm.weight"])
        if tied or not reshard:
            assert torch.equal(res["after"]["embed"], res["full"]["model.embed_tokens.weight"])


def test_ranks_running_different_numbers_of_forward_passes_fail_instead_of_hanging():
    """The collectives stop matching: gloo aborts the rank that receives a mismatched size, and
    the other raises CollectiveError; every process has ended well within the timeout."""
    out = run_until_exit(uneven_micro_batches, 2, timeout=60, grace=20, wait_for=(0, 1))
    reports = {r: rep for r, (code, rep) in out.items() if rep is not None}
    errors = [rep[1]["error"] for rep in reports.values() if rep[0] and rep[1]["error"]]
    aborted = [r for r, (code, rep) in out.items() if code not in (0, None) and rep is None]
    assert errors or aborted, out
    for e in errors:
        assert e.startswith(("CollectiveError: yashard: ", "CollectiveOrderError: ")), e
    assert all(rep[1]["seconds"] < 15 for rep in reports.values() if rep[0]), out


def test_nccl_stream_waits_are_not_host_blocking():
    # On NCCL, work.wait(timeout) blocks the host; only waits the host makes anyway get the timeout.
    from yashard.collectives import wait_timeout
    assert wait_timeout("cuda", 600.0, host=False) is None
    assert wait_timeout("cuda", 600.0, host=True) == 600.0
    assert wait_timeout("cpu", 600.0, host=False) == 600.0
    assert wait_timeout("cpu", None, host=True) is None


def test_ranks_running_different_numbers_of_layers_fail_instead_of_hanging():
    out = run_until_exit(uneven_layers, 2, timeout=60, grace=20, wait_for=(0, 1))
    (code0, rep0), (code1, rep1) = out[0], out[1]
    assert rep1 is not None and rep1[0], out  # the rank that skipped a layer names it
    assert rep1[1]["error"].startswith("OrderError: lm_head ran after 3 of the 4 decoder layers "
                                       "(model.layers.3 was expected next)"), rep1
    # its peer either raises a CollectiveError within the timeout or is aborted by gloo
    if rep0 is not None:
        assert rep0[0] and rep0[1]["error"].startswith("CollectiveError: yashard: "), rep0
        assert rep0[1]["seconds"] < 15, rep0
    else:
        assert code0 not in (0, None), out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_fused_optimizer_step_reaches_the_next_forward(pg, dtype):
    # torch's fused optimizers update parameters without bumping their version counters
    from models import build

    sm = yashard.shard(build(), config=yashard.ShardConfig(param_dtype=dtype))
    opt = torch.optim.AdamW(sm.parameters(), lr=1e-2, fused=True)
    ids = torch.randint(0, 96, (2, 8))
    for _ in range(2):  # two micro-batches: the second forward reuses the layers still in the slots
        sm(input_ids=ids, labels=ids).loss.backward()
    before = [u.master.detach().clone() for u in sm.runtime.units]
    opt.step()
    opt.zero_grad()
    assert any(not torch.equal(b, u.master) for b, u in zip(before, sm.runtime.units))
    loss = sm(input_ids=ids, labels=ids).loss.item()
    for u in sm.runtime.units:  # the gathered copies were made from the stepped masters
        assert torch.equal(u.gather_src, u.master.detach().to(dtype)), u.name
    ref = build()
    ref.load_state_dict(sm.full_state_dict(), strict=False)
    ref.tie_weights()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        ref_loss = ref(input_ids=ids, labels=ids).loss.item()
    assert abs(loss - ref_loss) < (1e-5 if dtype == torch.float32 else 2e-2) * abs(ref_loss), (loss, ref_loss)


def test_a_group_initialised_without_a_backend():
    # torch 2.13: init_process_group() with no backend reports get_backend() == "undefined"
    results = run_distributed(default_backend_step, 2, backend=None)
    for res in results:
        assert res["get_backend"] == "undefined" and "gloo" in res["backend"] and res["device"] == "cpu"
    assert all(math.isfinite(loss) for res in results for loss in res["losses"])


@pytest.mark.parametrize("fused", [False, True])
def test_sharded_grad_scaler_makes_every_rank_skip_an_inf_that_one_rank_saw(fused):
    # rank 0 alone has an inf in its gradient shard at step 0: both ranks skip it and halve the scale,
    # then both step at 1. (With a fused AdamW the optimizer skips inside step(), after the step
    # checks ran: on_nonfinite='raise' is left to the scaler.)
    # (a scaler that let the ranks disagree would leave one rank waiting in the step checks: bounded)
    for rank_out in run_distributed(scaler_steps, 2, "sharded", fused, (0,), 2, torch.float16, {"collective_timeout": 20}):
        assert [(stepped, scale) for stepped, scale, _ in rank_out] == [(False, 512.0), (True, 512.0)]


def test_fp16_training_with_the_sharded_scaler_follows_fp32():
    fp16 = run_distributed(scaler_steps, 2, "sharded", False, (), 5)
    fp32 = run_distributed(scaler_steps, 2, None, False, (), 5, torch.float32)
    for a, b in zip(fp16, fp32):
        assert all(stepped for stepped, _, _ in a) and [s for _, s, _ in a] == [1024.0] * 5
        la, lb = [x[2] for x in a], [x[2] for x in b]
        assert la != lb and max(abs(x - y) / y for x, y in zip(la, lb)) < 1e-2, (la, lb)


@pytest.mark.parametrize("set_to_none,accum", [(True, 1), (False, 1), (True, 2), (False, 2), (None, 1)])
def test_a_backward_that_raises_leaves_training_able_to_go_on(set_to_none, accum):
    """A raising backward drops autograd's final callback; the next forward resets the runtime and
    zeroes what the failed backward reached, so the run goes on exactly as if the failed batch had
    never been seen, with either zero_grad or none (None)."""
    for same, la, lb, _ in run_distributed(backward_raises_then_training_goes_on, 2, set_to_none, accum):
        assert same, (la, lb)


@pytest.mark.parametrize("how", ["future", "future_last"])
def test_a_comm_hook_future_that_fails_costs_one_step(how):
    """A comm hook whose future fails once (raised while the next layer reduces, or at the end of the
    backward for the last bucket) fails that backward alone: the next forward throws its other
    reductions away and the run goes on as if the batch had never been seen (before, every later
    backward raised the first error again)."""
    unit = "small" if how == "future_last" else "layer_2"
    for rank, (same, la, lb, errors) in enumerate(run_distributed(backward_raises_then_training_goes_on, 2, True, 1, how)):
        assert same, (la, lb)
        assert errors == [  # the advice points at the hook, not at a dead peer
            f"yashard: gradient reduction (my_hook) of {unit} (backward of forward #2) on rank {rank} of 2 failed: "
            "simulated out of memory. The comm hook my_hook (register_comm_hook) raised this, or returned a future "
            "that did: look there first. If it came from a collective the hook issued, a peer rank died, stalled, "
            "or issued a different sequence of collectives: look for the first error on the other ranks"], errors


def test_torch_clip_grad_norm_on_a_sharded_model_clips_by_the_global_norm():
    """torch's clip sums the squares of the gradients it is given: on master shards that would be
    each rank's own norm. Given exactly a sharded model's parameters it clips by the global norm,
    bitwise what model.clip_grad_norm_ does; part of them, or them mixed with other tensors, and
    get_total_norm of their gradients raise; plain tensors keep torch's behaviour."""
    outs = run_distributed(torch_clip_on_masters, 2)
    for out in outs:
        got_torch, got_model, want = out["norms"]
        assert got_torch == got_model and abs(got_torch - want) / want < 1e-6, out["norms"]
        assert out["same_grads"]
        assert out["errors"]["some"].startswith("torch.nn.utils.clip_grad_norm_ got yashard master shards mixed")
        assert out["errors"]["mixed"] == out["errors"]["some"]
        assert out["errors"]["total"].startswith("torch.nn.utils.get_total_norm got gradients of yashard master shards")
        norm = math.sqrt(12.0)
        assert out["plain"][0] == pytest.approx(norm) and out["plain"][2] == pytest.approx(1.0, rel=1e-5)
        assert out["plain"][1] == pytest.approx([2.0 / (norm + 1e-6)] * 3)
    assert outs[0]["norms"] == outs[1]["norms"]
    for out in outs:  # a NaN on either rank: the max-norm is NaN on both (gloo's max alone can drop it)
        assert out["inf_norm_nan"] == {0: (True, True), 1: (True, True)}, out["inf_norm_nan"]
    for out in outs:  # error_if_nonfinite raises on every rank (the norm is global) and clips nothing
        msg, untouched = out["nonfinite"]
        assert msg.startswith("the total norm of order 2.0 of the gradients is non-finite") and untouched, out


@pytest.mark.parametrize("world,subgroup", [(2, False), (3, True)])
def test_generate_with_sequences_ending_at_different_steps(world, subgroup):
    outs = run_distributed(generate_uneven_lengths, world, subgroup)[:2]
    for got, want, assisted in outs:
        assert got == want
        assert assisted.startswith("generate(prompt_lookup_num_tokens=...) on a model sharded over 2 ranks: every "
                                   "rank must keep stepping until all have finished"), assisted
    assert len(outs[0][0][0]) == 5 and len(outs[1][0][0]) > 5, outs  # rank 0 stopped at EOS, rank 1 went on


def test_ranks_sharding_different_models_are_told_so():
    want = {
        "vocab": "in embed, rank 0 has ('model.embed_tokens.weight', (96, 32), 'torch.float32') where rank 1 has "
                 "('model.embed_tokens.weight', (104, 32), 'torch.float32')",
        "layers": "in layer_2, rank 0 has None where rank 1 has ('model.layers.2.self_attn.q_proj.weight', (32, 32), "
                  "'torch.float32')",
        "config": "in ShardConfig, rank 0 has ('param_dtype', 'torch.float32') where rank 1 has ('param_dtype', "
                  "'torch.bfloat16')",
        "frozen": "in layer_1, rank 0 has ('model.layers.1.mlp.up_proj.weight', (64, 32), 'torch.float32') where "
                  "rank 1 has ('model.layers.1.mlp.up_proj.weight', (64, 32), 'torch.float32', 'frozen')",
    }
    for what, detail in want.items():
        for msg in run_distributed(ranks_build_different_models, 2, what):
            assert msg == (f"the ranks are sharding different models: {detail}. Every rank must build the same model "
                           "(same config, same code, the same parameters frozen) and pass the same ShardConfig (its device aside) to "
                           "yashard.shard"), msg


@pytest.mark.parametrize("tied", [False, True])
def test_inputs_embeds_from_the_input_embedding_matches_the_unsharded_model(tied):
    """The embedding called on its own runs as the first unit of the coming forward (even before the
    first forward ever ran), so LLaVA-style inputs_embeds train exactly."""
    for losses, ref_losses, worst in run_distributed(inputs_embeds_from_the_input_embedding, 2, tied):
        assert max(abs(a - b) / b for a, b in zip(losses, ref_losses)) < 1e-5, (losses, ref_losses)
        assert worst < 1e-5, worst


def test_sharded_grad_scaler_stops_a_run_whose_forward_overflows():
    """A forward that overflows float16 gives NaN gradients at any scale: the scaler skips and halves
    until the scale falls below min_scale (1.0 by default), then raises on every rank at the same
    step, naming the fix. min_scale=None keeps skipping, as torch.amp.GradScaler does."""
    for out, error in run_distributed(scaler_floor, 2, "default"):
        assert [s for _, s, _ in out] == [4.0, 4.0, 2.0, 1.0, 0.5], out
        assert [stepped for _, _, stepped in out] == [True, True, False, False, False], out
        assert all(math.isfinite(loss) for loss, _, _ in out[:2]) and all(math.isnan(loss) for loss, _, _ in out[2:])
        assert error is not None and error.startswith(
            "ShardedGradScaler: 3 optimizer step(s) in a row were skipped for non-finite gradients and the loss scale "
            "fell to 0.5, below min_scale=1: "), error
        assert "param_dtype=torch.bfloat16 or torch.float32" in error and error.endswith("min_scale=None to keep skipping steps")
    for out, error in run_distributed(scaler_floor, 2, None):
        assert error is None and [s for _, s, _ in out] == [4.0, 4.0, 2.0, 1.0, 0.5, 0.25], out
    for out, error in run_distributed(scaler_floor, 2, 0.25, 8):
        assert len(out) == 7 and out[-1][1] == 0.125 and error.startswith("ShardedGradScaler: 5 optimizer step(s)"), error
    with pytest.raises(RuntimeError, match=r"ValueError: ShardedGradScaler: min_scale=8\.0 must be > 0 and at most init_scale=4\.0"):
        run_distributed(scaler_floor, 1, 8.0)


def test_sharded_grad_scaler_needs_the_sharded_model():
    with pytest.raises(TypeError, match=r"ShardedGradScaler expects the ShardedModel returned by yashard\.shard, got Linear"):
        yashard.ShardedGradScaler(torch.nn.Linear(2, 2))


def test_an_fp16_run_without_loss_scaling_is_pointed_at_the_scaler():
    for msg in run_distributed(fp16_nonfinite_without_scaler, 2):
        assert msg is not None and msg.endswith(
            "; with param_dtype=float16, scale the loss with yashard.ShardedGradScaler (it skips such steps on every "
            "rank and lowers the scale)"), msg


def test_sharded_grad_scaler_lifetime_copies_and_on_nonfinite_coming_back():
    for out in run_distributed(scaler_lifetime, 2):
        assert out["with_first"] == ("ok", 512.0)   # the dropped second scaler did not unregister the first
        assert out["copy"].startswith("this ShardedGradScaler is a copy (deepcopy / unpickled) and is not attached")
        assert out["without"] == "NonFiniteError"


def test_torch_amp_grad_scaler_is_refused_on_every_rank():
    """torch.amp.GradScaler decides per rank, and an inf in one rank's shards would make that rank
    alone skip the step (the others then wait in a collective it never issues, up to
    collective_timeout). Refused on every rank at the first step: a fused optimizer by the found_inf
    the scaler hands it, the other path at unscale_, including the usual AMP recipe (fp32 parameters
    under fp16 autocast). A disabled scaler does nothing and passes; fp16 without a working scaler
    is warned about once, on rank 0."""
    fix = "scaler = yashard.ShardedGradScaler(model): the same API, with the check agreed across ranks"
    for error, _ in run_distributed(fp16_scaler_misuse, 2, True, torch.float16, "plain", None, False):
        assert error.startswith("AdamW.step() from a torch.amp.GradScaler on a yashard model: each rank holds other "
                                "gradient shards") and error.endswith(fix)
    for fused, dtype, autocast in ((True, torch.float16, None), (False, torch.float16, None),
                                   (False, torch.float32, torch.float16)):
        for error, warnings in run_distributed(fp16_scaler_misuse, 2, fused, dtype, "plain", autocast):
            assert error is not None and error.startswith(
                "torch.amp.GradScaler on an optimizer of a yashard model: each rank holds other gradient shards, so its "
                "inf check sees one rank's shards") and error.endswith(fix), error
    for rank, (error, warnings) in enumerate(run_distributed(fp16_scaler_misuse, 2, False, torch.float16, "plain_off")):
        assert error is None
        assert len(warnings) == (1 if rank == 0 else 0), warnings   # once, not every step
        assert all(w.startswith("param_dtype=float16 without yashard.ShardedGradScaler") for w in warnings)
    # fp32 weights whose gradients are reduced in fp16 underflow the same way: warned, naming the other fix
    fp16_wire = {"reduce_dtype": torch.float16}
    for rank, (error, warnings) in enumerate(run_distributed(fp16_scaler_misuse, 2, False, torch.float32, None,
                                                             None, True, fp16_wire)):
        assert error is None
        assert len(warnings) == (1 if rank == 0 else 0), warnings
        assert warnings == [] or (warnings[0].startswith("reduce_dtype=float16 without yashard.ShardedGradScaler")
                                  and warnings[0].endswith("ShardedGradScaler(model), or reduce_dtype=torch.float32"))
    for error, warnings in run_distributed(fp16_scaler_misuse, 2, False, torch.float32, "sharded", None, True,
                                           fp16_wire):
        assert (error, warnings) == (None, [])


@pytest.mark.parametrize("world", [1, 2])
def test_gradients_of_the_inputs_alone_leave_every_parameter_gradient_alone(world):
    """torch.autograd.grad / backward(inputs=...) through the model (adversarial embedding
    perturbation, saliency) gather the weights the backward needs and write and reduce nothing:
    before, they reduced every layer's gradient into the shards (a later step trained on it, a
    later backward doubled it)."""
    for out in run_distributed(gradients_of_inputs_only, world):
        for how in ("grad", "inputs"):
            err, none = out[how]
            assert err < 1e-6 and all(none), (how, out[how])
        assert out["moved"] == [] and out["then_backward"], out


@pytest.mark.parametrize("world", [1, 2])
def test_a_penalty_on_the_shards_counts_in_either_order(world):
    """A loss term on model.parameters() themselves accumulates into the shards' .grad through
    autograd, whenever the graph runs it: before, written after the unit's gradient was attached
    and before its first reduction, it was overwritten (the embedding and the norm group lost it)."""
    for worst in run_distributed(penalty_on_the_shards, world):
        assert worst[False] < 1e-5 and worst[True] < 1e-5, worst


def test_layers_no_rank_backward_reached_are_skipped_by_the_optimizer():
    """A layer and the head that ran forward with grad while the loss read an earlier hidden state:
    every rank still reduces them (their collectives must match), and the step's check, finding
    that no rank's backward reached them, puts .grad back to None, so AdamW skips them as torch
    does (before, weight decay and momentum moved them). The norm group holds reached and
    unreached norms in one shard: those are stepped with a zero gradient (documented, warned)."""
    for rank, diff in enumerate(run_distributed(unreached_layers_are_skipped, 2)):
        skipped = {n: d for n, d in diff.items() if ("layers.2." in n or n == "lm_head.weight") and "norm" not in n}
        assert len(skipped) == 8 and max(skipped.values()) < 1e-6, skipped
        assert max(d for n, d in diff.items() if "norm" not in n) < 1e-5, diff
    # a penalty on the shards reaches them through autograd alone: they keep that gradient and step
    for diff in run_distributed(unreached_layers_are_skipped, 2, 0.01):
        assert max(diff.values()) < 1e-5, diff
    # a batch backwarded and thrown away (zero_grad(), no step) before step 1 changes none of this:
    # its gradient flags went with its gradients (before, AdamW stepped the unreached shards: 0.33 off)
    for diff in run_distributed(unreached_layers_are_skipped, 2, 0.0, True):
        skipped = {n: d for n, d in diff.items() if ("layers.2." in n or n == "lm_head.weight") and "norm" not in n}
        assert len(skipped) == 8 and max(skipped.values()) < 1e-6, skipped
        assert max(d for n, d in diff.items() if "norm" not in n) < 1e-5, diff


def test_clip_grad_norm_by_any_p_norm_matches_torch():
    """p-norms other than 2 and inf (torch and FSDP2 take any p > 0): the sum of |g|^p over every
    rank's shards, then the p-th root; the norm and the clipped gradients are torch's on the full
    gradients, through the model's method and torch's wrapped function alike."""
    for out in run_distributed(clip_p_norms, 2):
        for key, (norm_err, grad_err) in out.items():
            assert norm_err < 1e-5 and grad_err < 1e-5, (key, out[key])

