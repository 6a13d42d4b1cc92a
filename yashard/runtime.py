"""The runtime: builds units and slots from a model spec, installs the hooks, runs the schedule.

Data flows one way: ``ShardConfig`` + ``ModelSpec`` -> per-unit ``FlatLayout`` -> ``Slot`` buffers
-> hooks on the HF modules -> collectives. The stream/event rules R1-R6 referenced below are
stated in :mod:`yashard.events`; the checks run around optimizer steps are in :mod:`yashard.guards`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import inspect
import logging
import math
import types
import weakref
import zlib

import torch
import torch.utils.checkpoint
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import guards, materialize
from .buffers import Slot
from .collectives import Comm
from .comm_hooks import GradBucket, fp16_compress_hook, reduce_scatter_hook
from .config import ShardConfig, _dtype_name
from ._tree import diff_leaves, is_diff_tensor, put_back
from .events import IN_PLACE, Completed, Pending, Streams, labelled
from .gate_grad_flow import BackwardEntry, GateGradFlow, will_accumulate
from .layout import build_layout, slot_assignment
from .memory import MemoryPlan, plan_memory
from .norm_group import NormGroup, is_small_param
from .patch.spec import ModelSpec, get_path
from .stub import ShardedStub, sharded_message
from .unit import MasterShard, Unit, own_version_alias, same_named_subclass, storage_key
from .zeropp import qwz_all_gather, qwz_workspace_nbytes

logger = logging.getLogger("yashard")

# Every parameter starts at a multiple of this many elements in its unit's flat buffer (64 bytes
# in fp32): the views the layers compute with are as aligned as freshly allocated tensors.
PARAM_ALIGN = 16


class OrderError(RuntimeError):
    """A unit ran out of the order the fixed buffers require."""


def _some_names(names: list[str], shown: int = 3) -> str:
    """``"a, b, c and 4 more"``: the first few of ``names`` for an error message."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


