"""Rank functions for test_reliability.py."""

from __future__ import annotations

import contextlib
import os
import time

import torch

import yashard
from models import batches, build


def _setup(**cfg):
    sm = yashard.shard(build(num_hidden_layers=4), config=yashard.ShardConfig(**cfg))
    opt = torch.optim.AdamW(sm.param_groups(0.1), lr=1e-3)
    return sm, opt


def _step(sm, opt, rank, world, step, clip=True, before_micro=None):
    """One optimizer step on this rank's share of global batch ``step``; ``before_micro``: a list of
    callables, one per micro-batch (its length is the number of micro-batches), run before each."""
    ids = batches(step + 1, 2 * world, 8, 96)[step].chunk(world)[rank]
    micro = before_micro or [lambda: None]
    losses = []
    for hook, part in zip(micro, ids.chunk(len(micro))):
        hook()
        loss = sm(input_ids=part, labels=part).loss
        (loss / len(micro)).backward()
        losses.append(loss.item())
    if clip:
        sm.clip_grad_norm_(1.0)
    opt.step()
    opt.zero_grad()
    return sum(losses) / len(losses)


def _poison(sm, layer: int, where: str):
    """Make one layer's forward output (or, for "grad", only its input gradient) non-finite; returns
    the hook's handle."""
    module = sm.module.model.layers[layer]
    if where == "forward":
        return module.mlp.down_proj.register_forward_hook(lambda m, a, out: out * float("inf"))

    def poison_grad(m, a, out):
        (out if isinstance(out, torch.Tensor) else out[0]).register_hook(lambda g: g * float("nan"))
    return module.register_forward_hook(poison_grad)


def nonfinite(rank, world, mode, where, clip=True, accum=1):
    """Step 0 clean, step 1 poisoned on rank 1 only (with ``accum`` micro-batches: only the first),
    step 2 clean: what happens at step 1."""
    sm, opt = _setup(on_nonfinite=mode)
    _step(sm, opt, rank, world, 0)
    before = {u.name: u.master.detach().clone() for u in sm.runtime.units}
    handles = []

    def poison():
        if rank == 1:
            handles.append(_poison(sm, 2, where))

    def heal():
        while handles:
            handles.pop().remove()

    try:
        _step(sm, opt, rank, world, 1, clip=clip, before_micro=[poison] + [heal] * (accum - 1))
    except yashard.NonFiniteError as e:
        return dict(error=str(e))
    unchanged = all(torch.equal(before[u.name], u.master) for u in sm.runtime.units)
    return dict(unchanged=unchanged, skipped=sm.runtime.skipped_steps)


def nonfinite_skip_then_train(rank, world):
    """skip mode: a poisoned step is skipped, the next clean step trains normally."""
    sm, opt = _setup(on_nonfinite="skip")
    _step(sm, opt, rank, world, 0)
    before = {u.name: u.master.detach().clone() for u in sm.runtime.units}
    hook = sm.module.model.layers[1].mlp.down_proj.register_forward_hook(lambda m, a, out: out * float("inf"))
    _step(sm, opt, rank, world, 1)
    hook.remove()
    skipped = all(torch.equal(before[u.name], u.master) for u in sm.runtime.units)
    loss = _step(sm, opt, rank, world, 2)
    moved = not all(torch.equal(before[u.name], u.master) for u in sm.runtime.units)
    return dict(skipped=skipped, moved=moved, count=sm.runtime.skipped_steps, loss=loss)


def reads_after_eval_and_load(rank, world, tmp):
    """What a layer's weight and a norm weight read as between forwards: with checkpoint_layers, a
    checkpointed layer's weight after a no-grad forward (an evaluation) was a plain view of its
    slot, showing the layer that used the slot next; a norm weight after load_checkpoint showed the
    weights before the load until the next forward. Returns the reads that were wrong."""
    sm = yashard.shard(build(num_hidden_layers=3), config=yashard.ShardConfig(checkpoint_layers=2))
    opt = torch.optim.AdamW(sm.param_groups(0.1), lr=1e-2)
    ids = batches(1, 2 * world, 8, 96)[0].chunk(world)[rank]
    full = sm.full_state_dict()
    wrong = []

    def check(when):
        for i, layer in enumerate(sm.module.model.layers):
            w = layer.self_attn.q_proj.weight
            if not isinstance(w, yashard.ShardedStub) and not torch.equal(w, full[f"model.layers.{i}.self_attn.q_proj.weight"]):
                wrong.append(f"{when}: layer {i}")

    with torch.no_grad():
        sm(input_ids=ids)
    check("after a no-grad forward")
    sm(input_ids=ids, labels=ids).loss.backward()
    with torch.no_grad():
        sm(input_ids=ids)
    check("after a training step's backward and a no-grad forward")
    yashard.save_checkpoint(tmp, sm, opt)
    opt.step()
    opt.zero_grad()
    yashard.load_checkpoint(tmp, sm, opt)
    norm = sm.module.model.norm.weight
    if not torch.equal(norm, full["model.norm.weight"]):
        wrong.append(f"model.norm.weight after load_checkpoint: {(norm - full['model.norm.weight']).abs().max():.3g} off")
    return wrong


