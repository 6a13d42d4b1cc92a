"""Checks that run before every optimizer step: stale parameters, non-finite values, parameters
without a gradient, collective order.

One global ``torch.optim`` step pre-hook (installed by the first :func:`yashard.shard`) looks at the
parameters of the optimizer being stepped:

* a parameter that ``yashard.shard`` removed from the model (the optimizer was built before
  ``shard``) raises: stepping it would silently train nothing;
* gradients that a ``no_sync()`` backward accumulated but no backward reduced yet raise;
* for every yashard runtime whose master shards the optimizer holds, :func:`step_checks` runs:
  non-finite gradients or forward outputs (``ShardConfig.on_nonfinite``), trainable parameters that
  no rank gave a gradient (a warning) and, with ``ShardConfig.debug_collectives``, the comparison
  of every rank's collective sequence.

A global step post-hook lets each such runtime start the next forward's first gathers right after
the step (:meth:`Runtime.after_optimizer_step`).

Optimizers that hold no yashard parameter pay one set lookup per parameter.
"""

from __future__ import annotations

import logging
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from .comm_hooks import fp16_compress_hook
from .errors import CollectiveOrderError, NonFiniteError

_handles: list = []
logger = logging.getLogger("yashard")


class _ByIdentity:
    """``{tensor: value}`` keyed by identity, holding only weak references to the tensors
    (``WeakKeyDictionary`` compares keys with ``==``, which tensors answer elementwise)."""

    def __init__(self):
        self._data: dict[int, tuple[weakref.ref, object]] = {}

    def __setitem__(self, key: torch.Tensor, value) -> None:
        k = id(key)
        self._data[k] = (weakref.ref(key, lambda _, k=k: self._data.pop(k, None)), value)

    def get(self, key: torch.Tensor):
        entry = self._data.get(id(key))
        return entry[1] if entry is not None and entry[0]() is key else None

    def values(self) -> list:
        return [value for ref, value in list(self._data.values()) if ref() is not None]


_removed = _ByIdentity()   # parameters yashard.shard took out of a model -> their name
_owners = _ByIdentity()    # master shards -> a weak reference to their Runtime (which owns them)


def track(runtime, removed: dict[torch.nn.Parameter, str]) -> None:
    """Remember ``runtime``'s masters and the parameters it took from the model (name by param)."""
    for p, name in removed.items():
        _removed[p] = name
    for u in runtime.units:
        _owners[u.master] = weakref.ref(runtime)
    if not _handles:
        # (opaque to torch.compile: a compiled opt.step traced them, and the version bump that tells
        # the runtime a fused step wrote the masters was lost, leaving stale param_dtype copies)
        _handles.append(register_optimizer_step_pre_hook(torch.compiler.disable(_before_step)))
        _handles.append(register_optimizer_step_post_hook(torch.compiler.disable(_after_step)))
        _wrap_torch_clip()
        _wrap_plain_grad_scaler()
        _wrap_optimizer_state_dict()
        _wrap_ddp()


_TAG = "yashard_shards"  # the key optimizer state dicts of master shards carry (see below)


def _shard_tag(optimizer) -> list[list] | None:
    """Whose master shards ``optimizer`` holds: ``[unit name, numel, shard rank, shard world]`` per
    shard, in ``param_groups`` order (each shard names its own model's shard group, so an optimizer
    over several models is tagged right). None if it holds no master shard."""
    tag = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            ref = _owners.get(p)
            rt = ref() if ref is not None else None
            if rt is not None:
                unit = next(u for u in rt.units if u.master is p)
                tag.append([unit.name, p.numel(), rt.comm.shard_rank, rt.comm.shard_world])
    return tag or None


