"""The :class:`ShardedModel` ``shard()`` returns, and what a sharded HF module answers.

A ``ShardedModel`` wraps the HF model: it is called like it, its ``parameters()`` are the master
shards, and its methods reach the runtime (clipping, the memory plan, full and sharded state
dicts, ``no_sync``, comm hooks). The HF module inside is given a same-named subclass whose
``device``, ``dtype`` and parameter counts answer for the sharded parameters and which refuses what
would be silently wrong on them (``state_dict()``, conversions, copies, HF checkpointing).
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch import nn

from .call_gate import enter
from .config import dtype_name
from .integrity import check_no_sync
from .memory import MemoryPlan
from .runtime import Runtime
from .unit import same_named_subclass


def runtime_of(model, what: str) -> Runtime:
    """The runtime of the :class:`ShardedModel` ``model``; ``what`` (the caller) names it in the error."""
    if not isinstance(model, ShardedModel):
        raise TypeError(f"{what} expects the ShardedModel returned by yashard.shard, got {type(model).__name__}")
    return model.runtime


_FULL_TENSORS = ("gather full HF-named tensors with model.full_state_dict() (a collective: every rank calls it), "
                 "or write an HF folder with yashard.export_hf(model, path)")


def _refuse_state_dict(module, prefix, keep_vars):
    raise RuntimeError(
        "state_dict() of a yashard-sharded model: its parameters are flat per-rank shards that every rank "
        "would report under the same names, so torch.save or torch.distributed.checkpoint would silently keep "
        "one rank's piece (and the HF module itself holds no parameters). Save with yashard.save_checkpoint(path, "
        "model, optimizer) and restore with yashard.load_checkpoint (crash-safe; loads at any world size), use "
        "model.sharded_state_dict() with torch.distributed.checkpoint (dcp.save / dcp.load), "
        + _FULL_TENSORS + "; a PEFT adapter: yashard.save_adapter(model, path)"
    )


def _refuse_load_state_dict(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                            error_msgs):
    raise RuntimeError(
        "load_state_dict() into a yashard-sharded model: its parameters are flat per-rank shards. Restore a "
        "yashard.save_checkpoint checkpoint with yashard.load_checkpoint (crash-safe; loads at any world size), "
        "a torch.distributed.checkpoint one with dcp.load(model.sharded_state_dict(), checkpoint_id=path), "
        + _FULL_TENSORS + "; to start from full HF weights, shard with yashard.shard(model, weights=folder) or "
        "yashard.from_pretrained"
    )


_SHARDED_CLASSES: dict[type, type] = {}
_SHARDED_INNER_CLASSES: dict[type, type] = {}


def _check_conversion(fn, device: torch.device, dtypes: tuple[torch.dtype, ...]) -> None:
    """Refuse a ``.to()`` / ``.half()`` / ``.cuda()`` ... (``nn.Module._apply(fn)``) that would change
    the dtype or device of fp32 tensors, or of tensors of the other ``dtypes`` the module's
    ``_apply`` reaches: the masters (a ``ShardedModel``'s: fp32, and ``param_dtype`` when frozen
    units keep theirs in it) and every buffer the runtime allocated stay as sharded. Tried on an
    empty tensor of each dtype first, so nothing is touched when it is refused (``.float()``
    changes nothing fp32 but would widen a 16-bit frozen shard)."""
    for dtype in dtypes:
        probe = torch.empty(0, dtype=dtype, device=device)
        out = fn(probe)
        if isinstance(out, torch.Tensor) and (out.dtype != probe.dtype or out.device != probe.device):
            held = " and ".join(("fp32 master shards" if d == torch.float32 else f"{dtype_name(d)} frozen shards")
                                for d in dtypes)
            raise ValueError(
                f"converting a yashard-sharded model to {out.dtype if out.dtype != probe.dtype else out.device} "
                f"would break its {held} and its buffers on {device}, which are fixed at shard time. Choose the "
                "compute dtype with ShardConfig(param_dtype=torch.bfloat16) and the device with "
                "ShardConfig(device=...) (or the model's device before yashard.shard) instead"
            )


def master_dtypes(runtime: Runtime) -> tuple[torch.dtype, ...]:
    """The dtypes of ``runtime``'s master shards, fp32 first (what :func:`_check_conversion` probes)."""
    return tuple(sorted({u.master.dtype for u in runtime.units} | {torch.float32},
                        key=lambda d: d != torch.float32))