def discarded_batch(rank, world, mode, how):
    """Step 0 clean; batch 1 poisoned on every rank (its loss is inf) and thrown away as training
    loops do, with no optimizer step: ``how`` = "forward" (no backward), "backward" (backward, then
    ``zero_grad()``) or "backward_in_place" (``zero_grad(set_to_none=False)``), or "eval" (a
    grad-enabled forward of another batch, never backwarded, between two clean steps); then batch 2.
    Returns (any error, steps skipped, whether the masters equal bitwise those of a run that never
    saw batch 1)."""
    def run(discard: bool):
        sm, opt = _setup(on_nonfinite=mode)
        _step(sm, opt, rank, world, 0)
        if discard:
            handle = _poison(sm, 2, "forward")
            ids = batches(2, 2 * world, 8, 96)[1].chunk(world)[rank]
            loss = sm(input_ids=ids, labels=ids).loss
            handle.remove()
            assert not torch.isfinite(loss)
            if how != "forward":
                loss.backward()
            opt.zero_grad(set_to_none=how != "backward_in_place")
        error = None
        try:
            _step(sm, opt, rank, world, 2)
        except yashard.NonFiniteError as e:
            error = str(e)
        return error, sm.runtime.skipped_steps, [u.master.detach().clone() for u in sm.runtime.units]

    if how == "eval":  # (the poisoned forward between the backward and the step of a clean batch)
        sm, opt = _setup(on_nonfinite=mode)
        ids = batches(3, 2 * world, 8, 96)
        sm(input_ids=ids[0].chunk(world)[rank], labels=ids[0].chunk(world)[rank]).loss.backward()
        handle = _poison(sm, 2, "forward")
        sm(input_ids=ids[1].chunk(world)[rank], labels=ids[1].chunk(world)[rank])
        handle.remove()
        error = None
        try:
            opt.step()
            opt.zero_grad()
            _step(sm, opt, rank, world, 2)
        except yashard.NonFiniteError as e:
            error = str(e)
        return error, sm.runtime.skipped_steps, None
    error, skipped, masters = run(True)
    _, _, clean = run(False)
    return error, skipped, all(torch.equal(a, b) for a, b in zip(masters, clean))


def guard_run(rank, world, debug, diverge):
    sm, opt = _setup(debug_collectives=debug)
    losses = [_step(sm, opt, rank, world, s) for s in range(3)]
    if diverge:  # same sizes, different layers: collectives pair up, but not the ones meant
        u = sm.runtime.layers[1 + rank]
        out = torch.empty(u.layout.padded)
        sm.runtime.comm.all_gather(out, u.master.detach(), u.name).wait()
        try:
            _step(sm, opt, rank, world, 3)
        except yashard.CollectiveOrderError as e:
            return dict(error=str(e))
    return dict(losses=losses)


def die_or_stall(rank, world, victim_action, layer, timeout):
    """Rank 1 dies (or sleeps) in the forward of ``layer`` at step 2; the others must raise."""
    sm, opt = _setup(collective_timeout=timeout)
    for step in range(2):
        _step(sm, opt, rank, world, step)
    if rank == 1:
        def act(module, args):
            if victim_action == "die":
                os._exit(3)
            time.sleep(120)
        sm.module.model.layers[layer].register_forward_pre_hook(act)
    t0 = time.monotonic()
    try:
        _step(sm, opt, rank, world, 2)
    except yashard.CollectiveError as e:
        return dict(error=str(e), seconds=time.monotonic() - t0)
    return dict(error=None)


def optimizer_before_shard(rank, world):
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sm = yashard.shard(model)
    ids = torch.randint(0, 96, (2, 8))
    sm(input_ids=ids, labels=ids).loss.backward()
    try:
        opt.step()
    except RuntimeError as e:
        return str(e)
    return "no error"


def lm_head_too_early(rank, world):
    sm = yashard.shard(build())
    inner = sm.module.model
    real = inner.layers
    inner.layers = torch.nn.ModuleList(list(real)[:3])  # the last layer is skipped
    ids = torch.randint(0, 96, (2, 8))
    try:
        sm(input_ids=ids, labels=ids)
    except yashard.OrderError as e:
        return str(e)
    return "no error"