def _wrap_optimizer_state_dict() -> None:
    """Tag ``optimizer.state_dict()`` of master shards with whose they are; refuse another rank's or
    another layout's at ``load_state_dict``.

    An optimizer of yashard master shards holds this rank's shard of every state tensor under the
    names every rank uses. Written the usual ways, one rank's state reaches another without a
    shape error: ``torch.save(opt.state_dict())`` on rank 0 loaded on every rank, or
    ``dcp.save({"optim": opt.state_dict()})`` loaded with ``dcp.load`` + ``opt.load_state_dict``
    (DCP keeps one rank's copy of each tensor, any rank's, and one rank's tag: every other shard
    rank then refuses, so the job stops). The ranks would train on other ranks' moments, silently.
    So the dict carries :func:`_shard_tag`, and ``load_state_dict`` refuses (before loading) a dict
    whose tag names another shard rank or world or other shards, when it holds any state for them,
    naming ``yashard.save_checkpoint`` / ``model.sharded_optim_state_dict``. Per-rank files loaded
    by the rank that wrote them at the same world size load as before; so does any state over a
    one-rank shard group (every rank's is the same)."""
    import functools

    from torch.optim import Optimizer

    torch_state_dict, torch_load = Optimizer.state_dict, Optimizer.load_state_dict

    @functools.wraps(torch_state_dict)
    def state_dict(self):
        sd = torch_state_dict(self)
        tag = _shard_tag(self)
        if tag is not None:
            sd[_TAG] = tag
        return sd

    @functools.wraps(torch_load)
    def load_state_dict(self, state_dict):
        saved = state_dict.get(_TAG) if isinstance(state_dict, dict) else None
        if saved is not None:
            state_dict = {k: v for k, v in state_dict.items() if k != _TAG}
            mine = _shard_tag(self)
            if mine is not None and saved != mine and state_dict.get("state"):
                _refuse_other_state(type(self).__name__, saved, mine)
        return torch_load(self, state_dict)

    state_dict.__wrapped__, load_state_dict.__wrapped__ = torch_state_dict, torch_load
    Optimizer.state_dict, Optimizer.load_state_dict = state_dict, load_state_dict


def _refuse_other_state(kind: str, saved: list[list], mine: list[list]) -> None:
    if [(n, k, w) for n, k, _, w in saved] != [(n, k, w) for n, k, _, w in mine]:
        def layout(tag):
            worlds = "/".join(str(w) for w in sorted({w for *_, w in tag}))
            return f"{len(tag)} shards of {sum(k for _, k, _, _ in tag):,} elements over shard world {worlds}"

        what = f"it was saved from {layout(saved)} and this optimizer holds {layout(mine)}"
    else:
        name, r_saved, r_mine = next((n, a, b) for (n, _, a, _), (_, _, b, _) in zip(saved, mine) if a != b)
        what = (f"it holds shard rank {r_saved}'s state and this is shard rank {r_mine} ({name}; "
                "torch.distributed.checkpoint keeps one rank's copy of state saved under the same names on every rank)")
    raise ValueError(
        f"{kind}.load_state_dict: this state dict is another rank's or another layout's optimizer state of yashard "
        f"master shards: {what}. opt.state_dict() holds this rank's shards only; save and load with "
        "yashard.save_checkpoint / yashard.load_checkpoint (any world size), or put model.sharded_optim_state_dict(opt) "
        "into dcp.save / dcp.load and then call model.load_sharded_optim_state_dict(opt, state_dict); per-rank "
        "opt.state_dict() files work only when each rank loads its own at the same world size"
    )


_agreeing_scalers: list[type] = []  # GradScaler classes whose inf check is agreed across ranks


def register_agreeing_scaler(cls: type) -> None:
    """Let ``cls`` (and its subclasses) through the plain-GradScaler refusal: its found-inf flag is
    agreed across the ranks (``ShardedGradScaler`` registers itself where it is defined)."""
    if cls not in _agreeing_scalers:
        _agreeing_scalers.append(cls)