class Runtime:
    """Owns units, slots, streams and hooks for one sharded model."""

    def __init__(self, model: nn.Module, spec: ModelSpec, config: ShardConfig, comm: Comm, device: torch.device,
                 weights: str | None = None):
        self.model = model
        self.weights = weights
        self.spec = spec
        self.config = config
        self.comm = comm
        self.device = device
        self.world = comm.shard_world   # ranks a unit is sharded over (layouts, slots)
        self.dp_world = comm.world      # data-parallel ranks: the post-divide factor
        self.streams = Streams(device)
        self.grad_fwd_id = 0        # id of the latest grad-enabled forward
        self.require_grad_sync = True  # False inside ShardedModel.no_sync()
        self._fwd_sync = True       # require_grad_sync at the latest grad-enabled forward (its backward's)
        self.in_backward = False
        self._discard_reductions = False
        self._root_active = False  # between the model's forward pre-hook and its forward hook
        self.backward_pending = False  # a grad-enabled forward ran and its backward has not ended
        self.accumulating = True  # this backward accumulates into .grad (not autograd.grad: begin_backward)
        self.pending: list[Pending] = []
        self._last_reduction: Pending | None = None  # R6: the reduction writing reduce_out
        self.comm_hook = reduce_scatter_hook   # how each unit's gradients are reduced (comm_hooks.py)
        self.comm_hook_state = None
        self._reduction_op = f"gradient reduction ({reduce_scatter_hook.__name__})"  # (named in collective errors)
        self._hook_hint: str | None = None  # what a reduction's error advises, for a user's comm hook
        self._workspaces: dict[str, torch.Tensor] = {}   # comm hooks' persistent scratch buffers
        self._hook_planned = False  # the comm hook's workspace_plan was allocated (more is warned about)
        self._hook_registered = False  # register_comm_hook was called (once only)
        self._loaded_hook_state: dict | None = None  # a checkpoint's comm hook state, for a hook registered later
        self._bucket_index = 0
        self._cast_versions: tuple | None = None   # master versions the param_dtype shards were cast at
        self._fwd_cursor = 0
        self._bwd_last_layer: int | None = None
        self._hooks = []

        self._validate(model, spec)
        if self.world == 1 and (config.quantized_weights or config.secondary_group_size) and comm.rank == 0:
            logger.warning("yashard: over a one-rank shard group nothing is gathered, yet %s: drop it",
                           "qwZ (quantized_weights) quantizes the weights for nothing, losing precision"
                           if config.quantized_weights else
                           "hpZ (secondary_group_size) keeps a copy of every layer for nothing")
        self._warn_idle_settings(config, comm)
        groups = self._partition(model, spec)
        self._build_units(groups)
        self._install_hooks(spec)
        for module in list(model.modules())[1:]:  # (the root's requires_grad_ reaches the shards: api.py)
            object.__setattr__(module, "requires_grad_",
                               types.MethodType(functools.partial(_module_requires_grad, weakref.ref(self)), module))
        model._yashard_sharded = True

    # ------------------------------------------------------------------ construction
    @staticmethod
    def _warn_idle_settings(config: ShardConfig, comm: Comm) -> None:
        """Warn (rank 0) about settings that change nothing here, so nobody tunes a no-op."""
        if comm.rank != 0:
            return
        if comm.shard_world > 1 and config.secondary_group_size == comm.shard_world:
            logger.warning(
                "yashard: secondary_group_size=%d (hpZ) equals the shard group's size, so the backward re-gathers "
                "run over the same ranks as without it, and each rank keeps a layer slice in param_dtype for nothing: "
                "use a smaller group (the ranks of one node) or drop secondary_group_size", comm.shard_world)
        if config.quant_block != ShardConfig.quant_block and not config.quantized_weights:  # (the field's default)
            logger.warning(
                "yashard: quant_block=%d is ignored: it sizes qwZ's quantization blocks and quantized_weights is off "
                "(set quantized_weights=8 or 4, or drop quant_block; qgZ's block is QgzState(block=))",
                config.quant_block)

    def _validate(self, model: nn.Module, spec: ModelSpec) -> None:
        """Checks that need the model, run before anything in it is changed."""
        if getattr(model, "_yashard_sharded", False):
            raise ValueError(
                "model was already sharded by yashard.shard (its parameters now live in that ShardedModel); "
                "use the ShardedModel it returned"
            )
        wrapped = _other_sharding(model)
        if wrapped is not None:
            raise ValueError(
                f"the model is already distributed by {wrapped}: yashard shards a plain HF model itself. Build the "
                "model without it (no fully_shard / FSDP / DeepSpeed / DTensor parameters) and pass that to yashard.shard"
            )
        n_layers = len(get_path(model, spec.layers))
        ckpt = self.config.checkpoint_layers
        if ckpt > n_layers:
            raise ValueError(
                f"ShardConfig.checkpoint_layers={ckpt} but the model has {n_layers} decoder layers; "
                f"use a value between 0 and {n_layers}"
            )
        flags = [f for f in ("is_activation_checkpointing", "is_gradient_checkpointing") if hasattr(type(model), f)]
        if flags and getattr(model, flags[0]):
            raise ValueError(
                "the model has HF activation checkpointing enabled (activation_checkpointing_enable() / "
                "gradient_checkpointing_enable()); it would re-run yashard's layer hooks during backward. "
                "Turn it off (model.gradient_checkpointing_disable()) and use ShardConfig(checkpoint_layers=N) instead"
            )

    def _partition(self, model: nn.Module, spec: ModelSpec):
        """Assign every parameter to exactly one unit; returns ``{unit_key: [(param, locs, fqns)]}``."""
        layers = get_path(model, spec.layers)
        owners: list[tuple[str, nn.Module]] = [("embed", get_path(model, spec.embed))]
        owners += [(f"layer_{i}", layer) for i, layer in enumerate(layers)]
        owners.append(("lm_head", get_path(model, spec.lm_head)))

        # Every (module, attr) location of every parameter, tied parameters seen under all names.
        locations: dict[int, tuple[nn.Parameter, list, list]] = {}
        for mod_name, module in model.named_modules(remove_duplicate=False):
            for attr, p in module._parameters.items():
                if p is None:
                    continue
                fqn = f"{mod_name}.{attr}" if mod_name else attr
                rec = locations.setdefault(id(p), (p, [], []))
                if (module, attr) not in [(m, a) for m, a in rec[1]]:
                    rec[1].append((module, attr))
                if fqn not in rec[2]:
                    rec[2].append(fqn)
        for p, _, fqns in locations.values():
            if not p.is_floating_point():
                raise ValueError(
                    f"parameter {fqns[0]} has dtype {p.dtype}; yashard shards floating-point parameters only: "
                    "register it as a buffer (module.register_buffer) if it is not trained"
                )

        owner_of_module = {}
        for key, root in owners:
            for m in root.modules():
                owner_of_module.setdefault(id(m), key)
        groups: dict[str, list] = {key: [] for key, _ in owners}
        groups["small"] = []
        for p, locs, fqns in locations.values():
            if is_small_param(p):
                groups["small"].append((p, locs, fqns))
                continue
            keys = {owner_of_module.get(id(m)) for m, _ in locs}
            keys.discard(None)
            if not keys:
                raise ValueError(
                    f"parameter {fqns[0]} (shape {tuple(p.shape)}) is outside the decoder layers "
                    f"('{spec.layers}'), the embedding ('{spec.embed}') and the lm_head ('{spec.lm_head}'); "
                    "yashard cannot shard it. Move it into one of those modules, or register it as a buffer "
                    "if it is not trained."
                )
            if keys == {"embed", "lm_head"}:      # tied input/output embedding: one unit, two names
                groups["embed"].append((p, locs, fqns))
            elif len(keys) > 1:
                raise ValueError(
                    f"parameter {fqns[0]} is also {', '.join(fqns[1:]) or 'used by another unit'}; yashard "
                    "supports sharing only between the embedding and the lm_head (tied embeddings): untie it "
                    "(assign a clone to one of them) before yashard.shard"
                )
            else:
                groups[keys.pop()].append((p, locs, fqns))
        return {k: v for k, v in groups.items() if v}

    def _check_same_model(self, groups) -> None:
        """Every rank must shard the same model with the same settings: compare a digest of every
        parameter's name, shape and dtype and of the ShardConfig (its device aside), and on a
        mismatch name the first difference. Without this, ranks would issue collectives of different
        sizes and fail later, in gloo or NCCL, without naming the cause."""
        cfg = {f.name: repr(getattr(self.config, f.name)) for f in dataclasses.fields(self.config) if f.name != "device"}
        desc = [("ShardConfig", sorted(cfg.items()))] + [
            (key, [(fqns[0], tuple(p.shape), str(p.dtype)) + (() if p.requires_grad else ("frozen",))
                   for p, _, fqns in members]) for key, members in groups.items()]
        digests = self.comm.all_gather_object(zlib.crc32(repr(desc).encode()), "yashard.shard: same model on every rank")
        if len(set(digests)) == 1:
            return
        every = self.comm.all_gather_object(desc, "yashard.shard: the models of the ranks")
        r = next(i for i, d in enumerate(digests) if d != digests[0])
        ours, theirs = dict(every[0]), dict(every[r])
        only_one = [k for k in theirs if k not in ours] + [k for k in ours if k not in theirs]  # (layer counts)
        where = only_one[0] if only_one else next(k for k in ours if ours[k] != theirs[k])
        a, b = ours.get(where, []), theirs.get(where, [])
        first = next(((x, y) for x, y in zip(a, b) if x != y), (a[len(b)] if len(a) > len(b) else None,
                                                                 b[len(a)] if len(b) > len(a) else None))
        raise ValueError(
            f"the ranks are sharding different models: in {where}, rank 0 has {first[0]} where rank {r} has "
            f"{first[1]}. Every rank must build the same model (same config, same code, the same parameters "
            "frozen) and pass the same ShardConfig (its device aside) to yashard.shard"
        )

    def _build_units(self, groups) -> None:
        self._check_same_model(groups)
        cfg = self.config
        w = self.world
        layouts = {
            key: build_layout([(fqns[0], p.shape) for p, _, fqns in members], w, param_align=PARAM_ALIGN,
                              shard_align=cfg.shard_align)
            for key, members in groups.items()
        }
        slot_of = slot_assignment(list(groups), alternate=cfg.reshard_after_forward)
        slot_sizes: dict[str, int] = {}
        grad_sizes: dict[str, int] = {}  # (units whose parameters are all frozen write no gradients)
        for key, name in slot_of.items():
            slot_sizes[name] = max(slot_sizes.get(name, 0), layouts[key].padded)
            trains = any(p.requires_grad for p, _, _ in groups[key])
            grad_sizes[name] = max(grad_sizes.get(name, 0), layouts[key].padded if trains else 0)
        gdt = cfg.wire_dtype
        self.direct = direct_slots(w, cfg)
        self.direct_grads = direct_grads(self.direct, self.dp_world, cfg)
        self._slot_grad_sizes = grad_sizes  # (what the slots' gradient buffers hold when they have one)
        self.slots = {
            name: Slot(name, numel, w, cfg.param_dtype, gdt, self.device, direct=self.direct,
                       grad_numel=0 if self.direct_grads else grad_sizes[name])
            for name, numel in slot_sizes.items()
            if numel > 0
        }
        # One reduce-scatter output for every slot: reductions run one after the other (R6). Over one
        # rank the default hook's sum is the gradient buffer itself: allocated only if a hook asks.
        self._reduce_out_numel = max(grad_sizes[name] for name in self.slots) // w
        self.reduce_out = None
        if w > 1:
            self._reduce_output(0)
        # qwZ: codes + scales of every rank's shard, gathered in one collective. One workspace serves
        # every slot: a quantized gather has dequantized into its slot before the next one quantizes
        # (on the communication stream, in issue order).
        self.qwz_workspace = None
        if cfg.quantized_weights:
            nbytes = max(qwz_workspace_nbytes(s.numel // w, w, bits=cfg.quantized_weights, block=cfg.quant_block)
                         for s in self.slots.values() if s.name != "small")
            self.qwz_workspace = torch.empty(nbytes, dtype=torch.uint8, device=self.device)

        masters = self._materialise(groups, layouts)
        removed: dict[nn.Parameter, str] = {}
        self.units: list[Unit] = []
        self.layers: list[Unit] = []
        self.embed = self.lm_head = self.small = None
        for key, members in groups.items():
            layout = layouts[key]
            slot = self.slots[slot_of[key]]
            if key.startswith("layer_"):
                idx, kind = int(key.split("_")[1]), "layer"
            else:
                idx, kind = -1, "small" if key == "small" else "outer"
            master = MasterShard(masters.pop(key))
            unit = Unit(
                self, key, kind, idx, layout,
                locations=[locs for _, locs, _ in members],
                fqns=[fqns for _, _, fqns in members],
                slot=slot, master=master, trainable=[p.requires_grad for p, _, _ in members],
            )
            if cfg.param_dtype != torch.float32:
                unit.gather_src = torch.empty(master.shape, dtype=cfg.param_dtype, device=self.device)
            if self.direct:  # (an alias: the views' in-place writes move its own version counter)
                unit.direct_source = own_version_alias(unit.gather_src)
            if cfg.secondary_group_size is not None and kind == "layer":  # hpZ: this rank's secondary slice
                unit.secondary = torch.empty(layout.padded // cfg.secondary_group_size, dtype=cfg.param_dtype,
                                             device=self.device)
            for entry, (p, locs, fqns) in enumerate(members):  # the HF modules no longer own these parameters
                removed[p] = fqns[0]
                for (module, attr), fqn in zip(locs, fqns):
                    module._parameters.pop(attr, None)
                    _mark_sharded(module, attr, fqn, p.shape, unit, entry)
            self.units.append(unit)
            if kind == "layer":
                self.layers.append(unit)
            elif key == "small":
                self.small = unit
            elif key == "embed":
                self.embed = unit
            else:
                self.lm_head = unit
        self.layers.sort(key=lambda u: u.index)
        order = ([self.embed] if self.embed else []) + self.layers + ([self.lm_head] if self.lm_head else [])
        self.units = order + ([self.small] if self.small else [])
        self.forward_order = order
        self._plan_hook_workspaces()  # the default hook's: a receive buffer on gloo over > 2 ranks
        for a, b in zip(order, order[1:] + [None]):
            a.next_forward = b
        self.norm_group = NormGroup(self.small) if self.small else None
        sharing = collections.Counter(u.slot.name for u in self.units)
        for i, u in enumerate(self.units):
            u.order = i
            # Views of a unit whose slot other units reuse come off once nothing reads them any more:
            # after its forward, or (activation checkpointing recomputes the forward) its backward.
            checkpointed = u.kind == "layer" and u.index < self.config.checkpoint_layers
            if sharing[u.slot.name] > 1:
                u.views_until = "backward" if checkpointed else "forward"
            # the recompute of a checkpointed layer reads its own views and the norm group's: those
            # of the grad-enabled forward it belongs to are put back when its backward starts
            u.keep_backward_views = checkpointed or (u.kind == "small" and self.config.checkpoint_layers > 0)
        # Did a unit's forward output hold a NaN/inf, in a forward whose gradients the step would use?
        # (the sum of each grad-enabled forward's first floating output, NaN/inf if one held it; fp64
        # where the device has it: fp32-finite sums of many forwards cannot overflow it). A forward's
        # sums wait in fwd_pending and join fwd_sums when its backward starts: a forward that is never
        # backwarded (a batch skipped for its NaN loss) counts for nothing, and gradients dropped since
        # the last backward (zero_grad) take their forwards' sums with them (begin_backward).
        fwd_dtype = torch.float64 if self.device.type in ("cpu", "cuda") else torch.float32
        self.fwd_sums = torch.zeros(len(self.units), device=self.device, dtype=fwd_dtype)
        self.fwd_pending = torch.zeros_like(self.fwd_sums)
        self._fwd_pending = list(self.fwd_pending.unbind())  # (one persistent 0-d view per unit)
        self._fwd_pending_id = None  # the forward whose sums fwd_pending holds
        self._clip_finite = None  # (per-unit 'gradient is finite' flags, the grads' versions) of the last clip
        self.trainable_entries = None  # (the step's checks: see guards._trainable_entries)
        self.warned_no_grad: set[str] = set()  # parameters named in the step's "got no gradient" warning
        self.stepped_since_backward = False  # an optimizer step ran since the last backward began
        self.creating_optimizer_state = False  # sharded_optim_state_dict's zero-gradient step is running
        self.skipped_steps = 0
        self._structure = None  # (module, its parameters, its children) at the last full check_no_new_parameters
        self.grad_scalers = weakref.WeakSet()  # enabled ShardedGradScalers: they own non-finite gradients
        self.warned_fp16 = False  # the fp16-without-ShardedGradScaler warning was logged
        guards.track(self, removed)  # weak references: the removed parameters are freed as usual
        self.model.to(self.device)  # moves the remaining buffers (rotary tables, ...)
        self.streams.share_with_comm(self.allocated_tensors().values())

    def _materialise(self, groups, layouts) -> dict[str, torch.Tensor]:
        """Every unit's fp32 master shard, from live weights, an HF folder or the model's own init."""
        comm, cfg = self.comm, self.config
        rank = comm.shard_rank
        masters = {k: torch.zeros(layouts[k].shard_numel, dtype=torch.float32, device=self.device) for k in groups}
        meta = materialize.is_meta_model(self.model)
        if meta and self.weights is None:
            live = [n for n, p in self.model.named_parameters() if not p.is_meta]
            if live:
                on_meta = next(n for n, p in self.model.named_parameters() if p.is_meta)
                raise ValueError(
                    f"parameter {on_meta} is on the meta device but {live[0]} is not; build the whole model on "
                    "the meta device (yashard initialises it) or none of it, or pass weights=<HF folder>"
                )
        if self.weights is not None:
            folder = materialize.HFFolder(self.weights)
            materialize.check_folder_config(folder, self.model, warn=rank == 0)
            materialize.align_base_prefix(folder, self.model)
            used = materialize.from_folder(folder, self.model, groups, layouts, masters, rank)
            used |= materialize.load_buffers_from_folder(self.model, folder)
            if rank == 0:
                materialize.warn_unused(folder, self.model, used)
            materialize.init_meta_buffers(self.model)
        elif meta:
            index = {id(p): (key, i) for key, members in groups.items() for i, (p, _, _) in enumerate(members)}
            with self._rank0_rng():
                materialize.from_init(self.model, groups, layouts, masters, rank, index)
        else:
            sync = cfg.sync_module_states and comm.world > 1
            materialize.from_live(groups, layouts, masters, rank,
                                  (lambda flat, key: comm.broadcast(flat, 0, key)) if sync else None)
        return masters

    @contextlib.contextmanager
    def _rank0_rng(self):
        """With ``sync_module_states``, initialise every rank from rank 0's CPU RNG state; the other
        ranks get their own state back afterwards (rank 0's advances, as building the model would)."""
        comm = self.comm
        if not (self.config.sync_module_states and comm.world > 1):
            yield
            return
        own = torch.get_rng_state()
        state = own.clone().to(self.device)
        comm.broadcast(state, 0, "rng_state")
        torch.set_rng_state(state.cpu())
        try:
            yield
        finally:
            if comm.rank != 0:
                torch.set_rng_state(own)

    def _install_hooks(self, spec: ModelSpec) -> None:
        model = self.model
        self._hooks.append(model.register_forward_pre_hook(_opaque(self._root_pre_forward)))
        self._hooks.append(model.register_forward_hook(_opaque(self._root_post_forward), always_call=True))
        modules = {"embed": get_path(model, spec.embed), "lm_head": get_path(model, spec.lm_head)}
        layer_modules = get_path(model, spec.layers)
        ckpt = self.config.checkpoint_layers
        if ckpt and "use_cache" in inspect.signature(model.forward).parameters:
            self._hooks.append(model.register_forward_pre_hook(_opaque(_no_cache_when_checkpointing), with_kwargs=True))
        for unit in self.forward_order:
            if unit.kind == "layer":
                module = layer_modules[unit.index]
                if unit.index < ckpt:
                    module.forward = functools.partial(_checkpointed_forward, module, module.forward)
            else:
                module = modules[unit.name]
            self._hooks.append(module.register_forward_pre_hook(_opaque(functools.partial(self._pre_forward, unit)),
                                                                with_kwargs=True))
            self._hooks.append(module.register_forward_hook(_opaque(functools.partial(self._post_forward, unit))))
        if self.lm_head is None and self.embed is not None and any(
                m is modules["lm_head"] for locs in self.embed.locations for m, _ in locs):
            # tied embeddings: the head multiplies by the embedding unit's views
            self._hooks.append(modules["lm_head"].register_forward_pre_hook(_opaque(self._tied_head_pre_forward),
                                                                            with_kwargs=True))

    # ------------------------------------------------------------------ gathers (R1, R2)
    def gather(self, unit: Unit) -> None:
        """Issue the all-gather of ``unit`` into its slot (R1: after the previous owner's release).

        Forward gathers read the primary shards over the shard group (quantized with qwZ); with hpZ
        a grad-enabled forward also keeps this rank's secondary slice, and backward re-gathers read
        the secondary slices over the (node-local) secondary group. A direct slot (shard world 1)
        shows the unit's own shard instead: no collective, no copy, nothing to wait for.
        """
        slot = unit.slot
        if slot.direct:  # shard world 1: the unit's shard is all of it, shown in place (no collective)
            slot.show(unit.direct_source)
            unit.gathered_version = unit.master._version
            unit.gathered = IN_PLACE
            slot.owner = unit
            return
        prev = slot.owner
        if prev is not None and prev is not unit and prev.gathered is not None and not prev.gathered.done:
            prev.gathered.wait()  # an unused prefetch still writing into the slot (CPU: gloo thread)
        label = "yashard::norm_group_all_gather" if unit.kind == "small" else "yashard::all_gather"
        comm = self.comm
        on_done = None
        training = torch.is_grad_enabled() and not self.in_backward  # (a training forward's gather)
        # (no_grad: a c10d op has no autograd kernel, so an fp32 master as its input would give
        # the slot an autograd history through torch's fallback)
        what = _What("all_gather", unit.name, self._phase_state())
        with torch.no_grad(), self.streams.comm_context(), labelled(label), comm.issuing(what):
            if slot.release is not None:
                self.streams.comm.wait_event(slot.release)
            out = slot.weights_io.narrow(0, 0, unit.layout.padded)
            if self.in_backward and unit.secondary is not None and unit.secondary_version == unit.master._version:
                work = comm.all_gather(out, unit.secondary, unit.name, comm.secondary_group)
            else:
                if unit.kind != "small" and self.config.quantized_weights:
                    qwz_all_gather(comm, out, unit.gather_src, self.qwz_workspace, bits=self.config.quantized_weights,
                                   block=self.config.quant_block, unit=unit.name)
                    work = Completed()
                else:
                    work = comm.all_gather(out, unit.gather_src, unit.name)
                if unit.secondary is not None and training:
                    secondary, h = unit.secondary, comm.topology.secondary_rank
                    on_done = functools.partial(_keep_secondary, secondary, out, h)
                    unit.secondary_version = unit.master._version
        unit.gathered_version = unit.master._version
        unit.gathered = Pending(self.streams, work, on_done,
                                functools.partial(comm.wait, what=what))
        slot.owner = unit

    def _release(self, slot: Slot) -> None:
        """Compute has issued its last read of ``slot``'s weights: record the event a gather into it
        waits for (R1). A direct slot is never gathered into (it shows a shard in place): none."""
        if not slot.direct:
            slot.release = self.streams.record(self.streams.compute)

    def _phase_state(self) -> tuple[bool, bool, int]:
        """Where the runtime is (formatted by :class:`_What` only if an error needs it)."""
        return self.in_backward, torch.is_grad_enabled(), self.grad_fwd_id

    def _ensure_gathered(self, unit: Unit) -> None:
        if unit.slot.owner is not unit or unit.gathered is None:
            self.gather(unit)
        unit.gathered.wait()  # R2

    def _prefetch(self, unit: Unit | None) -> None:
        if unit is not None and (unit.slot.owner is not unit or unit.gathered is None):
            self.gather(unit)

    # ------------------------------------------------------------------ forward
    def _root_pre_forward(self, module, args):
        """Start of a forward: refresh gather sources, gather the norm group and the first unit.

        A unit whose slot still holds its weights, gathered from the masters as they are now
        (same ``_version``), is not gathered again: the norm group (its own slot) is gathered once
        per optimizer step, however many micro-batches it has; so are the units gathered right
        after the step (:meth:`after_optimizer_step`) and, with gradient accumulation, the layers
        the previous backward left in the slots."""
        grad = torch.is_grad_enabled()
        self._begin_forward(grad)
        self._root_active = True
        if grad:
            if self.grad_fwd_id == 0 and self._loaded_hook_state is not None:
                self._drop_loaded_hook_state()
            self.grad_fwd_id += 1
            self._fwd_sync = self.require_grad_sync
        if grad:  # (until its backward ends; a no-grad forward in between, an evaluation, leaves it pending)
            self.backward_pending = True
        self._fwd_cursor = 0
        self._bwd_last_layer = None
        for u in self.units:
            if u.slot.owner is not u or u.gathered_version != u.master._version:
                u.gathered = None  # masters changed (optimizer step, load) or the slot was reused
            if grad:
                u.fwd_version = u.master._version
        if self.norm_group is not None:
            if grad:
                self.small.fwd_id = self.grad_fwd_id
            self.norm_group.begin_forward(grad)
        if self.forward_order:
            self._prefetch(self.forward_order[0])
        return None

    def _begin_forward(self, grad: bool) -> None:
        """What starts every forward (the model's, or the input embedding's called ahead of it):
        the checks first (they change no state: a refused forward leaves none behind), the reset
        after a backward that raised, then the wait for what is in flight and the refresh of the
        gather sources."""
        self._check_slot_writes()
        self.check_master_storage()
        if grad:
            self._check_masters()
        if self.in_backward:
            self._recover_from_failed_backward()
        self._drain()
        self.streams.capture_compute()
        self._refresh_sources()

    def _check_slot_writes(self) -> None:
        """Refuse in-place writes through the modules' views of gathered weights (the norm group's
        stay installed between forwards): they change a gathered copy, not the master shards, so
        they would be used until the next gather and then lost. The slot's weights are gathered
        again before the error is raised."""
        for slot in self.slots.values():
            if slot.weights._version != slot.weights_version:
                slot.weights_version = slot.weights._version
                owner = slot.owner
                slot.owner = None  # gathered again at the next forward
                if owner is not None:
                    owner.gathered = None
                where = ""
                if slot.direct:  # the views read the unit's own shard: the write went into it
                    if self.config.param_dtype == torch.float32:
                        where = (" On one rank (shard world 1) these views are the fp32 master shards themselves, "
                                 "so this write did change them; on more ranks it would not have.")
                    self._cast_versions = None  # (a param_dtype copy is cast from the masters again)
                raise RuntimeError(
                    f"the gathered weights of {self.module_name(owner) if owner is not None else 'a unit'} were "
                    "written in place through the model's modules (e.g. model.model.norm.weight.fill_(1.0)): they "
                    "are a copy gathered from the "
                    "master shards, so the write would be used until the next gather, then lost, and "
                    "full_state_dict() would not show it." + where + " Write the weights through yashard (dcp.load "
                    "into model.sharded_state_dict(), yashard.load_checkpoint) or in place into model.parameters() "
                    "under torch.no_grad()"
                )

    def check_master_storage(self) -> None:
        """Refuse a master shard whose data was replaced (``p.data = x``, or a module-wide
        ``_apply``: ``model.cuda()``, ``model.to_empty(...)``): the gathered copies, the gradient
        buffer attached as its ``.grad``, the checkpoint views and the frozen ranges all point at the
        storage ``shard()`` gave it, so the new data would be used by some of them and not others.
        (An in-place write, ``p.copy_(x)`` under ``torch.no_grad()``, keeps the storage and moves the
        version counter: it is the way.)"""
        for u in self.units:
            if storage_key(u.master) != u.master_storage:
                m = u.master
                was_ptr, was_shape, was_dtype, was_device = u.master_storage
                raise RuntimeError(
                    f"the master shard {u.name} no longer holds the storage yashard.shard gave it (now "
                    f"{tuple(m.shape)} {_dtype_name(m.dtype)} on {m.device}, was {was_shape} {_dtype_name(was_dtype)} "
                    f"on {was_device}{', another buffer' if m.data_ptr() != was_ptr else ''}): it was replaced, "
                    "through p.data = ... or a module-wide .cuda()/.to_empty()/_apply. yashard's gathered weights, "
                    "gradient buffer, checkpoint views and optimizer state refer to the old storage, so the new data "
                    "would be seen by some and not others. Write new values in place instead: with torch.no_grad(): "
                    "p.copy_(new_values)"
                )

    def _check_masters(self) -> None:
        """Refuse what autograd would silently ignore on the master shards: a shard whose parameters
        were all frozen at ``shard()`` set to require gradients (it has no gradient storage), and
        hooks registered on one (the reduction writes ``.grad`` itself, so autograd never calls them)."""
        for u in self.units:
            m = u.master
            if m.requires_grad and u.grad_storage is None:
                names = _some_names([f[0] for f in u.fqns])
                raise ValueError(
                    f"the master shard {u.name} was set to require gradients, but its parameters ({names}) were all "
                    "frozen (requires_grad=False) when yashard.shard ran, so it has no gradient buffer: it would train "
                    "nothing. Leave them unfrozen before yashard.shard to train them, or set this shard's "
                    "requires_grad back to False"
                )
            if m._backward_hooks or getattr(m, "_post_accumulate_grad_hooks", None):
                raise ValueError(
                    f"a hook is registered on the master shard {u.name} (register_hook / "
                    "register_post_accumulate_grad_hook): yashard writes the reduced gradient into .grad itself, so "
                    "autograd would never call it. Step the optimizer after backward(); to act on gradients as they "
                    "are reduced, use model.register_comm_hook"
                )

    def _root_post_forward(self, module, args, output):
        self._root_active = False
        return None

    def _refresh_sources(self) -> None:
        """Recast the param_dtype shards if the masters changed, and order every gather issued
        from now on after what compute did so far (the casts, the optimizer step, the previous
        backward's last reads of the resident norm group: R1)."""
        versions = tuple(u.master._version for u in self.units)
        if self.config.param_dtype != torch.float32 and versions != self._cast_versions:
            # masters changed (optimizer step, load): refresh those cast shards (frozen ones stay)
            old = self._cast_versions or (None,) * len(versions)
            changed = [u for u, v, was in zip(self.units, versions, old) if v != was]
            with torch.no_grad():
                torch._foreach_copy_([u.gather_src for u in changed], [u.master for u in changed])
            self._cast_versions = versions
        self.streams.comm.wait_event(self.streams.record(self.streams.compute))

    def after_optimizer_step(self) -> None:
        """Run by the optimizer step post-hook (:mod:`yashard.guards`): start gathering the norm
        group and, in forward order, the first unit of every slot (the embedding and the first two
        layers; with ``reshard_after_forward=False`` every unit; not one whose slot still holds its
        weights as they are: frozen parameters the step did not change) now, so they travel while the host
        does whatever comes between steps (logging, data, ``zero_grad``) and the first layer's
        gather is not left waiting behind the embedding's short forward. The next forward uses them
        only if the masters have not changed since (``gathered_version``).

        Fused torch optimizers (``fused=True``) update the masters without bumping their version
        counters, so the step bumps them here: every version-keyed cache (the ``param_dtype``
        copies, gathered weights, hpZ secondary shards) sees the masters as changed.

        First, the frozen parameters of partly frozen units get back the values
        :meth:`before_optimizer_step` kept (the step saw zero gradients there, but weight decay and
        momentum may have moved them)."""
        for u in self.units:
            u.restore_frozen()
            if u.grad_storage is not None:  # (a shard of frozen parameters never has a gradient to step)
                torch.autograd.graph.increment_version(u.master)
        self.stepped_since_backward = True  # (the next backward starts the gradient flags afresh)
        self.masters_changed()

    def masters_changed(self) -> None:
        """The masters were written (:meth:`after_optimizer_step`, ``yashard.load_checkpoint``):
        gather what the next forward needs first, as described there, and wait for the norm group,
        whose weights stay readable between forwards; take off the views that would be stale."""
        if self.in_backward or not self.forward_order:
            return
        self._drain()
        self.streams.capture_compute()
        self._refresh_sources()
        for u in self.units:  # (a unit whose masters the step did not change keeps its gathered weights)
            if u.slot.owner is not u or u.gathered_version != u.master._version:
                u.gathered = None
        stale = [u for u in self.forward_order  # (a direct slot shows the shard itself: never stale)
                 if u.gathered is None and u.views_until is None and not u.slot.direct]
        if self.small is not None:
            self._prefetch(self.small)
            # The norm weights stay readable between forwards (model.model.norm.weight): they show
            # the stepped values once this small gather is waited for (CUDA: the compute stream waits).
            self.small.gathered.wait()
        free = set()  # every slot is free now: gather the first unit of each, in forward order
        with torch.enable_grad():  # gathers for a training forward: hpZ keeps its secondary slices
            for u in self.forward_order:
                if u.slot.name not in free:
                    free.add(u.slot.name)
                    self._prefetch(u)
        # Units whose views stay on their modules between forwards (a slot of their own:
        # reshard_after_forward=False, tied embeddings) would show the weights before the step, or
        # the gather in flight: their views come off, so a read until the next forward (which puts
        # them back) is a ShardedStub that raises on its values instead of handing out stale ones.
        for u in stale:
            u.remove_views()

    def set_requires_grad(self, requires_grad: bool) -> None:
        """``requires_grad_`` of the whole sharded model: every master shard off, or back to what
        ``shard()`` decided (a shard whose parameters were all frozen then stays off)."""
        for u in self.units:
            u.master.requires_grad_(requires_grad and u.grad_storage is not None)

    def before_optimizer_step(self) -> None:
        """Run by the optimizer step pre-hook, after its checks: keep the frozen ranges of partly
        frozen units (put back by :meth:`after_optimizer_step`)."""
        for u in self.units:
            u.keep_frozen()

    def _pre_forward(self, unit: Unit, module, args, kwargs):
        if not self._root_active and unit is self.embed:  # (never re-run in a backward: not checkpointed)
            return self._embedding_ahead_of_forward(unit, args, kwargs)
        if not self._root_active and not self.in_backward:  # (a checkpointed layer's recompute is in one)
            raise OrderError(
                f"{unit.name} ran outside a forward of the whole model: yashard gathers each unit's weights "
                f"as the model's own forward reaches it. Call the model itself ({type(self.model).__name__}, or "
                "the ShardedModel) with input_ids or inputs_embeds; output_hidden_states=True returns every layer's "
                "hidden states. Calling the base model or a decoder layer on its own is not supported (the input "
                "embedding is: inputs_embeds = model.get_input_embeddings()(input_ids))"
            )
        if unit.kind == "layer":
            expected = self._fwd_cursor
            if unit.index != expected:
                raise OrderError(self._order_message(unit.index, expected))
            self._fwd_cursor += 1
        elif unit is self.lm_head and self._fwd_cursor != len(self.layers):
            raise OrderError(
                f"{self.spec.lm_head} ran after {self._fwd_cursor} of the {len(self.layers)} decoder layers "
                f"({self.spec.layers}.{self._fwd_cursor} was expected next); yashard's alternating buffers need "
                "every layer to run exactly once per forward, in order"
            )
        self._ensure_gathered(unit)
        if self.norm_group is not None:
            self.norm_group.ensure_ready()
        self._prefetch(unit.next_forward)
        return self._enter(unit, self.grad_fwd_id, args, kwargs)

    def _enter(self, unit: Unit, fwd_id: int, args, kwargs):
        """Install ``unit``'s views (its weights are gathered); with grad, as part of forward
        ``fwd_id``, behind a :class:`GateGradFlow` on its differentiable inputs."""
        if not torch.is_grad_enabled():
            unit.install_views(None)
            return None
        unit.fwd_id = fwd_id
        unit.grad_claimed = False
        unit.written = [False] * len(unit.layout.entries)
        unit.fwd_trains = unit.master.requires_grad
        unit.fwd_backward = False
        inputs = (args, kwargs)
        diff = diff_leaves(inputs)
        flat = spec = None
        if diff is None:  # (another pytree container among the inputs: pytree finds them)
            flat, spec = tree_flatten(inputs)
            idx = [i for i, x in enumerate(flat) if is_diff_tensor(x)]
            diff = [flat[i] for i in idx]
        if not unit.fwd_trains and not diff:  # frozen, and no gradient flows through it: no backward
            unit.install_views(None, grad_forward=True)
            return None
        # (a frozen unit's gate takes a token that needs no gradient: its outputs need one only if
        # its inputs do; the gate then marks the end of its backward, when its slot is free again)
        token, *gated = GateGradFlow.apply(unit, unit.token if unit.fwd_trains else unit.frozen_token, *diff)
        unit.install_views(token if unit.fwd_trains else None, grad_forward=True)
        if spec is None:
            return put_back(inputs, iter(gated))
        for i, g in zip(idx, gated):
            flat[i] = g
        return tree_unflatten(flat, spec)

    def _tied_head_pre_forward(self, module, args, kwargs):
        """The output embedding of a tied model reads the embedding unit's views. Usually the
        embedding ran earlier in the same forward and installed them; when it did not run with
        grad in this forward (``inputs_embeds`` computed under ``torch.no_grad()`` or outside the
        model, after an evaluation or ``generate()``), the views are plain ones of another forward
        and the tied weight would get no gradient from the head. Contract: the head reads weights
        gathered from the masters as they are now, waited for (R2), and in a grad-enabled forward
        the views it reads are this forward's (``Narrow`` outputs behind a gate on the head's
        inputs, so the gradient reaches the tied weight and its reduction waits for it)."""
        unit = self.embed
        if not self._root_active:
            return None  # (outside a model forward: nothing to join; the views in place are read)
        if unit.slot.owner is not unit or unit.gathered_version != unit.master._version:
            unit.gathered = None
        fresh = unit.gathered is None
        self._ensure_gathered(unit)
        if torch.is_grad_enabled():
            if unit.fwd_id == self.grad_fwd_id:
                return None  # the embedding ran in this forward: its views are this forward's
            unit.fwd_version = unit.master._version
            return self._enter(unit, self.grad_fwd_id, args, kwargs)
        if fresh:
            unit.install_views(None)
        return None

    def _embedding_ahead_of_forward(self, unit: Unit, args, kwargs):
        """The input embedding called on its own, ahead of the model forward that takes its output
        as ``inputs_embeds`` (LLaVA-style multimodal inputs, prompt tuning): it runs as the first
        unit of that coming forward, whose id it takes (``grad_fwd_id + 1``), so its backward and
        its reduction belong to that forward's backward. It starts as the model's forward does
        (:meth:`_begin_forward`)."""
        grad = torch.is_grad_enabled()
        self._begin_forward(grad)
        if unit.slot.owner is not unit or unit.gathered_version != unit.master._version:
            unit.gathered = None
        self._ensure_gathered(unit)
        self._prefetch(unit.next_forward)
        if grad:
            unit.fwd_version = unit.master._version
        return self._enter(unit, self.grad_fwd_id + 1, args, kwargs)  # the coming forward's id

    def _order_message(self, got: int, expected: int) -> str:
        layers = self.spec.layers
        if expected >= len(self.layers):
            return (
                f"decoder layer {layers}.{got} ran after all {len(self.layers)} layers of this forward already "
                "ran; yashard's alternating buffers need every layer to run exactly once per forward, in order"
            )
        return (
            f"decoder layer {layers}.{got} ran its forward but {layers}.{expected} was expected next; yashard's "
            "alternating buffers need every layer to run exactly once per forward, in order "
            "(a layer was skipped, repeated or called out of order)"
        )

    def _post_forward(self, unit: Unit, module, args, output):
        self._release(unit.slot)  # R1 for the next owner
        grad = torch.is_grad_enabled()
        # views on a slot other units reuse come off once nothing reads them: after the forward, or,
        # for a checkpointed layer, after its backward; a no-grad forward has no backward to wait for
        # (the plain views it installed would show the next owner's weights under this unit's names)
        if unit.views_until == "forward" or (unit.views_until == "backward" and not grad):
            unit.remove_views()
        if not grad:
            return None
        # a checkpointed layer's views of this forward: kept by its BackwardEntry node, so by the
        # forward's graph and no longer, and put back when its backward starts; the modules hold
        # none meanwhile (a forward that is never backwarded frees its graph with its output)
        views, unit.backward_views = unit.backward_views, None
        if unit.views_until == "backward":
            unit.remove_views()
        elif unit.views_until is None and (unit.kind == "layer" or unit is self.lm_head):
            # (the slot is the unit's own: its weights stay readable, as plain views, so the modules
            # do not keep this forward's graph alive; nothing else reads them in this forward)
            unit.install_views(None)
        if isinstance(output, torch.Tensor):  # (a decoder layer's output in transformers 5)
            flat, spec, diff = None, None, [output] if is_diff_tensor(output) else []
            first = output if output.is_floating_point() else None
        else:
            flat, spec = tree_flatten(output)
            diff = [x for x in flat if is_diff_tensor(x)]
            first = next((x for x in flat if isinstance(x, torch.Tensor) and x.is_floating_point()), None)
        if first is not None and self.config.on_nonfinite != "ignore":
            # which unit first produced a NaN/inf (step_checks): NaN and inf propagate through a sum
            if self._fwd_pending_id != unit.fwd_id:  # (a forward never backwarded: dropped)
                self.fwd_pending.zero_()
                self._fwd_pending_id = unit.fwd_id
            self._fwd_pending[unit.order].add_(first.detach().sum(dtype=torch.float32))
        if unit is self.embed or not diff:
            return None  # (the embedding needs no weights in backward)
        unit.fwd_backward = True
        outs = BackwardEntry.apply(unit, self.grad_fwd_id, views, *diff)
        if spec is None:
            return outs[0]
        return tree_unflatten(put_back(flat, iter(outs)), spec)

    # ------------------------------------------------------------------ backward
    def begin_backward(self) -> None:
        """First hook of a backward: attach grad storage and queue the end-of-backward callback."""
        if self.in_backward:
            return
        if _in_compiled_autograd():
            raise RuntimeError(
                "a sharded model's backward ran under compiled autograd (torch._dynamo.compiled_autograd, or "
                "torch._dynamo.config.compiled_autograd=True): yashard's backward hooks reduce gradients and "
                "re-gather weights as each layer's backward starts and ends, which compiled autograd would trace "
                "into one graph. Run backward() without it; the forward can still be compiled "
                "(layer.compile() or torch.compile(model))"
            )
        self.in_backward = True
        self._bucket_index = 0
        self._bwd_last_layer = None
        for u in self.units:
            u.reduced_in_pass = False
        # torch.autograd.grad(loss, inputs) and backward(inputs=...) leave every parameter's .grad as
        # it is: such a pass only carries gradients through the units (their weights are gathered,
        # nothing is written or reduced). Every unit trained by this forward has its token in the
        # graph; the engine runs their AccumulateGrad nodes exactly when it accumulates into leaves.
        self.accumulating = any(will_accumulate(u.token) for u in self.units
                                if u.fwd_trains and u.fwd_id == self.grad_fwd_id)
        if self.accumulating:
            self._count_forward_sums()
            fresh = self.stepped_since_backward  # (not at the step itself: a second optimizer of this
            self.stepped_since_backward = False  # model checks the same flags, see guards.step_checks)
            for u in self.units:
                # the flags say which parameters the gradients in .grad came from: they start afresh
                # after a step, and for a shard whose .grad was dropped since (zero_grad() with no step,
                # a batch thrown away): else the step would keep a .grad no backward since reached
                if fresh or u.master.grad is None:
                    u.got_grad = [False] * len(u.got_grad)
                    u.attached_from_none = False
                if u.grad_storage is None or not u.master.requires_grad:
                    continue  # (a shard turned off since its forward gets no .grad, as torch leaves it)
                # A master the loss reads itself (a penalty on model.parameters()) gets a gradient
                # from autograd in this pass, at a moment the graph decides.
                by_autograd = (u.master.grad is None or u.attached_from_none) and will_accumulate(u.master)
                if by_autograd:
                    u.attached_from_none = False  # (reached: the step keeps its .grad)
                if u.master.grad is None:
                    u.master.grad = u.grad_storage
                    if by_autograd:  # zeroed: autograd and the reductions both add to it
                        u.grad_storage.zero_()
                    else:  # the unit's first reduction writes it (no zero-fill pass), and
                        u.grad_unwritten = True   # _end_backward zeroes any that none wrote
                        u.attached_from_none = True
            self._forget_dropped_unreduced()
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _count_forward_sums(self) -> None:
        """A backward of forward ``grad_fwd_id`` starts: its forward-output sums now count for the
        step (``fwd_sums``). When every gradient the last backward left was dropped or zeroed since
        (``zero_grad()``, either mode, with no step: a batch thrown away), the sums of the forwards
        that made them go too."""
        kept = any(u.grad_storage is not None and u.master.grad is u.grad_storage
                   and u.grad_storage._version == u.grad_end_version for u in self.units)
        if not kept:
            self.fwd_sums.zero_()
        if self._fwd_pending_id == self.grad_fwd_id:
            self.fwd_sums.add_(self.fwd_pending)
            self.fwd_pending.zero_()
            self._fwd_pending_id = None

    def on_unit_backward_start(self, unit: Unit, fwd_id: int, views: list | None = None) -> None:
        self.begin_backward()
        if fwd_id != self.grad_fwd_id:
            raise OrderError(
                f"backward reached {unit.name} of forward #{fwd_id}, but forward #{self.grad_fwd_id} ran "
                "since; yashard keeps one forward's weights in its buffers: call backward() before the next "
                "grad-enabled forward"
            )
        if unit.master._version != unit.fwd_version:
            raise RuntimeError(
                f"the master weights of {unit.name} changed between forward and backward (an optimizer.step(), "
                "yashard.load_checkpoint or an in-place edit of the shards), and this graph was built with the old "
                "ones; call backward() before changing them, or run the forward again after"
            )
        if unit.kind == "layer":
            last = self._bwd_last_layer
            if last is not None and unit.index >= last:
                raise OrderError(
                    f"backward of {self.spec.layers}.{unit.index} started after {self.spec.layers}.{last}; "
                    "each layer's backward must run once, last layer first"
                )
            self._bwd_last_layer = unit.index
        self._ensure_gathered(unit)
        if views is not None:  # (an activation-checkpointed layer) before the recompute reads them
            unit.restore_backward_views(views)
            if self.small is not None:
                self.small.restore_backward_views()
        nxt = self._next_backward(unit)
        self._prefetch(nxt)

    def _next_backward(self, unit: Unit) -> Unit | None:
        """The next unit whose weights the backward needs (layers in reverse; the embedding needs
        none), if its backward runs (frozen layers that no gradient flows into have none)."""
        nxt = None
        if unit.kind == "layer":
            nxt = self.layers[unit.index - 1] if unit.index > 0 else None
        elif unit is self.lm_head and self.layers:
            nxt = self.layers[-1]
        return nxt if nxt is not None and nxt.fwd_backward else None

    def claim_grad_slot(self, unit: Unit) -> None:
        """Take ``unit``'s grad slot for this backward (R4: after the previous reduction finished)."""
        slot = unit.slot
        if slot.grad_busy is not None:
            slot.grad_busy.wait()
            slot.grad_busy = None
        slot.grad_owner = unit
        unit.grad_claimed = True
        unit.written = [False] * len(unit.layout.entries)

    def on_unit_grads_complete(self, unit: Unit) -> None:
        """All gradients of ``unit`` are in its grad slot: zero the rest and reduce-scatter (R3).
        Over one rank (:func:`direct_grads`) they are in ``master.grad`` already: only the ranges a
        dropped ``master.grad`` still holds stale values in are zeroed.
        A unit frozen in its forward has none: its backward (gradients for its inputs) is over, so
        only its weights are released."""
        self.begin_backward()
        if not unit.fwd_trains or not self.accumulating:
            if unit.kind != "small":
                self._release(unit.slot)
            unit.reduced_in_pass = True
            return
        if not unit.grad_claimed:
            self.claim_grad_slot(unit)
        unit.zero_unwritten()
        slot = unit.slot
        compute = self.streams.compute
        if unit.kind != "small":
            self._release(slot)  # weights no longer read (R1 for re-gathers)
        unit.grad_claimed = False
        unit.reduced_in_pass = True
        if self.direct_grads:  # Narrow added them to master.grad in place: that was the reduction.
            unit.unreduced = not self._fwd_sync  # (no_sync(): a step before a synced backward is refused
            return                               # here too, as it must be on more ranks)
        if not self._fwd_sync:  # no_sync(): the unit's own grad slot keeps accumulating, unreduced
            unit.unreduced = True  # (its grad_storage version is taken at the end of the backward)
            return
        unit.unreduced = False
        ready = self.streams.record(compute)
        n = unit.layout.shard_numel
        if self._last_reduction is not None:
            self._last_reduction.finish()  # R6: it may still be reading the shared output buffer
        bucket = GradBucket(self._bucket_index, unit.name, unit is self.small, self.comm, slot.name,
                            unit.flat_grads(), self._reduce_output, self._workspace, n)
        self._bucket_index += 1
        label = "yashard::norm_group_reduce_scatter" if unit.kind == "small" else "yashard::reduce_scatter"
        what = _What(self._reduction_op, unit.name, self._phase_state(), self._hook_hint)
        with torch.no_grad(), self.streams.comm_context(), labelled(label), self.comm.issuing(what):
            self.streams.comm.wait_event(ready)
            work = self.comm_hook(self.comm_hook_state, bucket)
        if not callable(getattr(work, "wait", None)):
            raise TypeError(
                f"comm hook {getattr(self.comm_hook, '__name__', self.comm_hook)!r} returned "
                f"{type(work).__name__} for {unit.name}; a hook returns a future (torch.futures.Future or "
                "yashard.comm_hooks.WorkFuture) of this rank's reduced shard"
            )
        scale = 1.0 / self.dp_world
        master = unit.master
        replicas = self.comm.replica_group
        gdt = self.config.wire_dtype

        def accumulate(value):  # hybrid all-reduce, then post-divide, in fp32, into the persistent grad
            if not isinstance(value, torch.Tensor) or value.shape != (n,) or not value.is_floating_point():
                raise ValueError(
                    f"comm hook {getattr(self.comm_hook, '__name__', self.comm_hook)!r} gave "
                    + (f"a {tuple(value.shape)} {value.dtype} tensor" if isinstance(value, torch.Tensor)
                       else type(value).__name__)
                    + f" for {unit.name}; its future must hold this rank's shard of the SUM: a 1-D floating "
                    f"tensor of {n} elements"
                )
            with labelled("yashard::post_divide"):
                if replicas is not None:
                    # (a hook's own value, in another dtype or strided: the replica sum in reduce_dtype, dense)
                    if value.dtype != gdt or not value.is_contiguous():
                        value = value.to(gdt).contiguous()
                    self.comm.all_reduce(value, unit.name, replicas)
                if self._discard_reductions:  # a failed backward's, waited for by the next forward
                    return
                if master.grad is None or not master.requires_grad:  # turned off since its forward: as
                    return               # torch, which accumulates no gradient into such a parameter
                if not unit.grad_unwritten:
                    master.grad.add_(value, alpha=scale)
                elif value.dtype == torch.float32:  # = 0 + scale * value, as add_ would give
                    torch.mul(value, scale, out=master.grad)
                else:  # widen first: a product in value's dtype would round
                    master.grad.copy_(value).mul_(scale)
                unit.grad_unwritten = False

        pending = Pending(self.streams, work, accumulate, functools.partial(self.comm.wait, what=what))
        slot.grad_busy = pending
        self._last_reduction = pending
        self.pending.append(pending)

    def _end_backward(self) -> None:
        """Autograd's final callback: reduce the norm group and anything not yet reduced, then wait."""
        try:
            # Units that ran forward with grad but whose gate never fired (their outputs did not reach
            # the loss) still reduce, in a fixed order, so every rank issues the same collectives.
            for u in self.forward_order:
                if u.fwd_id == self.grad_fwd_id and not u.reduced_in_pass:
                    self.on_unit_grads_complete(u)
            if self.norm_group is not None:
                self.norm_group.end_backward()
            self._drain()
            self.streams.current_waits_for_backward()  # (backward() may run on another stream than the forward)
            # Gradients attached at begin_backward that no reduction wrote. Under no_sync() (the unit's
            # own buffer accumulates) they are zeroed: the synced backward adds to them. Otherwise no
            # rank's loss reached any parameter of the unit in this backward (reductions are
            # collective: none ran on any rank), and .grad goes back to None, as torch leaves a
            # parameter no gradient reached, so the optimizer skips the shard (no weight decay, no
            # momentum) exactly where torch skips its parameters.
            unwritten = [u for u in self.units if u.grad_unwritten]
            if unwritten:
                held = [u for u in unwritten if u.unreduced]
                if held:
                    torch._foreach_zero_([u.grad_storage for u in held])
                for u in unwritten:
                    if not u.unreduced:
                        u.master.grad = None
                    u.grad_unwritten = False
            for u in self.units:
                if u.grad_storage is not None:  # a zero_grad from now on changes it: see begin_backward
                    u.grad_end_version = u.grad_storage._version
                if u.unreduced:
                    u.unreduced_version = u.grad_storage._version
                if u.views_until == "backward":
                    u.remove_views()
        except BaseException:
            # (a reduction that failed, say a comm hook's future: in_backward stays set, so the step
            # refuses these incomplete gradients and the next forward recovers, as after any backward
            # that raised)
            self.backward_pending = False
            raise
        self.in_backward = False
        self.backward_pending = False

    def _recover_from_failed_backward(self) -> None:
        """Run by the next forward when a backward raised (autograd then drops its final callback,
        :meth:`_end_backward`): its reductions in flight are waited for and thrown away, every
        gradient is zeroed (every ``.grad`` still set, which over one rank the failed backward has
        partly written already: a ``zero_grad(set_to_none=True)`` since stays; under ``no_sync()``
        what the unit buffers accumulated is dropped too), and the runtime
        is reset, so the next backward starts clean and the same on every device: the step the
        failed micro-batch belonged to is lost, as after ``zero_grad()`` (the "skip the batch that ran
        out of memory" pattern). Until then the step, ``clip_grad_norm_`` and ``full_grads`` refuse
        (:meth:`check_grads_reduced`). It needs every rank to have failed alike: a rank that raised
        alone leaves the others waiting in a collective."""
        logger.warning("yashard: the previous backward did not finish (it raised); every gradient is zeroed and "
                       "the runtime is reset for the next backward (the step it belonged to is lost)")
        self._discard_reductions = True
        try:
            self._drain()
        finally:
            self._discard_reductions = False
            attached = [u.master.grad for u in self.units if u.master.grad is not None]  # (a .grad the
            # user assigned too: the failed backward may have added to it, as it may to grad_storage)
            if attached:
                torch._foreach_zero_(attached)
            for u in self.units:
                u.grad_unwritten = False
                u.grad_claimed = False
                u.reduced_in_pass = False
                u.unreduced = False  # (a no_sync() accumulation: the next backward writes afresh)
                if u.views_until == "backward":
                    u.remove_views()
                u.backward_views = None
            for slot in self.slots.values():
                slot.grad_owner = None
            self.in_backward = False
            self.backward_pending = False

    def _drain(self) -> None:
        """Wait for every reduction in flight and, on CPU, every gather (compute waits on CUDA;
        the host waits on CPU).

        On CUDA a gather's :class:`Pending` is ``done`` from its issue on and is not waited for
        here: compute waits for it where the weights are used, so the gathers issued after the
        optimizer step keep overlapping the next forward. One that is never used (a prefetch the
        forward did not reach) may still read its shard while the optimizer or ``_refresh_sources``
        writes it; its result is then thrown away, since it is used only while the masters keep the
        version it was gathered at (``gathered_version``)."""
        with labelled("yashard::drain"):
            for u in self.units:
                if u.gathered is not None and not u.gathered.done:
                    u.gathered.wait()
            while self.pending:
                p = self.pending.pop(0)  # (off the list first: a failed reduction is not waited for twice)
                if self._discard_reductions and p.failed is not None:
                    continue  # (its error is the one the backward raised)
                try:
                    p.wait()
                except BaseException as e:
                    if not self._discard_reductions:
                        raise  # (the backward raises: the next forward recovers, waiting for the rest)
                    logger.warning("yashard: a reduction of the backward that raised failed too, and is "
                                   "thrown away: %s", str(e).splitlines()[0] if str(e) else type(e).__name__)
        self._last_reduction = None
        for slot in self.slots.values():
            slot.grad_busy = None

    def _reduce_output(self, n: int) -> torch.Tensor:
        """The first ``n`` elements of the reduce-scatter output shared by every bucket (R6)."""
        if self.reduce_out is None:
            self.reduce_out = torch.empty(self._reduce_out_numel, dtype=self.config.wire_dtype, device=self.device)
        return self.reduce_out.narrow(0, 0, n)

    def _workspace(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A comm hook's persistent scratch buffer (see ``GradBucket.workspace``): one per name and
        dtype (hooks that mix dtypes under one name, say the default hook's fp32 scratch beside a
        16-bit one, get one buffer each, so memory stays fixed), grown to the largest request."""
        first = self._workspaces.get(name)
        key = name if first is None or first.dtype == dtype else f"{name}[{str(dtype).replace('torch.', '')}]"
        buf = self._workspaces.get(key)
        if buf is None or buf.numel() < numel:
            if self._hook_planned:
                logger.warning("yashard: comm hook %s asked for workspace %r of %d %s, more than its workspace_plan "
                               "said; allocated now (memory_plan() lists it from here on). Fix the hook's plan",
                               getattr(self.comm_hook, "__name__", self.comm_hook), key, numel, dtype)
            buf = self._workspaces[key] = torch.empty(numel, dtype=dtype, device=self.device)
        return buf.narrow(0, 0, numel)

    def _plan_hook_workspaces(self) -> None:
        """Allocate what the comm hook says it will ask for (its ``workspace_plan``, see
        :mod:`yashard.comm_hooks`) on every unit's bucket, so the memory plan holds it before step
        one and the first backward allocates nothing. A hook without a plan allocates at its first call."""
        self._hook_planned = False
        plan = getattr(self.comm_hook, "workspace_plan", None)
        if plan is None:
            return
        by_unit = _takes_keyword(plan, "unit")  # (a plan that treats units differently: see comm_hooks)
        for u in self.units:
            if u.grad_storage is None:  # (never reduced: all its parameters frozen)
                continue
            args = (self.comm_hook_state, self.comm, u.layout.padded, self.config.wire_dtype)
            for name, numel, dtype in plan(*args, unit=u.name) if by_unit else plan(*args):
                if name == "output":
                    self._reduce_output(0)
                else:
                    self._workspace(name, numel, dtype)
        self._hook_planned = True

    def check_no_sync(self) -> None:
        """Refuse ``no_sync()`` where unreduced gradients cannot be held exactly. Over one rank
        (:func:`direct_grads`) they accumulate in ``master.grad`` itself: nothing to refuse."""
        if self.direct_grads:
            return
        if self.config.reshard_after_forward:
            raise RuntimeError(
                "model.no_sync() needs ShardConfig(reshard_after_forward=False): by default the decoder layers take "
                "turns in two gradient buffers, so a layer's gradients must be reduced before the layer two below "
                "writes its own. Shard with reshard_after_forward=False (every unit keeps a buffer of its own; "
                "memory_plan() shows the cost) or drop no_sync() (reducing every micro-batch gives the same gradients)"
            )
        if self.config.wire_dtype != torch.float32:
            raise RuntimeError(
                f"model.no_sync() would add micro-batches' gradients in the reduce_dtype="
                f"{str(self.config.wire_dtype).replace('torch.', '')} gradient buffers, rounding at every micro-batch; "
                "use ShardConfig(reduce_dtype=torch.float32) or drop no_sync() (each micro-batch's reduced gradient "
                "is then accumulated in fp32)"
            )

    def check_no_new_parameters(self) -> None:
        """Raise if the HF module holds a parameter again (``yashard.shard`` took them all): one added
        after sharding (a module replaced, say) is neither sharded nor reduced across ranks.

        The full walk runs when a module's parameters or children differ from the last walk's
        (a parameter set, a module added or replaced, anywhere in the model); otherwise a snapshot
        comparison (identity of each module's entries) stands for it."""
        snapshot = self._structure
        if snapshot is not None and all(tuple(m._parameters.values()) == params and tuple(m._modules.values()) == kids
                                        for m, params, kids in snapshot):
            return
        name, p = next(iter(nn.Module.named_parameters(self.model)), (None, None))  # (not the shards it answers)
        if name is not None:
            raise RuntimeError(
                f"{name} (shape {tuple(p.shape)}) is a parameter of the sharded model that yashard.shard did not shard: "
                "it was added afterwards (a module replaced or appended?), so its gradient is never reduced across "
                "ranks and the ranks' copies drift apart. Make the change before yashard.shard (shard the changed "
                "model), or freeze it as a buffer"
            )
        self._structure = [(m, tuple(m._parameters.values()), tuple(m._modules.values())) for m in self.model.modules()]

    def _forget_dropped_unreduced(self) -> None:
        """A ``zero_grad()`` since a ``no_sync()`` backward drops what it accumulated, as in DDP: the
        unit's ``.grad`` was set to None (or another tensor), or zeroed (its version moved)."""
        for u in self.units:
            if u.unreduced and (u.grad_unwritten or u.master.grad is not u.grad_storage
                                or u.grad_storage._version != u.unreduced_version):
                u.unreduced = False

    def check_grads_reduced(self, what: str) -> None:
        """Raise if a ``no_sync()`` backward left gradients that were never reduced across ranks, or
        if the last backward raised (its gradients are incomplete until the next forward resets)."""
        if self.in_backward:
            raise RuntimeError(
                f"{what} after a backward that raised: its gradients are incomplete (some reductions never ran). "
                "Call optimizer.zero_grad() and go on with the next batch: its forward resets the runtime"
            )
        self._forget_dropped_unreduced()
        held = [self.module_name(u) for u in self.units if u.unreduced]
        if held:
            names = _some_names(held)
            raise RuntimeError(
                f"{what} after a backward inside model.no_sync(): the gradients of {names} were accumulated on "
                "this rank but never reduced across ranks. Run the last micro-batch's forward and backward outside "
                "no_sync() (that backward reduces everything accumulated), or zero_grad() to drop them"
            )

    def register_comm_hook(self, state, hook) -> None:
        """Replace how each unit's gradients are reduced (contract in :mod:`yashard.comm_hooks`)."""
        if not callable(hook):
            raise TypeError(f"register_comm_hook needs a callable hook(state, bucket), got {type(hook).__name__}")
        if self._hook_registered:
            raise RuntimeError(
                f"a comm hook ({getattr(self.comm_hook, '__name__', self.comm_hook)}) is already registered; "
                "register one hook, once, before the first forward"
            )
        if self.grad_fwd_id > 0:
            raise RuntimeError(
                "register_comm_hook must be called before the first forward (gradients of earlier steps "
                "were reduced by the default hook)"
            )
        self._check_same_hook(state, hook)
        if self._loaded_hook_state is not None:  # load_checkpoint came first: resume this hook's state now
            self._load_hook_state(state, self._loaded_hook_state)  # (raises before anything is registered)
            self._loaded_hook_state = None
        bf16 = [f"{k}=bfloat16" for k, d in (("param_dtype", self.config.param_dtype),
                                             ("reduce_dtype", self.config.wire_dtype)) if d == torch.bfloat16]
        if hook is fp16_compress_hook and bf16 and self.comm.rank == 0:
            logger.warning(
                "yashard: fp16_compress_hook with %s: the gradients go over the wire in float16, whose range "
                "(largest 65504, smallest normal 6.1e-05) is far narrower than bfloat16's, and a bf16 run has no "
                "loss scaling to keep them inside it, so large gradients overflow to inf and small ones flush "
                "toward zero: use bf16_compress_hook (16 bits on the wire too, with bfloat16's range)", " and ".join(bf16))
        if self.direct_grads:  # a hook reduces from the gradient slots: give them their buffers
            self._allocate_grad_slots()
        self.comm_hook, self.comm_hook_state = hook, state
        name = getattr(hook, "__name__", "comm hook")
        self._reduction_op = f"gradient reduction ({name})"
        if not (getattr(hook, "__module__", None) or "").startswith("yashard."):  # the user's own hook
            self._hook_hint = (
                f"The comm hook {name} (register_comm_hook) raised this, or returned a future that did: look "
                "there first. If it came from a collective the hook issued, a peer rank died, stalled, or issued "
                "a different sequence of collectives: look for the first error on the other ranks"
            )
        self._hook_registered = True
        self._workspaces.clear()  # the default hook's buffers; the new hook asks for its own
        self._plan_hook_workspaces()

    def hook_state_dict(self) -> dict | None:
        """The comm hook's state to save (``QgzState``'s rounding position), where it has one; a
        loaded one still waiting for its hook travels on."""
        if self._loaded_hook_state is not None:
            return self._loaded_hook_state
        get = getattr(self.comm_hook_state, "state_dict", None)
        return get() if callable(get) else None

    def restore_hook_state(self, state_dict: dict | None) -> None:
        """Give a checkpoint's comm hook state (``state.state_dict()`` at the save; None: it had none)
        to the registered hook's state, or keep it for a hook registered later (before the first
        forward): the order of ``load_checkpoint`` and ``register_comm_hook`` does not matter. A
        state that nothing can take is warned about, never silently dropped."""
        if not self._hook_registered:
            self._loaded_hook_state = state_dict  # (a later load replaces an earlier one's, None included)
            if state_dict is not None and self.grad_fwd_id > 0:  # too late to register a hook for it
                self._drop_loaded_hook_state(late=True)
        elif state_dict is not None:
            self._load_hook_state(self.comm_hook_state, state_dict)

    def _load_hook_state(self, state, state_dict: dict) -> None:
        load = getattr(state, "load_state_dict", None)
        if not callable(load):
            if self.comm.rank == 0:
                logger.warning(
                    "yashard: the checkpoint carries comm hook state %s, but the registered hook's state (%s) has no "
                    "load_state_dict, so it starts afresh: register the hook and state the run was saved with "
                    "(for example comm_hooks.QgzState with qgz_hook) to resume it", _brief(state_dict),
                    type(state).__name__)
            return
        try:
            load(state_dict)
        except Exception as e:  # noqa: BLE001 - re-raised with both sides named
            raise ValueError(
                f"the checkpoint's comm hook state {_brief(state_dict)} does not load into the hook state "
                f"{type(state).__name__} ({type(e).__name__}: {e}): register the hook and state the run was saved "
                "with, or one whose load_state_dict takes this") from e

    def _drop_loaded_hook_state(self, late: bool = False) -> None:
        """A forward ran without a hook to take a checkpoint's comm hook state: say so."""
        state_dict, self._loaded_hook_state = self._loaded_hook_state, None
        if self.comm.rank == 0:
            fix = ("load the checkpoint into a freshly sharded model and call register_comm_hook with the run's hook "
                   "before its first forward" if late else
                   "call register_comm_hook with the run's hook before the first forward")
            logger.warning(
                "yashard: the checkpoint was saved with a stateful comm hook (state %s), but no hook was registered "
                "before the first forward, so gradients are reduced by the default hook: to resume it, %s",
                _brief(state_dict), fix)

    def _allocate_grad_slots(self) -> None:
        """Leave the in-place gradient path (:func:`direct_grads`): before the first forward, the
        slots get the gradient buffers they would have had from ``shard()`` on."""
        self.direct_grads = False
        for name, slot in self.slots.items():
            slot.grad_numel = self._slot_grad_sizes[name]
            slot.grads = torch.zeros(slot.grad_numel, dtype=self.config.wire_dtype, device=self.device)
        for u in self.units:
            u._grad_views = u._flat_grads = None
        self.streams.share_with_comm([s.grads for s in self.slots.values()])

    def _check_same_hook(self, state, hook) -> None:
        """Every rank must reduce with the same hook and state settings, or their collectives
        differ in size (a crash inside the backend, blamed on a peer): compare them, as ``shard()``
        compares the ``ShardConfig``."""
        settings = getattr(state, "settings", None)
        mine = (getattr(hook, "__module__", "?") + "." + getattr(hook, "__name__", type(hook).__name__),
                type(state).__qualname__, repr(settings() if callable(settings) else None))
        every = self.comm.all_gather_object(mine, "register_comm_hook (same hook on every rank)")
        for r, theirs in enumerate(every):
            if theirs != mine:
                raise ValueError(
                    f"register_comm_hook: this rank (rank {self.comm.rank}) registers hook {mine[0]} with state "
                    f"{mine[1]} {mine[2]}, rank {r} hook {theirs[0]} with state {theirs[1]} {theirs[2]}; every rank "
                    "must register the same hook with the same settings"
                )

    def module_name(self, unit: Unit) -> str:
        """The HF path of ``unit`` ("model.layers.3", "lm_head", ...), for messages."""
        if unit.kind == "layer":
            return f"{self.spec.layers}.{unit.index}"
        return {"embed": self.spec.embed, "lm_head": self.spec.lm_head}.get(unit.name, "the norm group")

    # ------------------------------------------------------------------ user-facing helpers
    def memory_plan(self) -> MemoryPlan:
        return plan_memory(self)

    def allocated_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor the runtime holds, by name (what the memory plan accounts for)."""
        out = {}
        for slot in self.slots.values():
            for k, t in slot.tensors().items():
                out[f"slot.{slot.name}.{k}"] = t
        if self.reduce_out is not None:
            out["reduce_out"] = self.reduce_out
        if self.qwz_workspace is not None:
            out["qwz_workspace"] = self.qwz_workspace
        for u in self.units:
            out[f"{u.name}.master"] = u.master
            if u.grad_storage is not None:
                out[f"{u.name}.grad"] = u.grad_storage
            if u.frozen_values is not None:
                out[f"{u.name}.frozen_values"] = u.frozen_values
            if u.gather_src is not u.master:
                out[f"{u.name}.gather_src"] = u.gather_src
            if u.secondary is not None:
                out[f"{u.name}.secondary"] = u.secondary
        for name, t in self._workspaces.items():
            out[f"comm_hook.{name}"] = t
        return out

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip every gradient shard by the global norm (a collective over the shard group);
        returns the norm before clipping. No temporary the size of a shard is allocated (see
        :func:`_squares_per_tensor`). Records which units' gradients were finite
        (:meth:`grads_finite`). ``error_if_nonfinite``: raise, before clipping, if the norm is not
        finite (as torch's; it reads the norm on the host)."""
        self.check_grads_reduced("clip_grad_norm_")
        norm_type = float(norm_type)
        grads = [u.master.grad for u in self.units if u.master.grad is not None]
        if not (0.0 < norm_type <= math.inf):
            raise ValueError(f"clip_grad_norm_ norm_type={norm_type}: use a p-norm with p > 0 (2, 1, ...) or inf")
        if math.isnan(float(max_norm)) or float(max_norm) < 0:  # (torch's would scale by NaN, or flip the sign)
            raise ValueError(f"clip_grad_norm_ max_norm={max_norm}: it must be a number >= 0 (inf: no clipping, "
                             "only the norm)")
        zero = torch.zeros((), device=self.device)
        if norm_type == math.inf:
            parts = torch.stack(torch._foreach_norm(grads, math.inf)) if grads else zero.view(1)
            local = parts.max().float()
            # (a NaN travels as a flag beside the max: a backend's max may keep either operand when one
            # is NaN, gloo's keeps the finite one when the NaN comes second)
            nan = torch.isnan(local)
            both = torch.stack([torch.where(nan, zero, local), nan.float()])
            self.comm.all_reduce(both, "clip_grad_norm", op="max")  # replicas hold the same shards
            total = torch.where(both[1] > 0, torch.full_like(both[0], math.nan), both[0])
        else:  # sum over every rank's shards of |g|^p, then the p-th root
            parts = _powers_per_tensor(grads, norm_type) if grads else zero.view(1)
            sq = parts.sum().float()
            self.comm.all_reduce(sq, "clip_grad_norm")  # over the shard group: replicas are identical
            total = sq.sqrt() if norm_type == 2.0 else sq.pow(1.0 / norm_type)
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite, so it cannot be "
                               "clipped (error_if_nonfinite=True); the gradients are left as they are")
        coef = (float(max_norm) / (total + 1e-6)).clamp(max=1.0)
        if grads:
            # Which units' gradients were finite, read off the partial norms before the product
            # spreads a NaN to every gradient: the step check uses them (grads_finite).
            flags = iter(torch.isfinite(parts).unbind())
            finite = self._per_unit(lambda g: next(flags))
            torch._foreach_mul_(grads, coef)
            self._clip_finite = (finite, self._grad_versions())
        return total

    def has_grad_scaler(self) -> bool:
        """Whether an enabled :class:`yashard.ShardedGradScaler` of this model is alive."""
        return len(self.grad_scalers) > 0

    def _grad_versions(self) -> tuple:
        return tuple(None if u.master.grad is None else (id(u.master.grad), u.master.grad._version) for u in self.units)

    @torch.no_grad()
    def grads_finite(self) -> torch.Tensor:
        """Per unit (``unit.order``), whether its master gradient holds no NaN/inf (a unit without
        one counts as finite); a bool tensor on the device, no host sync. Read off the last
        :meth:`clip_grad_norm_`'s partial norms if the gradients have not changed since (no pass over
        them: a norm that is not finite means a NaN/inf, or values so large their squares overflow,
        which would have zeroed every gradient), else one summing pass per unit."""
        if self._clip_finite is not None and self._clip_finite[1] == self._grad_versions():
            return self._clip_finite[0]
        return self._per_unit(lambda g: ~_nonfinite(g))

    def _per_unit(self, flag) -> torch.Tensor:
        """``flag(unit.master.grad)`` (a 0-d bool) for each unit, in ``self.units`` order (= ``order``),
        True where a unit has no gradient; stacked on the device (an index tensor built on the host
        would be a copy that waits for the GPU)."""
        true = torch.ones((), dtype=torch.bool, device=self.device)
        return torch.stack([true if u.master.grad is None else flag(u.master.grad) for u in self.units])

    @torch.no_grad()
    def gather_full(self, what: str = "params") -> dict[str, torch.Tensor]:
        """Full fp32 tensors by HF name, gathered from every rank (a collective: call on all ranks)."""
        if what == "grads":
            self.check_grads_reduced("full_grads()")
        out: dict[str, torch.Tensor] = {}
        for u in self.units:
            if what == "params":
                shard = u.master.detach()
            elif what == "grads":
                shard = u.master.grad if u.master.grad is not None else torch.zeros_like(u.master)
            else:
                raise ValueError(f"what must be 'params' or 'grads', got {what!r}")
            flat = torch.empty(u.layout.padded, dtype=torch.float32, device=self.device)
            self.comm.wait(self.comm.all_gather(flat, shard.contiguous(), u.name), f"all_gather of {u.name} ({what})", host=True)
            for entry, fqns in zip(u.layout.entries, u.fqns):
                t = flat[entry.offset : entry.end].view(entry.shape).clone()
                for fqn in fqns:
                    out[fqn] = t
        return out

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def _brief(state_dict: dict, limit: int = 120) -> str:
    text = repr(state_dict)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _takes_keyword(fn, name: str) -> bool:
    """Whether ``fn`` accepts the keyword argument ``name`` (False when its signature is unreadable)."""
    import inspect

    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params and params[name].kind in (inspect.Parameter.KEYWORD_ONLY,
                                                    inspect.Parameter.POSITIONAL_OR_KEYWORD) \
        or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def direct_grads(direct: bool, dp_world: int, config: ShardConfig) -> bool:
    """Over one data-parallel rank with direct slots and fp32 reductions, reducing a unit's gradients
    is adding them to its master gradient: ``Narrow`` writes them there in place (no gradient slot,
    no copy, no reduction). A registered comm hook turns this off (it reduces from the slots)."""
    return direct and dp_world == 1 and config.wire_dtype == torch.float32


def direct_slots(shard_world: int, config: ShardConfig) -> bool:
    """Over one rank a shard is its whole unit: the slots show the units' own shards (no gather
    copies, no weight buffers), unless qwZ or hpZ are asked for (they change what is gathered)."""
    return shard_world == 1 and not config.quantized_weights and config.secondary_group_size is None


def _checkpointed_forward(module: nn.Module, inner, *args, **kwargs):
    """Activation checkpointing of one decoder layer, inside yashard's hooks.

    The hooks (gather, gate, views) run once outside the checkpointed region; the recompute in
    backward re-reads the same parameter views, whose slot was re-gathered by the layer's
    ``BackwardEntry`` before any of its backward ops run. As transformers' own checkpointing, only
    a layer in training mode with grad enabled is checkpointed (an evaluation with grad on, a cached
    decode among them, runs as is). A KV cache is not passed in (the recompute would write it a
    second time), whatever transformers calls it, unless the layer declares it only reads the cache
    (``_can_checkpoint_with_cache``, transformers >= 5.24); one already holding tokens is refused,
    since dropping it would attend without them.
    """
    if not (torch.is_grad_enabled() and module.training):
        return inner(*args, **kwargs)
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    if not getattr(module, "_can_checkpoint_with_cache", False):
        for name in _CACHE_KWARGS:
            cache = kwargs.get(name)
            if cache is None:
                continue
            tokens = _cached_tokens(cache)
            if tokens:
                raise ValueError(
                    f"{type(module).__name__} is checkpointed (ShardConfig.checkpoint_layers) and was given a KV cache "
                    f"holding {tokens} token(s) in training mode; a recomputed layer cannot write a "
                    "cache, and dropping it would attend without those tokens. Call model.eval() to continue from a "
                    "cache with grad on (transformers does not checkpoint then either), or checkpoint fewer layers"
                )
            kwargs[name] = None
    return torch.utils.checkpoint.checkpoint(inner, *args, use_reentrant=False, **kwargs)


def _cached_tokens(cache) -> int:
    """How many tokens a transformers ``Cache`` holds in any layer (0 for anything else: nothing
    to lose)."""
    length = getattr(cache, "get_seq_length", None)
    if not callable(length):
        return 0
    try:
        return max(int(length(i)) for i in range(max(len(cache), 1)))
    except Exception:  # noqa: BLE001 - a cache whose length cannot be read here: treated as empty
        return 0


def _no_cache_when_checkpointing(module: nn.Module, args, kwargs):
    """A training forward with grad on of a model with checkpointed layers builds no KV cache, as
    transformers turns ``use_cache`` off under its own checkpointing: the checkpointed layers cannot
    write one, so a cache returned would hold only the other layers' tokens."""
    if module.training and torch.is_grad_enabled() and kwargs.get("use_cache") is not False:
        kwargs["use_cache"] = False
        return args, kwargs
    return None


# What a decoder layer's KV-cache argument is called: ``past_key_values`` (transformers 4.57-5.23),
# ``past_key_value`` (older 4.x layers), ``cache`` (5.24 and later), ``layer_past`` (GPT-style).
_CACHE_KWARGS = ("past_key_values", "past_key_value", "cache", "layer_past")


class _What:
    """Names a collective for error messages, formatted only when one is raised; ``hint`` (if set)
    replaces the usual advice (see :func:`yashard.collectives.collective_failure`)."""

    __slots__ = ("op", "unit", "state", "hint")

    def __init__(self, op: str, unit: str, state: tuple[bool, bool, int], hint: str | None = None):
        self.op, self.unit, self.state, self.hint = op, unit, state, hint

    def __str__(self) -> str:
        in_backward, grad, fwd = self.state
        phase = (f"backward of forward #{fwd}" if in_backward else f"forward #{fwd}" if grad else "no-grad forward")
        return f"{self.op} of {self.unit} ({phase})"


def _powers_per_tensor(ts: list[torch.Tensor], p: float) -> torch.Tensor:
    """1-d, one element per tensor of ``ts``: the sum of ``|x|**p`` over its elements, accumulated
    in fp64 (fp32 on devices without it); :func:`_squares_per_tensor` for ``p == 2``. Other ``p``
    (rare) read 64K-element slices on the CPU, with a temporary of one slice."""
    if p == 2.0:
        return _squares_per_tensor(ts)
    if ts[0].device.type != "cpu":
        acc = torch.float64 if ts[0].device.type == "cuda" else torch.float32
        return torch.stack(torch._foreach_norm(ts, p)).to(acc).pow(p)
    return torch.stack([torch.stack([c.abs().pow_(p).sum(dtype=torch.float64) for c in t.split(1 << 16)]).sum()
                        for t in ts])


def _squares_per_tensor(ts: list[torch.Tensor]) -> torch.Tensor:
    """1-d fp64 (fp32 on devices other than CPU and CUDA): for each flat fp32 shard of ``ts``, the
    sum of the squares of its elements, with no temporary the size of a shard.

    ``t.pow(2).sum()`` allocates a temporary as large as ``t`` (a whole layer's shard). On CUDA the
    norm kernels reduce as a tree with no temporary, so one ``_foreach_norm`` does it. torch's CPU
    norm kernels (``vector_norm``, ``_foreach_norm``) accumulate long fp32 tensors with a relative
    error near 1e-4 (measured on 7.8M elements), so on CPU each slice of 2**16 elements is one
    ``dot(c, c)`` (BLAS: reads the slice once, allocates nothing; relative error near 2e-8 on a
    15.7M-element shard, 6x faster than squaring and summing 2**20-element slices) and the slices'
    sums are added in fp64."""
    if ts[0].device.type != "cpu":  # fp64 where the device has it (not MPS, not every XPU)
        acc = torch.float64 if ts[0].device.type == "cuda" else torch.float32
        return torch.stack(torch._foreach_norm(ts, 2.0)).to(acc).pow(2)
    return torch.stack([torch.stack([torch.dot(c, c) for c in t.split(1 << 16)]).sum(dtype=torch.float64)
                        for t in ts])


def _other_sharding(model: nn.Module) -> str | None:
    """What already distributes ``model``'s parameters, if anything does: FSDP2 (``fully_shard``),
    FSDP1, DeepSpeed ZeRO-3, or DTensor parameters (tensor parallelism)."""
    from torch.distributed.tensor import DTensor

    for name, m in model.named_modules():
        kind = type(m).__name__
        if kind.startswith("FSDP") or kind == "FullyShardedDataParallel":
            return f"FSDP ({kind} at {name or 'the root'})"
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            return f"DTensor parameters ({name}: FSDP2's fully_shard or tensor parallelism)"
        if hasattr(p, "ds_id"):
            return f"DeepSpeed ZeRO-3 ({name} is partitioned)"
    return None


_MARKED_CLASSES: dict[type, type] = {}


def _in_compiled_autograd() -> bool:
    """Whether this backward is being captured by compiled autograd."""
    ca = getattr(getattr(torch, "_dynamo", None), "compiled_autograd", None)
    return bool(getattr(ca, "in_compiled_autograd_region", False))


def _opaque(hook):
    """A forward hook that ``torch.compile`` runs as it is, outside any graph.

    The hooks gather, install views, issue collectives and move the runtime's state on: Python
    side effects that Dynamo would either trace into (recompiling per layer, since each unit is
    another object) or break on anyway. Disabled, each is one clean graph break, and the module
    bodies between them (a decoder layer's forward) compile on the views the hook installed."""
    return torch.compiler.disable(hook)


def _module_requires_grad(runtime_ref, self, requires_grad: bool = True):
    """``requires_grad_`` of every submodule of a sharded HF model. Its parameters now live in
    master shards that hold other modules' parameters too, and which parameters train is fixed
    at ``shard()``: freezing one now (``False``) would freeze nothing, and unfreezing (``True``)
    parameters frozen then would train nothing, so both raise; ``True`` on trainable ones is a no-op."""
    if not requires_grad:
        raise ValueError(
            f"{type(self).__name__}.requires_grad_(False) on a yashard-sharded model: which parameters train is "
            "fixed when yashard.shard runs (this module's parameters now live in master shards shared with other "
            "modules), so this would freeze nothing. Freeze them before yashard.shard (module.requires_grad_(False) "
            "on the unsharded model), or turn a whole master shard off (a tensor of model.parameters())"
        )
    rt = runtime_ref()
    mine = {id(m) for m in self.modules()}
    units = rt.units if rt is not None else ()
    frozen = [fqns[0] for u in units for ok, locs, fqns in zip(u.trainable, u.locations, u.fqns)
              if not ok and any(id(m) in mine for m, _ in locs)]
    if frozen:
        names = _some_names(frozen)
        raise ValueError(
            f"{type(self).__name__}.requires_grad_(True) on a yashard-sharded model: {names} were frozen "
            "(requires_grad=False) when yashard.shard ran and stay frozen (they have no gradient storage). Leave them "
            "unfrozen before yashard.shard to train them"
        )
    return nn.Module.requires_grad_(self, requires_grad)


def _mark_sharded(module: nn.Module, attr: str, fqn: str, shape: torch.Size, unit: Unit, entry: int) -> None:
    """Give ``module`` (an HF submodule that lost parameter ``attr`` to a shard) a same-named
    subclass of its class whose attribute ``attr``, while no view of the running unit is installed,
    is a :class:`~yashard.stub.ShardedStub`: the parameter's shape, the dtype and device its unit
    computes in, whether it trains, and no values (``print(model)`` reads shapes; HF forwards read
    an embedding's device or the head's dtype from outside its unit)."""
    cls = type(module)
    if cls not in _MARKED_CLASSES.values():
        def __getattr__(self, name):
            try:
                return cls.__getattr__(self, name)
            except AttributeError:
                fqn, shape, unit_ref, entry = self.__dict__.get("_yashard_sharded", {}).get(name, (None,) * 4)
                if fqn is None:
                    raise
                u = unit_ref()
                if u is None:  # (its runtime is gone)
                    raise AttributeError(sharded_message(fqn)) from None
                return ShardedStub(fqn, shape, u.rt.config.param_dtype, u.rt.device,
                                   u.trainable[entry] and u.master.requires_grad)

        module.__class__ = same_named_subclass(cls, _MARKED_CLASSES, {"__getattr__": __getattr__})
    module.__dict__.setdefault("_yashard_sharded", {})[attr] = (fqn, torch.Size(shape), unit.ref, entry)


def _nonfinite(t: torch.Tensor) -> torch.Tensor:
    """0-d bool: does ``t`` hold a NaN or inf? (One fp32 sum: NaN and inf propagate through it; no
    tensor of ``t``'s size is allocated.)"""
    return ~torch.isfinite(t.sum(dtype=torch.float32))


def _keep_secondary(secondary: torch.Tensor, gathered: torch.Tensor, position: int, _result=None) -> None:
    """hpZ: keep slice ``position`` of a freshly gathered unit for the backward re-gather."""
    m = secondary.numel()
    secondary.copy_(gathered.narrow(0, position * m, m))