def prefetch_after_step(rank, world):
    """The step post-hook gathers the next forward's first units; masters changed in between
    (here: halved by hand) are noticed and regathered."""
    from transformers import AutoModelForCausalLM

    from models import tiny_config

    sm, opt = _setup()
    ids = batches(3, 2 * world, 8, 96)[2].chunk(world)[rank]
    log = sm.collective_log()
    log.enabled = True
    _step(sm, opt, rank, world, 0)
    steps_tail = [(r.op, r.unit) for r in log.records[-4:]]
    with torch.no_grad():
        for u in sm.runtime.units:
            u.master.mul_(0.5)
    loss = sm(input_ids=ids, labels=ids).loss.item()
    full = sm.full_state_dict()
    ref = AutoModelForCausalLM.from_config(tiny_config(num_hidden_layers=4))
    ref.load_state_dict(full, strict=False)
    ref.tie_weights()
    with torch.no_grad():
        ref_loss = ref(input_ids=ids, labels=ids).loss.item()
    return dict(tail=steps_tail, loss=loss, ref=ref_loss)


class _LateWork:
    """An all-gather whose data lands only when it is waited for, as an asynchronous collective's
    may (NCCL): a read that does not wait sees what the buffer held before."""

    def __init__(self, work, tmp: torch.Tensor, out: torch.Tensor):
        self.work, self.tmp, self.out = work, tmp, out

    def wait(self, *args, **kwargs):
        done = self.work.wait(*args, **kwargs)
        self.out.copy_(self.tmp)
        return done


def late_landing_gathers(sm) -> None:
    comm = sm.runtime.comm
    gather = comm.all_gather

    def all_gather(out, shard, unit, group=None):
        tmp = torch.empty_like(out)
        return _LateWork(gather(tmp, shard, unit, group), tmp, out)

    comm.all_gather = all_gather