def _wrap_plain_grad_scaler() -> None:
    """Make a plain ``torch.amp.GradScaler`` refuse an optimizer of yashard master shards.

    Its inf check reads this rank's gradient shards only: an overflow that lands in one rank's
    shards makes that rank skip ``optimizer.step()`` while the others step (then wait, up to
    ``collective_timeout``, in a collective it never issues), and the ranks' weights and scales
    part. That is the usual AMP recipe (fp32 parameters, ``torch.autocast(dtype=torch.float16)``,
    ``GradScaler``), so from the first ``yashard.shard`` on, an enabled plain scaler's ``unscale_``
    (which ``step`` calls) on shards of a shard group of several ranks raises on every rank alike,
    at the first step, naming
    :class:`yashard.ShardedGradScaler` (the same API, with the check agreed across ranks). The
    fused-optimizer path, which skips ``unscale_``, is refused by :func:`check_loss_scaling`. Scalers
    of the classes given to :func:`register_agreeing_scaler` (``ShardedGradScaler``) are let through."""
    import functools

    from torch.amp import GradScaler

    torch_unscale = GradScaler.unscale_

    @functools.wraps(torch_unscale)
    def unscale_(self, optimizer):
        owners = [ref() for group in optimizer.param_groups for p in group["params"] if (ref := _owners.get(p))]
        if self.is_enabled() and not isinstance(self, tuple(_agreeing_scalers)) and any(
                rt is not None and rt.comm.shard_world > 1 for rt in owners):  # (one-rank shards: all alike)
            kind = ("torch.amp.GradScaler" if type(self) is GradScaler else
                    f"{type(self).__module__}.{type(self).__qualname__} (a torch.amp.GradScaler)")
            raise RuntimeError(
                f"{kind} on an optimizer of a yashard model: each rank holds "
                "other gradient shards, so its inf check sees one rank's shards and the ranks skip different steps "
                "(their weights and loss scales drift apart, or a rank waits in a collective the others skipped). Use "
                "scaler = yashard.ShardedGradScaler(model): the same API, with the check agreed across ranks"
            )
        return torch_unscale(self, optimizer)

    unscale_.__wrapped__ = torch_unscale
    GradScaler.unscale_ = unscale_


def _wrap_ddp() -> None:
    """Refuse ``DistributedDataParallel`` around any module holding master shards (the sharded
    model, its HF module, or a module of the user's that holds one: a value head, an adapter
    wrapper, which Accelerate and HF Trainer then wrap). DDP broadcasts rank 0's parameters over
    every rank's when it is built: here rank 0's shards over the others' (the model changed by 0.13
    at world 2 without a word), and it would average gradients of different shards."""
    import functools

    from torch.nn.parallel import DistributedDataParallel as DDP

    torch_init = DDP.__init__

    @functools.wraps(torch_init)
    def __init__(self, module, *args, **kwargs):
        if any(_owners.get(p) is not None for p in module.parameters()):
            raise RuntimeError(
                f"DistributedDataParallel around {type(module).__name__}, which holds a yashard-sharded model: its "
                "parameters are flat shards, different on every rank, so DDP would overwrite every rank's shards "
                "with rank 0's when it is built and average gradients of different shards. yashard already reduces "
                "the gradients over the data-parallel group (across nodes too: hybrid sharding, "
                "ShardConfig(shard_group_size=...)). Train the sharded model without DDP: for HF Trainer, TRL and Accelerate, "
                "use yashard.hf.Trainer, yashard.hf.SFTTrainer (or yashard.hf.sharded_trainer(cls)) and "
                "yashard.hf.Accelerator, which shard the model and never wrap it in DDP")
        torch_init(self, module, *args, **kwargs)

    __init__.__wrapped__ = torch_init
    DDP.__init__ = __init__