def _refuse_copy(self, *args):
    raise TypeError(
        f"a yashard-sharded model ({type(self).__name__}) cannot be pickled or copied (torch.save(model), "
        "copy.deepcopy, AveragedModel): its weights live in per-rank shards and buffers shared between layers. Save "
        "with yashard.save_checkpoint, model.full_state_dict() or yashard.export_hf; for an EMA, keep copies of the "
        "master shards ([p.detach().clone() for p in model.parameters()]) or shard a second model"
    )


def _refuse_dsd(self):
    """``_fqn_modifiers`` is what torch.distributed.checkpoint.state_dict (``get_state_dict``,
    ``get_optimizer_state_dict``, ``set_*``) asks every module for; on a sharded model it raises."""
    raise TypeError(
        "torch.distributed.checkpoint.state_dict (get_/set_model_state_dict, get_/set_optimizer_state_dict, "
        "get_/set_state_dict) on a yashard-sharded model: its parameters and optimizer state are flat per-rank "
        "shards under names every rank shares, which DCP would store once. Use model.sharded_state_dict() and "
        "model.sharded_optim_state_dict(optimizer) (FSDP2's layout) with dcp.save / dcp.load, then "
        "model.load_sharded_optim_state_dict(optimizer, state_dict)"
    )


def _shard_names(units) -> list[tuple[str, nn.Parameter]]:
    """``("shards.<unit>", master)`` per unit; the norm group (every 1-D parameter) is
    ``shards.norms_and_biases``, so name-based no-decay rules (HF Trainer's "bias" / "norm"
    patterns) group the shards as ``param_groups()`` does (the adapter group, ``shards.adapters``,
    decays)."""
    return [(f"shards.{'norms_and_biases' if u.name == 'small' else u.name}", u.master) for u in units]


def _live_runtime(module: nn.Module) -> Runtime:
    """The runtime that sharded ``module`` (held weakly by the module)."""
    rt = module.__dict__["_yashard_runtime"]()
    if rt is None:
        raise RuntimeError("the yashard runtime of this module is gone (its ShardedModel was dropped)")
    return rt