def reads_between_step_and_forward(rank, world, tied, reshard):
    """After opt.step(), before the next forward, with gathers that land when waited for: the norm
    weight read off its module, the input embedding read (a stub's error, or None), and both after the
    next forward, against the masters."""
    cfg = yashard.ShardConfig(reshard_after_forward=reshard)
    sm = yashard.shard(build(num_hidden_layers=2, tie_word_embeddings=tied), config=cfg)
    late_landing_gathers(sm)
    opt = torch.optim.SGD(sm.parameters(), lr=10.0)
    ids = batches(1, 2 * world, 8, 96)[0].chunk(world)[rank]
    sm(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    norm = sm.module.model.norm.weight.detach().clone()
    embed = sm.module.model.embed_tokens.weight
    try:
        embed.sum()
        embed_error = None
    except RuntimeError as e:
        embed_error = f"{type(embed).__name__}: {e}"
    full = sm.full_state_dict()
    with torch.no_grad():
        sm(input_ids=ids)
    after = {"norm": sm.module.model.norm.weight.detach().clone()}
    if not isinstance(sm.module.model.embed_tokens.weight, yashard.ShardedStub):
        after["embed"] = sm.module.model.embed_tokens.weight.detach().clone()
    return dict(norm=norm, embed_error=embed_error, after=after, full=full)


def uneven_micro_batches(rank, world):
    """Rank 0 runs two micro-batches, rank 1 one: their collectives stop matching. Nobody may hang."""
    sm, opt = _setup(collective_timeout=10)
    _step(sm, opt, rank, world, 0)
    t0 = time.monotonic()
    try:
        for i in range(2 if rank == 0 else 1):
            ids = batches(2, 2 * world, 8, 96)[i].chunk(world)[rank]
            sm(input_ids=ids, labels=ids).loss.backward()
        sm.clip_grad_norm_(1.0)
        opt.step()
        _step(sm, opt, rank, world, 1)
    except (yashard.CollectiveError, yashard.CollectiveOrderError) as e:
        return dict(error=f"{type(e).__name__}: {e}", seconds=time.monotonic() - t0)
    return dict(error=None, seconds=time.monotonic() - t0)


def uneven_layers(rank, world):
    """Rank 1's model runs 3 of its 4 decoder layers (the 4th is skipped): it raises OrderError at
    once, and rank 0, left waiting in a collective, must raise too instead of hanging."""
    from torch import nn

    sm, opt = _setup(collective_timeout=10)
    _step(sm, opt, rank, world, 0)
    if rank == 1:
        model = sm.module.model
        model.layers = nn.ModuleList(list(model.layers)[:3])
    t0 = time.monotonic()
    try:
        _step(sm, opt, rank, world, 1)
    except (yashard.CollectiveError, yashard.OrderError) as e:
        return dict(error=f"{type(e).__name__}: {e}", seconds=time.monotonic() - t0)
    return dict(error=None, seconds=time.monotonic() - t0)


def default_backend_step(rank, world):
    """The process group of init_process_group() without a backend (get_backend() says
    "undefined"): shard, train two steps, report what the runtime picked."""
    import torch.distributed as dist

    sm, opt = _setup()
    losses = [_step(sm, opt, rank, world, s) for s in range(2)]
    return dict(get_backend=str(dist.get_backend()), backend=sm.runtime.comm.backend,
                device=str(sm.runtime.device), losses=losses)


def scaler_steps(rank, world, kind, fused, poison_steps=(0,), steps=2, dtype=torch.float16, cfg=None, autocast=None,
                 unscale=True):
    """fp16 training with loss scaling (``kind``: "sharded" = yashard.ShardedGradScaler, "plain" =
    torch.amp.GradScaler, "plain_off" = a disabled one, None = no scaler, for the fp32 run); at the
    steps in ``poison_steps`` rank 0 alone puts an inf into its shard of the first layer's gradient.
    Per step: did this rank's masters change, the scale after update(), the loss. ``cfg``: more
    ShardConfig fields; ``autocast``: the forward runs under ``torch.autocast("cpu", autocast)``;
    ``unscale=False``: no ``scaler.unscale_`` (and no clipping) before ``scaler.step``."""
    sm = yashard.shard(build(num_hidden_layers=4), config=yashard.ShardConfig(param_dtype=dtype, **(cfg or {})))
    opt = torch.optim.AdamW(sm.param_groups(0.1), lr=1e-3, fused=fused)
    scaler = {"sharded": lambda: yashard.ShardedGradScaler(sm, init_scale=1024.0),
              "plain": lambda: torch.amp.GradScaler("cpu", init_scale=1024.0),
              "plain_off": lambda: torch.amp.GradScaler("cpu", enabled=False),
              None: lambda: None}[kind]()
    out = []
    for step in range(steps):
        ids = batches(step + 1, 2 * world, 8, 96)[step].chunk(world)[rank]
        with torch.autocast("cpu", dtype=autocast) if autocast is not None else contextlib.nullcontext():
            loss = sm(input_ids=ids, labels=ids).loss
        (scaler.scale(loss) if scaler else loss).backward()
        if step in poison_steps and rank == 0:
            sm.runtime.layers[0].master.grad[0] = float("inf")
        before = [u.master.detach().clone() for u in sm.runtime.units]
        if scaler and unscale:
            scaler.unscale_(opt)
        if unscale:
            sm.clip_grad_norm_(1.0)
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
        stepped = any(not torch.equal(b, u.master) for b, u in zip(before, sm.runtime.units))
        out.append((stepped, scaler.get_scale() if scaler else None, loss.item()))
    return out


def backward_raises_then_training_goes_on(rank, world, set_to_none, accum, how="backward_hook"):
    """The "skip the batch that ran out of memory" pattern: after step 0, step 1's last micro-batch's
    backward raises on every rank (in layer 2's backward, after the layers above it reduced; earlier
    micro-batches' gradients are already in .grad), the loop catches it, calls
    ``zero_grad(set_to_none)`` (None: does not) and goes on. Steps 2-3 must then match a run that
    never saw step 1 (losses, final weights); also the error the backward raised. ``how`` raises it: a backward hook on layer 2
    ("backward_hook"), or a comm hook's future that fails, for layer 2 ("future": raised while the next
    layer reduces) or for the norm group ("future_last": raised when the backward ends)."""
    def run(fail):
        sm, opt = _setup()
        boom = {"on": False}

        def raise_once(module, grad_in, grad_out):
            if boom["on"]:
                boom["on"] = False
                raise RuntimeError("simulated out of memory")

        def my_hook(state, bucket):
            if boom["on"] and bucket.name == ("small" if how == "future_last" else "layer_2"):
                boom["on"] = False
                failed = torch.futures.Future()
                failed.set_exception(RuntimeError("simulated out of memory"))
                return failed
            return yashard.comm_hooks.reduce_scatter_hook(state, bucket)

        if how == "backward_hook":
            sm.module.model.layers[2].register_full_backward_hook(raise_once)
        else:
            sm.register_comm_hook(None, my_hook)
        micro = [lambda: None] * accum
        losses = [_step(sm, opt, rank, world, 0, before_micro=micro)]
        if fail:  # step 1: every micro-batch but the last goes through, the last one's backward raises
            parts = batches(2, 2 * world, 8, 96)[1].chunk(world)[rank].chunk(accum)
            for part in parts[:-1]:
                (sm(input_ids=part, labels=part).loss / accum).backward()
            boom["on"] = True
            try:
                sm(input_ids=parts[-1], labels=parts[-1]).loss.backward()
                raise AssertionError("the backward did not raise")
            except RuntimeError as e:
                assert "simulated out of memory" in str(e), e
                errors.append(str(e))
            if set_to_none is not None:
                opt.zero_grad(set_to_none=set_to_none)
        losses += [_step(sm, opt, rank, world, s, before_micro=micro) for s in (2, 3)]
        return losses, sm.full_state_dict()

    errors = []
    (la, wa), (lb, wb) = run(True), run(False)
    return la == lb and all(torch.equal(wa[k], wb[k]) for k in wb), la, lb, errors


def torch_clip_on_masters(rank, world):
    """torch.nn.utils.clip_grad_norm_(model.parameters()) (what Accelerate and HF Trainer call) on two
    twin sharded models against model.clip_grad_norm_; then the refusals."""
    a, _ = _setup()
    b, _ = _setup()
    ids = batches(1, 2 * world, 8, 96)[0].chunk(world)[rank]
    for sm in (a, b):
        sm(input_ids=ids, labels=ids).loss.backward()
    full = a.full_grads()
    want = torch.cat([g.flatten() for g in full.values()]).double().norm()  # (tied names would count twice; none here)
    got_torch = torch.nn.utils.clip_grad_norm_(a.parameters(), 0.5)
    got_model = b.clip_grad_norm_(0.5)
    out = dict(norms=(got_torch.item(), got_model.item(), want.item()),
               same_grads=all(torch.equal(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters())))
    errors = {}
    for name, call in (("some", lambda: torch.nn.utils.clip_grad_norm_(list(a.parameters())[:2], 1.0)),
                       ("mixed", lambda: torch.nn.utils.clip_grad_norm_([*a.parameters(), torch.ones(2, requires_grad=True)], 1.0)),
                       ("total", lambda: torch.nn.utils.get_total_norm([p.grad for p in a.parameters()]))):
        try:
            call()
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)
    plain = torch.ones(3, requires_grad=True)
    plain.grad = torch.full((3,), 2.0)
    out["plain"] = (torch.nn.utils.clip_grad_norm_([plain], 1.0).item(), plain.grad.tolist(),
                    torch.nn.utils.get_total_norm([plain.grad]).item())
    out["errors"] = errors
    clean = [p.grad.clone() for p in b.parameters()]
    out["inf_norm_nan"] = {}
    for nan_on in range(world):  # a NaN on one rank makes the max-norm NaN on every rank, as in torch
        with torch.no_grad():
            for p, g in zip(b.parameters(), clean):
                p.grad.copy_(g)
            if rank == nan_on:
                next(iter(b.parameters())).grad[1] = float("nan")
        norm = b.clip_grad_norm_(1.0, norm_type=float("inf"))
        try:
            b.clip_grad_norm_(1.0, norm_type=float("inf"), error_if_nonfinite=True)
            raised = False
        except RuntimeError:
            raised = True
        out["inf_norm_nan"][nan_on] = (bool(torch.isnan(norm)), raised)
    if rank == 0:
        next(iter(a.parameters())).grad[0] = float("inf")
    kept = [p.grad.clone() for p in a.parameters()]
    try:
        torch.nn.utils.clip_grad_norm_(a.parameters(), 1.0, error_if_nonfinite=True)
        out["nonfinite"] = None
    except RuntimeError as e:
        out["nonfinite"] = (str(e), all(torch.equal(k, p.grad) for k, p in zip(kept, a.parameters())))
    return out