def _wrap_torch_clip() -> None:
    """Make ``torch.nn.utils.clip_grad_norm_`` right for a sharded model's parameters.

    torch's function sums the squares of the gradients it is given, and on a yashard model those are
    this rank's shards only: each rank would clip by another, local norm (code that calls torch's
    clip for you does this: Accelerate, HF Trainer). Given exactly the master shards of one sharded
    model (those that require gradients at least), the wrapper clips by the global norm
    (:meth:`Runtime.clip_grad_norm_`, a collective: every rank calls it, as with torch's); given
    some of them, or them and other tensors, it raises;
    anything else goes to torch's function unchanged. ``get_total_norm`` of master gradients raises
    (it would be this rank's norm). Code that bound the function before the first ``yashard.shard``
    (``from torch.nn.utils import clip_grad_norm_``) keeps torch's: call ``model.clip_grad_norm_``."""
    import functools

    import torch.nn.utils as nn_utils
    import torch.nn.utils.clip_grad as clip_module

    torch_clip = clip_module.clip_grad_norm_
    torch_total = getattr(nn_utils, "get_total_norm", None)  # (clip_grad's _get_total_norm, exported)

    @functools.wraps(torch_clip)
    def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        owners = [(ref() if (ref := _owners.get(p)) is not None else None) for p in params]
        runtimes = {id(rt): rt for rt in owners if rt is not None}
        if not runtimes:
            return torch_clip(params, max_norm, norm_type, error_if_nonfinite, foreach)
        rt = next(iter(runtimes.values()))
        given = {id(p) for p in params}
        # (shards that do not require gradients, every parameter in them frozen, may be left out:
        # [p for p in model.parameters() if p.requires_grad] has the same norm)
        left_out = [u for u in rt.units if id(u.master) not in given and u.master.requires_grad]
        if len(runtimes) > 1 or None in owners or left_out:
            raise ValueError(
                "torch.nn.utils.clip_grad_norm_ got yashard master shards mixed with other tensors, or only some "
                "of a sharded model's shards: the global norm is defined over one whole model. Clip each sharded "
                "model with model.clip_grad_norm_(max_norm), or pass exactly model.parameters()"
            )
        return rt.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)

    clip_grad_norm_.__wrapped__ = torch_clip
    nn_utils.clip_grad_norm_ = clip_module.clip_grad_norm_ = clip_grad_norm_
    if torch_total is None:
        return

    @functools.wraps(torch_total)
    def get_total_norm(tensors, *args, **kwargs):
        ts = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        runtimes = {id(rt): rt for ref in _owners.values() if (rt := ref()) is not None}
        masters_grads = {id(u.master.grad) for rt in runtimes.values() for u in rt.units if u.master.grad is not None}
        if any(id(t) in masters_grads for t in ts):
            raise ValueError(
                "torch.nn.utils.get_total_norm got gradients of yashard master shards: it would return this rank's "
                "norm of its shards, not the model's. Use model.clip_grad_norm_(max_norm) (it returns the global "
                "norm; max_norm=float('inf') only measures it)"
            )
        return torch_total(ts, *args, **kwargs)

    get_total_norm.__wrapped__ = torch_total
    nn_utils.get_total_norm = get_total_norm


def _runtimes(optimizer, check: bool) -> list:
    """The yashard runtimes whose master shards ``optimizer`` holds (and, with ``check``, refuse
    parameters that yashard.shard removed from a model)."""
    runtimes = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = _removed.get(p) if check else None
            if name is not None:
                raise RuntimeError(
                    f"{type(optimizer).__name__} holds {name}, a parameter yashard.shard removed from the model "
                    "(the optimizer was built before yashard.shard): stepping it trains nothing. Build the "
                    "optimizer after yashard.shard, from model.param_groups(weight_decay) or model.parameters()"
                )
            ref = _owners.get(p)
            rt = ref() if ref is not None else None
            if rt is not None and rt not in runtimes:
                runtimes.append(rt)
    return runtimes


# optimizers whose update of an element depends on the parameter's shape or on all of its elements
# together, by class name (torch's and others: transformers' Adafactor, HF Trainer's optim="adafactor";
# LAMB / LARS trust ratios; Shampoo and SOAP preconditioners); on flat shards of several parameters
# they compute something else. ZeroRedundancyOptimizer would overwrite one rank's shard with another's.
_SHAPE_AWARE_NAMES = {"Adafactor", "LBFGS", "Muon", "Lamb", "LAMB", "FusedLAMB", "Lars", "LARS", "Shampoo",
                      "DistributedShampoo", "SOAP", "ZeroRedundancyOptimizer"}


def check_optimizer_kind(optimizer) -> None:
    """Refuse the optimizers a sharded model's flat master shards would make compute something else."""
    named = next((c.__name__ for c in type(optimizer).__mro__ if c.__name__ in _SHAPE_AWARE_NAMES), None)
    if named is None:
        return
    name = type(optimizer).__name__
    if named == "ZeroRedundancyOptimizer":
        raise TypeError(
            "ZeroRedundancyOptimizer over yashard master shards: it gives each rank's state to one rank and "
            "broadcasts parameters, but every rank holds other shards of the same units, so one rank's shard would "
            "overwrite another's. yashard already shards the optimizer state: use the plain torch.optim optimizer"
        )
    raise TypeError(
        f"{name} over yashard master shards: its update depends on each parameter's shape or on all of its "
        "elements together (factored or matrix statistics, line searches), and a master shard is a flat 1-D piece "
        "of several parameters on each rank, so it would compute something else than on the unsharded model. Use "
        "an element-wise optimizer (AdamW, Adam, SGD, Adagrad, RMSprop, ...)"
    )