def _answer_device_and_dtype(module: nn.Module, runtime: Runtime) -> None:
    """HF reads a model's ``device`` and ``dtype`` from its first parameter (``generate()``,
    ``save_pretrained``), and counts parameters over the module's own (``num_parameters``,
    ``get_memory_footprint``), and a sharded HF module has none left: give the module a subclass of
    its class (same name, cached per class) whose ``device`` is the runtime's device, whose
    ``dtype`` is the compute dtype (``param_dtype``), and whose counts include the sharded
    parameters: ``num_parameters`` the model's (unpadded, tied ones once, as the unsharded model
    counts them), ``get_memory_footprint`` this rank's bytes of them (its master shards).
    The subclass also turns ``generate``'s ``synced_gpus`` on when the shard group is the whole world
    of several ranks (as HF does for FSDP and ZeRO-3: a rank that finished keeps joining the gathers),
    sends ``requires_grad_`` to the shards, makes ``tie_weights`` a no-op (ties are resolved at
    ``shard()``), refuses pickling, deep copies, torch's distributed state-dict helpers,
    ``resize_token_embeddings`` and HF's activation checkpointing (``checkpoint_layers``)."""
    cls = type(module)
    if not isinstance(getattr(cls, "device", None), property):
        return  # not an HF model: nothing reads these

    def _apply(self, fn, recurse=True):
        _check_conversion(fn, self.__dict__["_yashard_device"], (torch.float32,))
        return cls._apply(self, fn, recurse)

    def _units(self):
        return _live_runtime(self).units

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        # as FSDP2's fully_shard leaves them: the module's parameters are this rank's shards (the
        # ShardedModel's, under its names), so model.zero_grad(), torch's clip_grad_norm_ (wrapped:
        # guards.py) and optimizers given this module's parameters act on what trains
        yield from nn.Module.named_parameters(self, prefix, recurse, remove_duplicate)  # (none are left)
        for name, master in _shard_names(_units(self)):
            yield (f"{prefix}.{name}" if prefix else name), master

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        return _count_parameters(self, _units(self), "", only_trainable, exclude_embeddings)

    def get_memory_footprint(self, return_buffers=True):
        # this rank's master shards, what the module still holds, and (as HF) its buffers
        tensors = [p for _, p in self.named_parameters()] + (list(self.buffers()) if return_buffers else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    def generate(self, *args, **kwargs):
        # every forward gathers over the shard group: a rank that finished early must keep stepping
        # (HF turns synced_gpus on by itself for FSDP and ZeRO-3 models, not for this one) until
        # every rank of its shard group has finished (agreed over that group, not HF's whole world:
        # _has_unfinished_sequences), so it works under hybrid sharding and over a subgroup
        rt = self.__dict__["_yashard_runtime"]()
        if kwargs.get("synced_gpus") is None:
            kwargs["synced_gpus"] = rt is not None and rt.comm.shard_world > 1
        assisted = [k for k in ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit")
                    if kwargs.get(k) is not None]
        if assisted and kwargs["synced_gpus"] and rt is not None and rt.comm.shard_world > 1:
            raise NotImplementedError(
                f"generate({assisted[0]}=...) on a model sharded over {rt.comm.shard_world} ranks: every rank must "
                "keep stepping until all have finished (synced_gpus), and transformers' assisted decoding goes on "
                "appending tokens to a rank whose sequence has finished, so its output would run past EOS. Generate "
                "without assisted decoding (or from a model of one rank, e.g. yashard.export_hf then from_pretrained)")
        return cls.generate(self, *args, **kwargs)

    def _has_unfinished_sequences(self, this_peer_finished: bool, synced_gpus: bool, device, *args, **kwargs):
        # synced_gpus: the ranks that must step together are those the forwards gather over, the
        # shard group (HF all-reduces over the default group: a rank outside it that does not
        # generate, a subgroup's or another replica's, left this one waiting until the timeout)
        rt = self.__dict__["_yashard_runtime"]()
        if not synced_gpus or rt is None:
            return cls._has_unfinished_sequences(self, this_peer_finished, synced_gpus, device, *args, **kwargs)
        unfinished = torch.tensor(0.0 if this_peer_finished else 1.0, device=device)
        rt.comm.all_reduce(unfinished, "generate (unfinished sequences)")
        return unfinished.item() != 0.0

    def requires_grad_(self, requires_grad: bool = True):
        # the whole model's parameters are the master shards: turn them all off, or back on (the
        # parameters frozen when yashard.shard ran stay frozen: shards of only those stay off).
        # (torch's own walks named_parameters(), the shards: it sets them all, so it runs first)
        cls.requires_grad_(self, requires_grad)
        _live_runtime(self).set_requires_grad(requires_grad)
        return self

    members = {
        "_apply": _apply,
        "named_parameters": named_parameters,
        "_fqn_modifiers": _refuse_dsd,
        "requires_grad_": requires_grad_,
        "__reduce_ex__": _refuse_copy,
        "__deepcopy__": lambda self, memo: _refuse_copy(self),
        "device": property(lambda self: self.__dict__["_yashard_device"], doc="The sharded model's device."),
        "dtype": property(lambda self: self.__dict__["_yashard_dtype"], doc="The compute dtype (param_dtype)."),
    }
    if hasattr(cls, "_has_unfinished_sequences"):
        members["_has_unfinished_sequences"] = _has_unfinished_sequences
    if hasattr(cls, "num_parameters"):
        members["num_parameters"] = num_parameters
    if hasattr(cls, "get_memory_footprint"):
        members["get_memory_footprint"] = get_memory_footprint
    if hasattr(cls, "generate"):
        members["generate"] = generate

    def refuse_hf_checkpointing(self, *args, **kwargs):
        raise ValueError(
            "HF activation checkpointing on a yashard-sharded model would re-run yashard's layer hooks during "
            "backward; shard with ShardConfig(checkpoint_layers=N) instead (N decoder layers recompute their forward)"
        )

    def tie_weights(self, *args, **kwargs):
        """Nothing to do: tied parameters became one master shard at ``shard()`` (PEFT and Accelerate
        call this on the models they wrap)."""
        return None

    def resize_token_embeddings(self, *args, **kwargs):
        raise ValueError(
            "resize_token_embeddings on a yashard-sharded model: the embedding and lm_head live in fixed sharded "
            "buffers laid out at shard(); resize the HF model before yashard.shard (tied embeddings stay tied)"
        )

    hf_methods = {"tie_weights": tie_weights, "resize_token_embeddings": resize_token_embeddings,
                  "gradient_checkpointing_enable": refuse_hf_checkpointing,
                  "activation_checkpointing_enable": refuse_hf_checkpointing}
    members.update({name: fn for name, fn in hf_methods.items() if hasattr(cls, name)})
    module.__class__ = same_named_subclass(cls, _SHARDED_CLASSES, members)
    module.__dict__["_yashard_device"] = runtime.device
    module.__dict__["_yashard_dtype"] = runtime.config.param_dtype
    module.__dict__["_yashard_runtime"] = weakref.ref(runtime)
    for prefix, sub in module.named_modules():
        if sub is not module and isinstance(getattr(type(sub), "device", None), property):
            _answer_inner(sub, prefix, runtime, {**hf_methods, **members})


def _answer_inner(module: nn.Module, prefix: str, runtime: Runtime, outer: dict) -> None:
    """The same for an HF model inside the sharded one (the causal LM's base model, ``model.model``,
    which ``get_decoder()`` returns), which holds no parameters either: ``device``, ``dtype``,
    ``num_parameters`` over the sharded parameters under ``prefix``, and ``outer``'s refusals
    (conversions, HF checkpointing, resizing, copies) and no-op ``tie_weights``."""
    cls = type(module)

    def _apply(self, fn, recurse=True):
        _check_conversion(fn, self.__dict__["_yashard_device"], (torch.float32,))
        return cls._apply(self, fn, recurse)

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        return _count_parameters(self, _live_runtime(self).units, self.__dict__["_yashard_prefix"], only_trainable,
                                 exclude_embeddings)

    members = {"_apply": _apply, "device": outer["device"], "dtype": outer["dtype"],
               "__reduce_ex__": _refuse_copy, "__deepcopy__": outer["__deepcopy__"]}
    for name in ("num_parameters", "gradient_checkpointing_enable", "activation_checkpointing_enable",
                 "resize_token_embeddings", "tie_weights"):
        if hasattr(cls, name):
            members[name] = num_parameters if name == "num_parameters" else outer[name]
    module.__class__ = same_named_subclass(cls, _SHARDED_INNER_CLASSES, members)
    module.__dict__["_yashard_device"] = runtime.device
    module.__dict__["_yashard_dtype"] = runtime.config.param_dtype
    module.__dict__["_yashard_runtime"] = weakref.ref(runtime)
    module.__dict__["_yashard_prefix"] = prefix + "."


def _active_adapters(peft_model: nn.Module) -> list[str] | None:
    active = getattr(peft_model, "active_adapters", None)
    if active is None or not hasattr(peft_model, "peft_config"):
        return None
    return [active] if isinstance(active, str) else list(active)


def _check_active_adapters(peft_model: nn.Module, trained: list[str]) -> None:
    """A forward with gradients on must run the adapters that train, fixed at ``shard()``; one of
    another adapter (``set_adapter`` after ``shard()``) would fail in its backward, in torch's
    words ("does not require grad"). Under ``torch.no_grad()`` any adapter runs (TRL's reference
    forwards with a "ref" adapter: ``trl.trainer.utils.use_adapter``)."""
    active = _active_adapters(peft_model)
    if not active or active == trained:
        return
    raise RuntimeError(
        f"a forward of adapter {active[0]!r} with gradients on, after set_adapter({active[0]!r}) following "
        f"yashard.shard: the adapter that trains is {trained[0]!r}, fixed at shard() (its gradient buffers and "
        f"optimizer state), so the backward of {active[0]!r} would fail. To train {active[0]!r}, call "
        f"set_adapter({active[0]!r}) on the PeftModel before yashard.shard; to run it without training "
        "(a reference forward), run it under torch.no_grad(), or set_adapter back first")


_SHARDED_PEFT_CLASSES: dict[type, type] = {}


def _answer_peft(module: nn.Module, runtime: Runtime) -> None:
    """A PEFT model around the sharded HF model (``shard(peft_model)``) holds no parameter either:
    give it a same-named subclass whose ``get_nb_trainable_parameters`` (``print_trainable_parameters``)
    counts the unsharded parameters, as the HF model's ``num_parameters`` does."""
    cls = type(module)
    if module is runtime.model or not hasattr(cls, "get_nb_trainable_parameters"):
        return

    def get_nb_trainable_parameters(self) -> tuple[int, int]:
        hf = self.get_base_model()
        return hf.num_parameters(only_trainable=True), hf.num_parameters()

    module.__class__ = same_named_subclass(cls, _SHARDED_PEFT_CLASSES,
                                           {"get_nb_trainable_parameters": get_nb_trainable_parameters})


def _count_parameters(module: nn.Module, units, prefix: str, only_trainable: bool, exclude_embeddings: bool) -> int:
    """HF's ``num_parameters`` of ``module`` (named ``prefix`` in the sharded model; "" for the model
    itself): the parameters it still holds plus the sharded ones under ``prefix``, unpadded and tied
    ones once, as the unsharded module counts them."""
    skip = ({f"{prefix}{name}.weight" for name, m in module.named_modules() if isinstance(m, nn.Embedding)}
            if exclude_embeddings else set())
    own = sum(p.numel() for name, p in nn.Module.named_parameters(module)
              if prefix + name not in skip and (p.requires_grad or not only_trainable))
    sharded = sum(entry.numel for u in units
                  for entry, fqns, ok in zip(u.layout.entries, u.fqns, u.trainable)
                  if any(f.startswith(prefix) for f in fqns) and not skip.intersection(fqns)
                  and ((ok and u.master.requires_grad) or not only_trainable))
    return own + sharded


class ShardedModel(nn.Module):
    """A HuggingFace causal LM whose parameters are sharded across the process group.

    Call it exactly like the HF model; it returns the HF output object. ``parameters()`` yields
    only the master shards (one flat shard per unit: the embedding, each decoder layer, the
    lm_head, and the group of all 1-D parameters), which any ``torch.optim`` optimizer can train.
    They are fp32, except those of units whose parameters are all frozen under a 16-bit
    ``param_dtype``: those are kept in ``param_dtype`` and never require gradients.
    Gradients follow standard PyTorch semantics: they accumulate across ``backward()`` calls in
    fp32 until the optimizer's ``zero_grad`` (``set_to_none=True`` included).
    """

    __reduce_ex__ = _refuse_copy
    _fqn_modifiers = _refuse_dsd

    def __deepcopy__(self, memo):
        _refuse_copy(self)

    def __init__(self, module: nn.Module, runtime: Runtime):
        super().__init__()
        self.module = module
        # named "shards.<unit>"; the norm group (every 1-D parameter) as "shards.norms_and_biases", so
        # name-based no-decay rules (HF Trainer's "bias" / "norm" patterns) group the shards as
        # param_groups() does
        self.shards = nn.ParameterDict({name.removeprefix("shards."): master for name, master in _shard_names(runtime.units)})
        object.__setattr__(self, "_runtime", runtime)
        # a PEFT model's active adapters at shard(): the ones whose weights train (None: not PEFT)
        trained = _active_adapters(module) if module is not runtime.model else None
        object.__setattr__(self, "_trained_adapters", trained)
        _answer_device_and_dtype(runtime.model, runtime)  # (the HF model: a PEFT model's base model)
        _answer_peft(module, runtime)
        # module too (HF's save_pretrained reads its state_dict), and every submodule that lost a
        # parameter to a shard or holds one that did (model.model, a layer, lm_head): theirs would
        # silently leave those parameters out
        marked = [name for name, m in module.named_modules() if "_yashard_sharded" in m.__dict__]
        holders = {".".join(name.split(".")[:i]) for name in marked for i in range(1, name.count(".") + 2)}
        for m in (self, module, *(m for name, m in module.named_modules() if name in holders)):
            m.register_state_dict_pre_hook(_refuse_state_dict)
            m.register_load_state_dict_pre_hook(_refuse_load_state_dict)

    def forward(self, *args, **kwargs):
        if self._trained_adapters is not None and torch.is_grad_enabled():
            _check_active_adapters(self.module, self._trained_adapters)
        return self.module(*args, **kwargs)

    def requires_grad_(self, requires_grad: bool = True):
        """Turn gradients of every master shard off, or back on. Which parameters train is fixed at
        ``shard()``: a shard whose parameters were all frozen then stays off, and frozen parameters
        inside a trained shard stay frozen."""
        self._runtime.set_requires_grad(requires_grad)
        return self

    def _apply(self, fn, recurse=True):
        _check_conversion(fn, self._runtime.device, master_dtypes(self._runtime))
        return super()._apply(fn, recurse)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["module"], name)

    @property
    def runtime(self) -> Runtime:
        return self._runtime

    def param_groups(self, weight_decay: float) -> list[dict]:
        """Optimizer param groups: decay for matrices, no decay for norm weights and biases.

        The no-decay group is exactly the norm group (every 1-D parameter of the model). Master
        shards that do not require gradients (every parameter in them frozen) are left out, as
        ``[p for p in model.parameters() if p.requires_grad]`` would.
        """
        rt = self._runtime
        decay = [u.master for u in rt.units if u is not rt.small and u.master.requires_grad]
        small = [rt.small.master] if rt.small is not None and rt.small.master.requires_grad else []
        groups = [{"params": ps, "weight_decay": wd} for ps, wd in ((decay, float(weight_decay)), (small, 0.0)) if ps]
        if not groups:
            raise ValueError("param_groups(): every parameter of the model is frozen (requires_grad=False), so there "
                             "is nothing to train; leave some unfrozen before yashard.shard")
        return groups

    def optimizer_in_backward(self, optimizer_class, params=None, **kwargs):
        """The optimizer of ``ShardConfig(step_in_backward=True)``: each unit steps in backward, as
        soon as its reduced gradient shard is ready.

        ``optimizer_class``: a ``torch.optim.Optimizer`` class, built as
        ``optimizer_class(params, **kwargs)`` (``params``: ``model.param_groups(weight_decay)`` or
        the trained masters by default), or an optimizer already built over this model's masters.
        Returns an :class:`~yashard.step_in_backward.OptimizerInBackward`: LR schedulers, ``state_dict``,
        ``yashard.save_checkpoint`` / ``load_checkpoint`` and :meth:`sharded_optim_state_dict` take it.
        Call its ``step()`` once after every backward: it runs the step checks and changes nothing
        else; ``zero_grad()`` does nothing. A later call replaces the optimizer."""
        from . import step_in_backward  # (the mode's module: imported when first used)

        rt = self._runtime
        if not rt.config.step_in_backward:
            raise RuntimeError(
                "optimizer_in_backward on a model sharded without ShardConfig(step_in_backward=True): its backward "
                "keeps the gradient shards for an ordinary optimizer step. Shard with "
                "ShardConfig(step_in_backward=True), or build a plain optimizer: torch.optim.AdamW(model.param_groups(wd))"
            )
        opt = step_in_backward.build(rt.units, rt.device, optimizer_class, params, kwargs)
        rt.set_step_optimizer(opt)
        return opt

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip the gradients of all shards by their global norm; returns the norm before clipping.
        ``error_if_nonfinite``: raise before clipping if that norm is NaN or inf (as torch's)."""
        return self._runtime.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)

    def memory_plan(self) -> MemoryPlan:
        """Bytes this rank holds, per buffer, with the formula (fixed from ``shard()`` on)."""
        return self._runtime.memory_plan()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full fp32 weights by HF name (tied names share one tensor). Collective: call on every rank."""
        enter(self._runtime.comm, "full_state_dict")
        return self._runtime.gather_full("params")

    def sharded_state_dict(self) -> dict:
        """HF parameter name -> a full-shape view of this rank's part of it, for
        ``torch.distributed.checkpoint``: ``dcp.save(model.sharded_state_dict(), checkpoint_id=path)``
        writes each rank's part; ``dcp.load(model.sharded_state_dict(), checkpoint_id=path)`` fills the
        masters in place, from a checkpoint of any world size, of FSDP2 or of an unsharded model
        (:mod:`yashard.dcp`). Optimizer state: :meth:`sharded_optim_state_dict`."""
        from .dcp import sharded_state_dict  # (torch.distributed.checkpoint: imported when first used)

        return sharded_state_dict(self._runtime)

    def sharded_optim_state_dict(self, optimizer) -> dict:
        """``optimizer``'s state for ``torch.distributed.checkpoint``, by HF parameter name, in the
        layout FSDP2's optimizers have there (``{"state": {name: {...}}, "param_groups": [...]}``):
        state tensors are full-shape views of this rank's part, loaded in place. Creates the state if
        the optimizer has none yet (one step at learning rate 0 with zero gradients, as FSDP does):
        call it on every rank. After ``dcp.load``, apply the saved hyperparameters with
        :meth:`load_sharded_optim_state_dict`."""
        from .dcp import sharded_optim_state_dict  # (torch.distributed.checkpoint: imported when first used)

        return sharded_optim_state_dict(self._runtime, optimizer)

    def load_sharded_optim_state_dict(self, optimizer, state_dict: dict) -> None:
        """Finish loading what ``dcp.load`` put into a :meth:`sharded_optim_state_dict`: set each param
        group's hyperparameters (learning rate, betas, ...) to those saved for the same parameters."""
        from .dcp import load_sharded_optim_state_dict  # (torch.distributed.checkpoint: imported when first used)

        load_sharded_optim_state_dict(self._runtime, optimizer, state_dict)

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Full fp32 gradients by HF name (zeros where none). Collective: call on every rank."""
        return self._runtime.gather_full("grads")

    @contextlib.contextmanager
    def no_sync(self):
        """Context manager, as DDP's and FSDP1's ``no_sync``: the backward of a forward run inside it
        reduces nothing; every unit's gradients accumulate, unreduced, in its own gradient buffer
        (fp32), and the next backward of a forward outside it adds its own and reduces the sum, once
        per unit. So with gradient accumulation only the last micro-batch communicates::

            for i, micro in enumerate(micro_batches):
                with model.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext():
                    (model(input_ids=micro, labels=micro).loss / len(micro_batches)).backward()

        Needs ``ShardConfig(reshard_after_forward=False)`` (the buffers are per unit) and an fp32
        ``reduce_dtype``, except over one rank with no comm hook, where the gradients accumulate in
        ``master.grad`` in place, as in plain PyTorch (``PassState.direct_grads``). The optimizer
        step, ``clip_grad_norm_`` and ``full_grads`` refuse gradients that were accumulated but not
        yet reduced; ``zero_grad`` drops them."""
        rt = self._runtime
        check_no_sync(rt.config, rt.state)
        previous = rt.state.require_grad_sync
        rt.state.require_grad_sync = False
        try:
            yield
        finally:
            rt.state.require_grad_sync = previous

    def register_comm_hook(self, state, hook) -> None:
        """Replace how each unit's gradients are reduced, like DDP's ``register_comm_hook``:
        ``hook(state, bucket) -> Future`` of this rank's shard of the SUM (see
        :mod:`yashard.comm_hooks`; built-ins there). Call once, before the first forward."""
        self._runtime.register_comm_hook(state, hook)

    def collective_log(self):
        """The :class:`~yashard.collectives.CollectiveLog` of this rank (set ``.enabled = True`` to record)."""
        return self._runtime.comm.log