def generate_uneven_lengths(rank, world, subgroup=False):
    """Greedy generate() where rank 0's sequence ends (EOS) after one token and rank 1's runs on: the
    sharded model turns synced_gpus on, so rank 0 keeps joining the gathers. Both ranks' tokens match
    the unsharded model's. ``subgroup``: sharded over ranks 0 and 1 of a world of 3, rank 2 does not
    generate (HF agreed on "finished" over the whole world: rank 1 waited for rank 2 until the timeout)."""
    group = torch.distributed.new_group([0, 1]) if subgroup else None
    if subgroup and rank == 2:
        return None
    sm = yashard.shard(build(num_hidden_layers=2), process_group=group,
                       config=yashard.ShardConfig(collective_timeout=20.0)).eval()
    ref = build(num_hidden_layers=2).eval()
    prompts = [batches(1, 2, 4, 96)[0][r:r + 1] for r in range(2)]
    with torch.no_grad():
        eos = int(ref(input_ids=prompts[0]).logits[0, -1].argmax())  # rank 0's first greedy token
        kw = dict(max_new_tokens=6, do_sample=False, eos_token_id=eos, pad_token_id=0)
        want = ref.generate(prompts[rank], **kw)
        got = sm.generate(prompts[rank], **kw)
        try:  # (transformers' assisted decoding ran rank 0's output past its EOS: refused)
            sm.generate(prompts[rank], prompt_lookup_num_tokens=2, **kw)
            assisted = None
        except NotImplementedError as e:
            assisted = str(e)
    return got.tolist(), want.tolist(), assisted


def ranks_build_different_models(rank, world, what):
    """Rank 1 builds another model ("vocab", "layers"), freezes a parameter the other does not
    ("frozen") or passes another ShardConfig ("config"): every rank's yashard.shard raises (the
    message), before any training collective."""
    kw = {"vocab": {"vocab_size": 104} if rank == 1 else {}, "layers": {"num_hidden_layers": 3 if rank == 1 else 2},
          "config": {}, "frozen": {}}[what]
    cfg = yashard.ShardConfig(param_dtype=torch.bfloat16 if (what == "config" and rank == 1) else torch.float32)
    model = build(**{"num_hidden_layers": 2, **kw})
    if what == "frozen" and rank == 1:
        model.model.layers[1].mlp.up_proj.weight.requires_grad_(False)
    try:
        yashard.shard(model, config=cfg)
    except ValueError as e:
        return str(e)
    return None