def _before_step(optimizer, args, kwargs):
    if getattr(optimizer, "_yashard_stepping_unit", False):  # (step_in_backward: one unit's step, in backward)
        return None
    runtimes = _runtimes(optimizer, check=True)
    if runtimes:
        check_optimizer_kind(optimizer)
    for rt in runtimes:
        check_step_in_backward(rt, optimizer)
        if optimizer is rt.step_optimizer:  # (its backward's steps are done, even if a check below raises)
            rt.state.step_pending = False
    for rt in runtimes:
        rt.check_grads_reduced(f"{type(optimizer).__name__}.step()")
        rt.check_no_new_parameters()
        rt.check_master_storage()
        check_loss_scaling(rt, optimizer)
        if not rt.creating_optimizer_state:  # (sharded_optim_state_dict's zero-gradient step trains nothing:
            step_checks(rt)                  # no gradient to name, and the forward flags stay for the real one)
        rt.before_optimizer_step()
    return None


def check_loss_scaling(rt, optimizer) -> None:
    """fp16 needs a loss scaler whose ranks agree: refuse torch.amp.GradScaler's fused-optimizer path
    (its ``found_inf`` is this rank's alone) and warn, once, about fp16 without ShardedGradScaler."""
    if rt.has_grad_scaler():
        return
    if getattr(optimizer, "found_inf", None) is not None:  # set by torch.amp.GradScaler.step, fused path
        raise RuntimeError(
            f"{type(optimizer).__name__}.step() from a torch.amp.GradScaler on a yashard model: each rank holds other "
            "gradient shards, so its inf check sees one rank's shards and the ranks skip different steps (their "
            "weights and loss scales drift apart, or a rank waits forever in a collective the others skipped). Use "
            "scaler = yashard.ShardedGradScaler(model): the same API, with the check agreed across ranks"
        )
    fp16 = [f"{k}=float16" for k, d in (("param_dtype", rt.config.param_dtype), ("reduce_dtype", rt.config.wire_dtype))
            if d == torch.float16]
    if rt.comm_hook is fp16_compress_hook:
        fp16.append("comm hook fp16_compress_hook")
    if fp16 and not rt.warned_fp16:
        rt.warned_fp16 = True
        if rt.comm.rank == 0:
            way_out = []  # (fp16 weights: loss scaling is the only way)
            if rt.config.param_dtype != torch.float16:
                way_out = ["reduce_dtype=torch.float32"] if rt.config.wire_dtype == torch.float16 else []
                way_out += ["bf16_compress_hook"] if rt.comm_hook is fp16_compress_hook else []
            logger.warning(
                "%s without yashard.ShardedGradScaler: fp16 gradients underflow (and overflow to inf) without "
                "loss scaling, and torch.amp.GradScaler decides per rank (ranks holding other shards skip other "
                "steps: they drift apart or wait in a collective the others skipped). Use scaler = "
                "yashard.ShardedGradScaler(model)%s", " and ".join(fp16), f", or {' with '.join(way_out)}" if way_out else "")


def check_step_in_backward(rt, optimizer) -> None:
    """With ``ShardConfig.step_in_backward`` only the model's ``OptimizerInBackward`` steps between
    backwards: another optimizer over the masters would find no gradient (the step already ran)."""
    if not rt.config.step_in_backward or optimizer is rt.step_optimizer or rt.creating_optimizer_state:
        return
    raise RuntimeError(
        f"{type(optimizer).__name__}.step() over the master shards of a model sharded with "
        "ShardConfig(step_in_backward=True): every unit already stepped in backward, through the optimizer "
        "model.optimizer_in_backward returned, and no gradient is kept, so this step would do nothing (or only weight "
        "decay). Step with the optimizer model.optimizer_in_backward(...) returned (its step() runs the checks)"
        + ("; this one is an older optimizer_in_backward, replaced by a later call"
           if getattr(optimizer, "_yashard_steps_in_backward", False) else "")
    )


def _after_step(optimizer, args, kwargs):
    if getattr(optimizer, "_yashard_stepping_unit", False):
        return
    for rt in _runtimes(optimizer, check=False):
        rt.after_optimizer_step()


@torch.no_grad()
def step_checks(rt) -> None:
    """Run by the optimizer step pre-hook for runtime ``rt``: non-finite values
    (``on_nonfinite``), the collective-order comparison (``debug_collectives``) and the trainable
    parameters no rank gave a gradient since the last step (a warning), with one small all-gather
    over the data-parallel group."""
    cfg, comm = rt.config, rt.comm
    if cfg.on_nonfinite == "ignore" and not cfg.debug_collectives:
        return
    n = len(rt.units)
    log = comm.log
    # A live ShardedGradScaler owns non-finite gradients (it skips such steps on every rank itself).
    # Whether one lives is all-gathered with the flags, so every rank decides alike even if the
    # ranks' garbage collectors drop theirs at different times.
    scaled = rt.has_grad_scaler()
    check = cfg.on_nonfinite != "ignore" and not scaled
    bad_fwd = ~torch.isfinite(rt.fwd_sums)
    bad_grads = ~rt.grads_finite() if check else torch.zeros_like(bad_fwd)
    trainable = _trainable_entries(rt)
    local = torch.cat([bad_fwd.long(), bad_grads.long(),
                       torch.tensor([int(scaled), log.crc, len(log.sequence)], device=rt.device),
                       _pack_bits([u.got_grad[i] for u, i, _ in trainable]).to(rt.device)])
    every = comm.all_gather_tensor(local, "step checks (before the optimizer step)").cpu()
    rt.fwd_sums.zero_()
    if cfg.debug_collectives:
        if not (every[:, 2 * n + 1: 2 * n + 3] == every[0, 2 * n + 1: 2 * n + 3]).all():
            _raise_divergence(rt)
        log.reset_sequence()
    got = _unpack_bits(every[:, 2 * n + 3:], len(trainable)).any(dim=0)
    _drop_unreached(rt, trainable, got)
    _warn_no_gradient(rt, trainable, got)
    if cfg.on_nonfinite == "ignore" or every[:, 2 * n].any() or not every[:, : 2 * n].any():
        return
    message = _nonfinite_message(rt, every[:, :n].bool(), every[:, n: 2 * n].bool())
    if cfg.on_nonfinite == "raise":
        hint = ("; with param_dtype=float16, scale the loss with yashard.ShardedGradScaler (it skips such steps "
                "on every rank and lowers the scale)" if cfg.param_dtype == torch.float16 else "")
        raise NonFiniteError(message + "; ShardConfig(on_nonfinite='skip') skips such steps instead" + hint)
    rt.skipped_steps += 1
    for u in rt.units:  # the optimizer skips parameters without gradients: a true skip
        u.master.grad = None
    if comm.rank == 0:
        logger.warning("%s; skipping this optimizer step (%d skipped so far)", message, rt.skipped_steps)


_BITS = 62  # flags per int64 of the all-gathered vector (the sign bit left alone)


def _pack_bits(flags: list[bool]) -> torch.Tensor:
    """``flags`` as int64 words, ``_BITS`` per word, the first flag in the lowest bit."""
    t = torch.tensor(flags, dtype=torch.int64)
    t = torch.nn.functional.pad(t, (0, -len(flags) % _BITS)).view(-1, _BITS)
    return (t << torch.arange(_BITS)).sum(dim=1)


def _unpack_bits(words: torch.Tensor, count: int) -> torch.Tensor:
    """Inverse of :func:`_pack_bits` for each row of ``words``: a bool tensor of ``count`` columns."""
    bits = (words.unsqueeze(-1) >> torch.arange(_BITS)) & 1
    return bits.flatten(-2)[..., :count].bool()


def _trainable_entries(rt) -> list:
    """``(unit, entry index, HF name)`` of every parameter that trains (fixed at ``shard()``)."""
    if rt.trainable_entries is None:
        rt.trainable_entries = [(u, i, fqns[0]) for u in rt.units if u.trains
                                for i, (ok, fqns) in enumerate(zip(u.trainable, u.fqns)) if ok]
    return rt.trainable_entries


def _drop_unreached(rt, trainable: list, got: torch.Tensor) -> None:
    """A shard whose ``.grad`` a backward attached (it was None) while no rank's backward gave any of
    its parameters a gradient goes back to ``.grad = None``, so the optimizer skips it as torch skips
    parameters no gradient reached. (Its unit ran a grad-enabled forward whose outputs reached no
    loss: the reduction every rank issues for it, so that their collectives match, summed zeros.)"""
    if bool(got.all()):
        return
    reached: dict[int, bool] = {}
    for (u, _, _), ok in zip(trainable, got.tolist()):
        reached[id(u)] = reached.get(id(u), False) or ok
    for u in rt.units:
        if u.attached_from_none and not reached.get(id(u), True) and not u.unreduced and u.master.grad is not None:
            u.master.grad = None