def inputs_embeds_from_the_input_embedding(rank, world, tied):
    """LLaVA / prompt-tuning style: inputs_embeds = model.get_input_embeddings()(ids) (scaled, so it is
    not the model's own path), then model(inputs_embeds=..., labels=ids), from the very first step; at
    step 1 the embeddings are computed under torch.no_grad() (a frozen prompt), at step 3 outside the
    model after an evaluation forward (with tied embeddings the head alone then gives the tied weight
    its gradient); a plain forward at step 2; a no-grad call in between. Against the unsharded model
    on the global batch."""
    sm = yashard.shard(build(num_hidden_layers=3, tie_word_embeddings=tied))
    ref = build(num_hidden_layers=3, tie_word_embeddings=tied)
    opt = torch.optim.AdamW(sm.param_groups(0.1), lr=1e-2)
    decay = [p for p in ref.parameters() if p.dim() >= 2]
    ropt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": [p for p in ref.parameters() if p.dim() < 2], "weight_decay": 0.0}], lr=1e-2)

    def loss_of(m, x, step):
        if step == 2:
            return m(input_ids=x, labels=x).loss
        if step == 1:
            with torch.no_grad():
                embeds = m.get_input_embeddings()(x) * 1.5
            return m(inputs_embeds=embeds, labels=x).loss
        if step == 3:
            with torch.no_grad():
                m(input_ids=x)  # an evaluation
            table = (sm.full_state_dict()["model.embed_tokens.weight"] if m is sm
                     else ref.model.embed_tokens.weight.detach())
            return m(inputs_embeds=torch.nn.functional.embedding(x, table), labels=x).loss
        return m(inputs_embeds=m.get_input_embeddings()(x) * 1.5, labels=x).loss

    losses, ref_losses = [], []
    for step in range(5):
        batch = batches(step + 1, 2 * world, 8, 96)[step]
        loss = loss_of(sm, batch.chunk(world)[rank], step)
        loss.backward()
        sm.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            sm.get_input_embeddings()(batch[:1])  # a no-grad call between steps changes nothing
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
        rloss = loss_of(ref, batch, step)
        rloss.backward()
        torch.nn.utils.clip_grad.clip_grad_norm_.__wrapped__(ref.parameters(), 1.0)
        ropt.step()
        ropt.zero_grad()
        ref_losses.append(rloss.item())
    full = sm.full_state_dict()
    worst = max(((full[k] - p).norm() / p.norm()).item() for k, p in ref.named_parameters())
    return losses, ref_losses, worst


def scaler_floor(rank, world, min_scale, steps=6):
    """fp16 whose forward overflows from step 2 on (layer 1's output times 1e9 on every rank): the
    loss is NaN, no scale helps. Per step: the loss, the scale after update(), the masters changed;
    then the error update() raised (None if none)."""
    sm = yashard.shard(build(num_hidden_layers=2), config=yashard.ShardConfig(param_dtype=torch.float16))
    opt = torch.optim.AdamW(sm.param_groups(0.1), lr=1e-3)
    scaler = yashard.ShardedGradScaler(sm, init_scale=4.0, **({} if min_scale == "default" else {"min_scale": min_scale}))
    step_no = [0]
    sm.module.model.layers[1].register_forward_hook(lambda m, a, out: (out * 1e9) if step_no[0] >= 2 else out)
    out = []
    try:
        for step in range(steps):
            step_no[0] = step
            ids = batches(step + 1, 2 * world, 8, 96)[step].chunk(world)[rank]
            loss = sm(input_ids=ids, labels=ids).loss
            scaler.scale(loss).backward()
            before = [u.master.detach().clone() for u in sm.runtime.units]
            scaler.step(opt)
            opt.zero_grad()
            try:
                scaler.update()
            finally:
                stepped = any(not torch.equal(b, u.master) for b, u in zip(before, sm.runtime.units))
                out.append((loss.item(), scaler.get_scale(), stepped))
    except yashard.NonFiniteError as e:
        return out, str(e)
    return out, None


def fp16_nonfinite_without_scaler(rank, world):
    """The error an inf gradient raises in an fp16 run without loss scaling."""
    try:
        scaler_steps(rank, world, None, False, (0,), 1)
    except yashard.NonFiniteError as e:
        return str(e)
    return None


def scaler_lifetime(rank, world):
    """A second scaler dropped leaves the first in charge; a deepcopy is detached; once every
    scaler is gone, on_nonfinite='raise' applies again."""
    import copy
    import gc

    sm = yashard.shard(build(num_hidden_layers=2), config=yashard.ShardConfig(param_dtype=torch.float16))
    opt = torch.optim.AdamW(sm.param_groups(0.1), lr=1e-3, fused=True)
    first = yashard.ShardedGradScaler(sm, init_scale=1024.0)
    second = yashard.ShardedGradScaler(sm)
    del second
    gc.collect()
    out = {}

    def poisoned_step(scaler):
        ids = batches(1, 2 * world, 8, 96)[0].chunk(world)[rank]
        loss = sm(input_ids=ids, labels=ids).loss
        (scaler.scale(loss) if scaler else loss).backward()
        if rank == 0:
            sm.runtime.layers[0].master.grad[0] = float("inf")
        try:
            if scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
        except yashard.NonFiniteError as e:
            return type(e).__name__
        finally:
            opt.zero_grad()
        return "ok"

    out["with_first"] = (poisoned_step(first), first.get_scale())
    dup = copy.deepcopy(first)
    try:
        dup.scale(torch.ones(()))   # a copy's scale is re-created lazily, as GradScaler's
        dup.unscale_(opt)
        out["copy"] = "unscaled"
    except RuntimeError as e:
        out["copy"] = str(e)
    del first, dup
    gc.collect()
    out["without"] = poisoned_step(None)
    return out


def fp16_scaler_misuse(rank, world, fused, dtype=torch.float16, kind="plain", autocast=None, unscale=True, cfg=None):
    """Two steps with torch.amp.GradScaler (``fused``: AdamW(fused=True); ``kind="plain_off"``: a
    disabled one; any ``kind`` of :func:`scaler_steps`) on ``param_dtype=dtype`` (under fp16
    autocast with ``autocast``; ``cfg``: more ShardConfig fields); the error it raised, if any, and
    the yashard warnings logged."""
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("yashard").addHandler(handler)
    try:
        scaler_steps(rank, world, kind, fused, (), 2, dtype, cfg, autocast=autocast, unscale=unscale)
        error = None
    except RuntimeError as e:
        error = str(e)
    finally:
        logging.getLogger("yashard").removeHandler(handler)
    return error, [r.getMessage() for r in records if r.levelno >= logging.WARNING]


def gradients_of_inputs_only(rank, world):
    """torch.autograd.grad(loss, inputs_embeds) and loss.backward(inputs=[inputs_embeds]) through a
    sharded model: the input gradient equals the unsharded model's, and no parameter's .grad
    changes (torch's rule), so a step after them moves nothing; with retain_graph=True, a
    loss.backward() afterwards gives exactly the gradients of a plain backward."""
    import copy

    ref = build(num_hidden_layers=3)
    twin = yashard.shard(copy.deepcopy(ref))
    sm = yashard.shard(copy.deepcopy(ref))
    ids = batches(1, 2 * world, 8, 96)[0].chunk(world)[rank]
    out = {}

    def embeds(model):
        return model.get_input_embeddings()(ids).detach().requires_grad_()

    e = embeds(ref)
    want, = torch.autograd.grad(ref(inputs_embeds=e, labels=ids).loss, e)
    before = sm.full_state_dict()
    opt = torch.optim.AdamW(sm.param_groups(0.1), lr=1e-2)
    for how in ("grad", "inputs"):
        e = embeds(sm)
        loss = sm(inputs_embeds=e, labels=ids).loss
        if how == "grad":
            got, = torch.autograd.grad(loss, e)
        else:
            loss.backward(inputs=[e])
            got = e.grad
        out[how] = ((got - want).abs().max().item(), [p.grad is None for p in sm.parameters()])
    opt.step()
    out["moved"] = [k for k, v in sm.full_state_dict().items() if not torch.equal(v, before[k])]
    e = embeds(sm)
    loss = sm(inputs_embeds=e, labels=ids).loss
    torch.autograd.grad(loss, e, retain_graph=True)
    loss.backward()
    e2 = embeds(twin)
    twin(inputs_embeds=e2, labels=ids).loss.backward()
    a, b = sm.full_grads(), twin.full_grads()
    out["then_backward"] = all(torch.equal(a[k], b[k]) for k in b)
    return out


def penalty_on_the_shards(rank, world):
    """An L2 penalty summed over model.parameters() (this rank's shards: the sum over ranks is the
    full penalty) added to the loss before or after it, with zero_grad(set_to_none=True): the
    gradients equal the unsharded model's (its loss averaged over the ranks' halves plus the
    penalty) in both orders, for two steps."""
    import copy

    lam = 0.05
    ref = build(num_hidden_layers=3)
    data = batches(2, 2 * world, 8, 96)
    worst = {}
    for first in (False, True):
        sm = yashard.shard(copy.deepcopy(ref))
        opt = torch.optim.SGD(sm.parameters(), lr=0.1)
        r = copy.deepcopy(ref)
        ropt = torch.optim.SGD(r.parameters(), lr=0.1)
        errs = []
        for step in range(2):
            ids = data[step].chunk(world)[rank]
            pen = lam * sum(p.pow(2).sum() for p in sm.parameters())
            loss = sm(input_ids=ids, labels=ids).loss
            (pen + loss if first else loss + pen).backward()
            full = sm.full_grads()
            rloss = sum(r(input_ids=h, labels=h).loss for h in data[step].chunk(world)) / world
            (rloss + lam * sum(p.pow(2).sum() for p in r.parameters())).backward()
            errs.append(max(((full[n] - p.grad).abs().max() / p.grad.abs().max()).item()
                            for n, p in r.named_parameters()))
            opt.step()
            opt.zero_grad()
            ropt.step()
            ropt.zero_grad()
        worst[first] = max(errs)
    return worst