def _warn_no_gradient(rt, trainable: list, got: torch.Tensor) -> None:
    """Log (rank 0, once per parameter) the trainable parameters that no rank's backward gave a
    gradient since the last step while their shard's ``.grad`` is set: the optimizer steps their
    range of the flat shard with a zero gradient, where torch would skip a parameter without one."""
    if bool(got.all()):
        return
    missing = [name for (u, _, name), ok in zip(trainable, got.tolist())
               if not ok and u.master.grad is not None and name not in rt.warned_no_grad]
    if not missing:
        return
    rt.warned_no_grad.update(missing)
    if rt.comm.rank == 0:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        logger.warning(
            "yashard: %d trainable parameter%s got no gradient on any rank since the last optimizer step: %s. "
            "They live in flat shards with parameters that did, so the optimizer steps them with a zero gradient: "
            "weight decay and the momentum of earlier steps move them, where plain PyTorch (and FSDP2) would skip "
            "a parameter whose .grad is None (FSDP1 and DeepSpeed ZeRO-3 step them as yashard does). Freeze them "
            "before yashard.shard if they should not train, or find why the loss does not reach them (logged once "
            "per parameter)", len(missing), "s" if len(missing) > 1 else "", shown)


def _nonfinite_message(rt, fwd: torch.Tensor, grad: torch.Tensor) -> str:
    """Name the first unit (forward order) whose output, else the first (backward order) whose
    gradients, held a NaN/inf, and the ranks that saw it."""
    def ranks(col):
        r = [i for i, bad in enumerate(col.tolist()) if bad]
        return "every rank" if len(r) == rt.comm.world else "rank" + ("s " if len(r) > 1 else " ") + ", ".join(map(str, r))

    parts = []
    bad_fwd = [u for u in rt.forward_order if fwd[:, u.order].any()]
    if bad_fwd:
        u = bad_fwd[0]
        parts.append(f"the forward output of {rt.module_name(u)} was the first non-finite one (on "
                     f"{ranks(fwd[:, u.order])})")
    backward = ([rt.lm_head] if rt.lm_head else []) + rt.layers[::-1] + ([rt.embed] if rt.embed else [])
    backward += rt.resident  # (the adapter group, then the norm group)
    bad_grad = [u for u in backward if grad[:, u.order].any()]
    if bad_grad:
        names = ", ".join(rt.module_name(u) for u in bad_grad[:4]) + (", ..." if len(bad_grad) > 4 else "")
        parts.append(f"non-finite gradients in {names} (first in backward order: {rt.module_name(bad_grad[0])}, "
                     f"on {ranks(grad[:, bad_grad[0].order])}; a NaN/inf, or values whose squared norm overflows)")
    return "yashard: NaN/inf before optimizer step: " + "; ".join(parts)


def _raise_divergence(rt) -> None:
    """Find the first collective where a rank's sequence differs from rank 0's, and raise."""
    seqs = rt.comm.all_gather_object(list(rt.comm.log.sequence), "collective order check")
    ref = seqs[0]
    for r, seq in enumerate(seqs[1:], 1):
        k = next((i for i, (a, b) in enumerate(zip(ref, seq)) if a != b), min(len(ref), len(seq)))
        if k < max(len(ref), len(seq)):
            def show(x, i):
                return (f"{x[i][0]} of {x[i][1]} ({x[i][2]} elements, {x[i][3]} bytes, {x[i][4]} group)"
                        if i < len(x) else "nothing")
            raise CollectiveOrderError(
                f"ranks issued different collectives since the last optimizer step: collective #{k + 1} was "
                f"{show(ref, k)} on rank 0 but {show(seq, k)} on rank {r} (rank 0 issued {len(ref)}, rank {r} "
                f"issued {len(seq)}); every rank must run the same forward/backward passes over the same layers"
            )
    raise CollectiveOrderError("ranks' collective sequences hash differently but compare equal (hash collision?)")