def unreached_layers_are_skipped(rank, world, penalty=0.0, discard=False):
    """Step 0 trains everything; step 1's loss reads hidden_states[2] only, so layer 2 and lm_head ran
    forward with grad but no rank's backward reaches them. AdamW with weight decay: torch skips
    their parameters (.grad None), and so must the sharded run; with ``penalty``, step 1 adds
    ``penalty`` x the sum of squares of every parameter (of the shards: summed over ranks, the
    whole model's), which reaches them through autograd alone, so they step. With ``discard``, a
    batch between the two steps is backwarded through the whole model and thrown away
    (``zero_grad()``, no step), as a loop skipping a loss spike does: it leaves no trace. Per
    parameter, the relative difference to the unsharded model (its loss averaged over the ranks'
    halves) after step 1."""
    import copy

    ref = build(num_hidden_layers=3)
    # (loss="hf": the unreached shards are held to 1e-6 of torch's after AdamW's first step, whose
    # update is the sign of each gradient element; the fused loss's last-bit differences flip some)
    sm = yashard.shard(copy.deepcopy(ref), config=yashard.ShardConfig(loss="hf"))
    data = batches(2, 2 * world, 8, 96)

    def loss_of(model, ids, step):
        out = model(input_ids=ids, labels=ids, output_hidden_states=step == 1)
        return out.loss if step == 0 else out.hidden_states[2].pow(2).mean()

    opt = torch.optim.AdamW(sm.param_groups(0.1), lr=1e-2)
    decay = [p for n, p in ref.named_parameters() if p.dim() >= 2]
    ropt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": [p for p in ref.parameters() if p.dim() < 2], "weight_decay": 0.0}], lr=1e-2)
    def reg(model):  # (first in the sum: autograd may run it before the runtime attaches .grad, or after)
        return penalty * sum(p.pow(2).sum() for p in model.parameters()) if penalty else 0.0

    for step in range(2):
        if step == 1 and discard:
            for model, o in ((sm, opt), (ref, ropt)):
                ids = data[1].chunk(world)[rank]
                model(input_ids=ids, labels=ids).loss.backward()
                o.zero_grad()
        (reg(sm) * step + loss_of(sm, data[step].chunk(world)[rank], step)).backward()
        (reg(ref) * step + sum(loss_of(ref, h, step) for h in data[step].chunk(world)) / world).backward()
        opt.step()
        opt.zero_grad()
        ropt.step()
        ropt.zero_grad()
    full = sm.full_state_dict()
    return {n: ((full[n] - p).norm() / p.norm()).item() for n, p in ref.named_parameters()}


def clip_p_norms(rank, world):
    """For p in 1, 3, 0.5, 2, inf: the sharded model's clip (method and torch's wrapped function)
    against torch.nn.utils.clip_grad_norm_ on the full gradients; (relative error of the norm,
    of the clipped gradients) per p."""
    sm = yashard.shard(build(num_hidden_layers=3))
    ids = batches(1, 2 * world, 8, 96)[0].chunk(world)[rank]
    sm(input_ids=ids, labels=ids).loss.backward()
    saved = [p.grad.clone() for p in sm.parameters()]
    full = sm.full_grads()
    out = {}
    for p in (1.0, 3.0, 0.5, 2.0, float("inf")):
        for how in ("method", "torch"):
            with torch.no_grad():
                for q, g in zip(sm.parameters(), saved):
                    q.grad.copy_(g)
            ref = {k: torch.zeros_like(v, requires_grad=True) for k, v in full.items()}
            for k, v in ref.items():
                v.grad = full[k].clone()
            want = torch.nn.utils.clip_grad_norm_(list(ref.values()), 0.01, norm_type=p)
            got = (sm.clip_grad_norm_(0.01, norm_type=p) if how == "method"
                   else torch.nn.utils.clip_grad_norm_(sm.parameters(), 0.01, norm_type=p))
            clipped = sm.full_grads()
            out[(p, how)] = (abs(got.item() - want.item()) / want.item(),
                             max(((clipped[k] - v.grad).abs().max() / v.grad.abs().max().clamp_min(1e-30)).item()
                                 for k, v in ref.items()))
    return out
