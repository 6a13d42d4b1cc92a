"""The runtime: the composition root that wires one sharded model's components together.

Data flows one way: ``ShardConfig`` + ``ModelSpec`` -> the partition of parameters into units
(:mod:`yashard.partition`) -> per-unit ``FlatLayout`` and ``Slot`` buffers (:mod:`yashard.build`)
-> master shards (:mod:`yashard.masters`) -> the schedules' hooks on the HF modules
(:mod:`yashard.forward`, :mod:`yashard.backward`) -> gathers and reductions
(:mod:`yashard.gathers`, :mod:`yashard.reduction`) -> collectives. The components share one small
:class:`~yashard.pass_state.PassState` and get what else they need as arguments: none of them holds
a reference to the runtime. The stream/event rules R1-R6 are stated in :mod:`yashard.events`; the
checks run around optimizer steps are in :mod:`yashard.guards`.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from . import build, guards, integrity, masters, partition
from .backward import BackwardSchedule
from .collectives import Comm
from .comm_hook_registry import CommHookRegistry
from .config import ShardConfig
from .errors import OrderError
from .events import Streams, labelled
from .forward import ForwardSchedule
from .fused_head import FusedHead
from .gathers import Gathers
from .grad_norm import ForwardSums, GradNorms
from .memory import MemoryInputs, MemoryPlan, SlotSize, UnitSize, plan_memory
from .norm_group import NormGroup
from .pass_state import PassState
from .patch.spec import ModelSpec
from .reduction import Reducer
from .unit import Unit

__all__ = ["Runtime", "OrderError"]


class Runtime:
    """Owns the units, slots, streams and hooks of one sharded model."""

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

        partition.validate(model, spec, config)
        build.warn_idle_settings(config, comm)
        groups = partition.partition(model, spec)
        partition.check_same_model(comm, config, groups)
        layouts = build.layouts_of(groups, self.world, config)
        self.direct = build.direct_slots(self.world, config)
        slot_of, sizes, grad_sizes = build.slot_sizes(groups, layouts, config, self.direct)
        self.state = PassState(direct_grads=build.direct_grads(self.direct, self.dp_world, config))
        compact = build.compact_grads(config, self.world, self.direct)
        self.slots, self.shared = build.make_slots(sizes, grad_sizes, self.world, config, device, self.direct,
                                                   self.state.direct_grads, compact,
                                                   n_layers=sum(k.startswith("layer_") for k in groups),
                                                   packed=build.packed_slots(groups, slot_of))
        self.reducer = Reducer(comm, config, self.streams, self.state,
                               max(grad_sizes[name] for name in self.slots) // self.world, device,
                               build.staging_chunk(grad_sizes, self.world, config) if compact else 0)
        self.gathers = Gathers(comm, config, self.streams, self.state, self.slots, device)
        shards = masters.materialise(model, weights, comm, config, groups, layouts, device)
        unit_set, removed = build.make_units(groups, layouts, self.slots, slot_of, shards, config, self.state,
                                             comm.shard_rank, device, self.direct, spec)
        self.units: list[Unit] = unit_set.units
        self.layers: list[Unit] = unit_set.layers
        self.forward_order: list[Unit] = unit_set.forward_order
        self.embed, self.lm_head, self.small = unit_set.embed, unit_set.lm_head, unit_set.small
        self.adapters = unit_set.adapters     # the adapter group (PEFT adapters), or None
        self.resident: list[Unit] = unit_set.resident  # gathered per forward, reduced per backward
        self.reducer.plan_workspaces(self.units)  # the default hook's: a receive buffer on gloo over > 2 ranks
        self.comm_hooks = CommHookRegistry(self.reducer, comm, config, self.state, self.streams, self.units,
                                           self.slots, grad_sizes, device)

        self.sums = ForwardSums(len(self.units), device)
        self.norms = GradNorms(self.units, comm, device)
        self.backward = BackwardSchedule(spec, self.state, unit_set, self.slots, self.streams, self.gathers,
                                         self.reducer, self.sums, self.drain)
        self.norm_group = (NormGroup(self.resident, self.gathers.prefetch, self.backward.on_unit_grads_complete)
                           if self.resident else None)
        self.backward.norm_group = self.norm_group
        self.backward.steps_in_backward = config.step_in_backward
        self.step_optimizer = None  # ShardConfig.step_in_backward: the OptimizerInBackward (set_step_optimizer)
        for u in self.units:
            u.backward = self.backward
        self.forward = ForwardSchedule(model, spec, config, self.state, unit_set, self.gathers, self.norm_group,
                                       self.sums, self._begin_forward, self._first_grad_forward)
        self.new_parameters = integrity.NewParameterCheck(model)

        # Bookkeeping of the optimizer-step checks (yashard.guards).
        self.trainable_entries = None  # (the step's checks: see guards._trainable_entries)
        self.warned_no_grad: set[str] = set()  # parameters named in the step's "got no gradient" warning
        self.creating_optimizer_state = False  # sharded_optim_state_dict's zero-gradient step is running
        self.skipped_steps = 0
        self.grad_scalers = weakref.WeakSet()  # enabled ShardedGradScalers: they own non-finite gradients
        self.warned_fp16 = False  # the fp16-without-ShardedGradScaler warning was logged

        guards.track(self, removed)  # weak references: the removed parameters are freed as usual
        self.model.to(self.device)  # moves the remaining buffers (rotary tables, ...)
        self.streams.share_with_comm(self.allocated_tensors().values())
        self._hooks = self.forward.install_hooks()
        self.fused_head = FusedHead(model, spec, config, self.state, unit_set, self.sums.record)
        self._hooks += self.fused_head.install()
        ref = weakref.ref(self)
        integrity.refuse_freezing_after_shard(model, lambda: (rt := ref()) and rt.units)
        model._yashard_sharded = True

    # ------------------------------------------------------------------ what every forward starts with
    def _begin_forward(self, grad: bool) -> None:
        """What starts every forward (the model's, or the input embedding's called ahead of it):
        the checks first (they change no state: a refused forward leaves none behind), the reset
        after a backward that raised, then the wait for what is in flight and the refresh of the
        gather sources."""
        integrity.check_slot_writes(self.slots, self.config, self.spec, self.gathers.forget_casts)
        integrity.check_master_storage(self.units)
        if grad:
            integrity.check_masters(self.units)
            self.new_parameters()  # (get_peft_model or a module swap after shard(): never reduced)
        if self.state.in_backward:
            self.backward.recover_from_failed_backward()
        Gathers.settle(self.slots.values())
        self.drain()
        self.streams.capture_compute()
        self.gathers.refresh_sources(self.units)

    def _first_grad_forward(self) -> None:
        """A checkpoint's comm hook state that no hook took before the first forward is warned about."""
        if self.comm_hooks.loaded_state is not None:
            self.comm_hooks.drop_loaded_state()

    def drain(self) -> None:
        """Wait for every reduction in flight and, on CPU, every gather (compute waits on CUDA;
        the host waits on CPU).

        On CUDA a gather's :class:`~yashard.events.Pending` is ``done`` from its issue on and is not
        waited for here: compute waits for it where the weights are used, so the gathers issued after
        the optimizer step keep overlapping the next forward. One that is never used (a prefetch the
        forward did not reach) may still read its shard while the optimizer or the source refresh
        writes it; its result is then thrown away, since it is used only while the masters keep the
        version it was gathered at (``gathered_version``)."""
        with labelled("yashard::drain"):
            self.gathers.wait_all(self.units)
            self.reducer.wait_all(self.slots)

    # ------------------------------------------------------------------ optimizer steps and loads
    def before_optimizer_step(self) -> None:
        """Run by the optimizer step pre-hook, after its checks: keep the frozen ranges of partly
        frozen units (put back by :meth:`after_optimizer_step`)."""
        if self.config.step_in_backward:  # (each unit kept and restored them around its own step)
            return
        for u in self.units:
            u.keep_frozen()

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
            if u.trains:  # (a shard of frozen parameters never has a gradient to step)
                torch.autograd.graph.increment_version(u.master)
        self.state.stepped_since_backward = True  # (the next backward starts the gradient flags afresh)
        self.state.step_pending = False  # (step_in_backward: the next backward may step again)
        self.masters_changed()

    def masters_changed(self) -> None:
        """The masters were written (:meth:`after_optimizer_step`, ``yashard.load_checkpoint``):
        gather what the next forward needs first, as described there, and wait for the norm group,
        whose weights stay readable between forwards; take off the views that would be stale."""
        if self.state.in_backward or not self.forward_order:
            return
        self.drain()
        self.streams.capture_compute()
        self.gathers.refresh_sources(self.units)
        Gathers.forget_stale(self.units)  # (a unit whose masters the step did not change keeps its weights)
        stale = [u for u in self.forward_order  # (a direct slot shows the shard itself: never stale)
                 if u.gathered is None and u.views_until is None and not u.slot.direct]
        for u in self.resident:
            self.gathers.prefetch(u)
        for u in self.resident:
            # The norm weights stay readable between forwards (model.model.norm.weight), and so do
            # the adapters: they show the stepped values once these small gathers are waited for
            # (CUDA: the compute stream waits).
            u.gathered.wait()
        free = set()  # every slot is free now: gather the first unit of each, in forward order
        with torch.enable_grad():  # gathers for a training forward: hpZ keeps its secondary slices
            for u in self.forward_order:
                if u.slot.name not in free:
                    free.add(u.slot.name)
                    self.gathers.prefetch(u)
        # Units whose views stay on their modules between forwards (a slot of their own:
        # reshard_after_forward=False, tied embeddings) would show the weights before the step, or
        # the gather in flight: their views come off, so a read until the next forward (which puts
        # them back) is a ShardedStub that raises on its values instead of handing out stale ones.
        for u in stale:
            u.remove_views()

    # ------------------------------------------------------------------ checks the optimizer step runs
    def check_grads_reduced(self, what: str) -> None:
        """Raise if gradients were accumulated under ``no_sync()`` and never reduced, or the last
        backward raised (:func:`yashard.integrity.check_grads_reduced`)."""
        integrity.check_grads_reduced(self.state, self.units, self.spec, what)

    def check_master_storage(self) -> None:
        integrity.check_master_storage(self.units)

    def check_no_new_parameters(self) -> None:
        self.new_parameters()

    def set_requires_grad(self, requires_grad: bool) -> None:
        integrity.set_requires_grad(self.units, requires_grad)

    def has_grad_scaler(self) -> bool:
        """Whether an enabled :class:`yashard.ShardedGradScaler` of this model is alive."""
        return len(self.grad_scalers) > 0

    @property
    def fwd_sums(self) -> torch.Tensor:
        """Per unit, the forward-output sums the next step checks (:class:`~yashard.grad_norm.ForwardSums`)."""
        return self.sums.sums

    def grads_finite(self) -> torch.Tensor:
        if self.step_optimizer is not None:  # step_in_backward: the gradients the units stepped on
            return self.step_optimizer.finite_flags()
        return self.norms.grads_finite()

    def set_step_optimizer(self, optimizer) -> None:
        """``ShardConfig.step_in_backward``: ``optimizer`` (an ``OptimizerInBackward``) steps each
        unit in backward, from now on; an earlier one no longer does."""
        if self.state.in_backward or self.state.step_pending:
            raise RuntimeError("optimizer_in_backward between a backward and opt.step(): build it before the "
                               "backward, or after the previous optimizer's step()")
        self.step_optimizer = optimizer
        self.reducer.step_unit = optimizer.step_unit

    def refuse_in_step_in_backward(self, what: str, why: str, fix: str) -> None:
        """Raise if ``ShardConfig.step_in_backward`` is on: ``what`` needs gradients the mode does not keep."""
        if self.config.step_in_backward:
            raise RuntimeError(f"{what} with ShardConfig(step_in_backward=True): {why}; {fix}")

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip every gradient shard by the global norm (:meth:`yashard.grad_norm.GradNorms.clip_grad_norm_`)."""
        self.refuse_in_step_in_backward(
            "clip_grad_norm_", "each unit already stepped in backward, on its own gradients, before the global norm "
            "over every unit was known, and AdamW's second moment takes the gradient squared, so scaling the step "
            "after it ran is not clipping", "drop the clipping, or use the ordinary step (drop step_in_backward)")
        self.check_grads_reduced("clip_grad_norm_")
        return self.norms.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)

    # ------------------------------------------------------------------ comm hooks
    @property
    def direct_grads(self) -> bool:
        return self.state.direct_grads

    @property
    def comm_hook(self):
        return self.reducer.comm_hook

    @property
    def comm_hook_state(self):
        return self.reducer.comm_hook_state

    @property
    def reduce_out(self) -> torch.Tensor | None:
        return self.reducer.reduce_out

    def register_comm_hook(self, state, hook) -> None:
        """Replace how each unit's gradients are reduced (contract in :mod:`yashard.comm_hooks`)."""
        self.refuse_in_step_in_backward(
            "register_comm_hook", "the optimizer steps straight from the default reduce-scatter's fp32 output buffer, "
            "and a hook hands back its own tensor, in its own dtype", "use the default reduction, or drop "
            "step_in_backward")
        self.comm_hooks.register(state, hook)

    def hook_state_dict(self) -> dict | None:
        return self.comm_hooks.state_dict()

    def restore_hook_state(self, state_dict: dict | None) -> None:
        self.comm_hooks.restore_state(state_dict)

    # ------------------------------------------------------------------ user-facing helpers
    def module_name(self, unit: Unit) -> str:
        """The HF path of ``unit`` ("model.layers.3", "lm_head", ...), for messages."""
        return build.module_name(self.spec, unit)

    def memory_inputs(self) -> MemoryInputs:
        """What the memory plan is a formula of: the sizes this runtime allocated."""
        return MemoryInputs(
            config=self.config, world=self.world,
            slots=tuple(SlotSize(s.name, s.numel, s.grad_numel, s.direct, s.shared is not None,
                                 s.weights.dtype == torch.uint8) for s in self.slots.values()),
            units=tuple(UnitSize(u.layout.shard_numel, u.trains,
                                 u.frozen_values.numel() if u.frozen_values is not None else 0,
                                 u.layout.padded if u.kind == "layer" else None, u.master.dtype) for u in self.units),
            direct=self.direct, direct_grads=self.state.direct_grads, reduce_out=self.reducer.reduce_out is not None,
            workspaces=tuple((name, t.numel(), t.numel() * t.element_size())
                             for name, t in self.reducer.workspaces.items()),
            hook_planned=self.reducer.hook_planned,
            staging_numel=self.reducer.staging.numel() if self.reducer.staging is not None else 0)

    def memory_plan(self) -> MemoryPlan:
        return plan_memory(self.memory_inputs())

    def allocated_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor the runtime holds, by name (what the memory plan accounts for)."""
        out = {}
        if self.shared is not None:  # (the layer slots and the outer units' slots are views of it)
            for k, t in self.shared.tensors().items():
                out[f"shared.{k}"] = t
        for slot in self.slots.values():
            for k, t in slot.tensors().items():
                out[f"slot.{slot.name}.{k}"] = t
        if self.reducer.reduce_out is not None:
            out["reduce_out"] = self.reducer.reduce_out
        if self.reducer.staging is not None:
            out["reduce_staging"] = self.reducer.staging
        if self.gathers.qwz_workspace is not None:
            out["qwz_workspace"] = self.gathers.qwz_workspace
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
        for name, t in self.reducer.workspaces.items():
            out[f"comm_hook.{name}"] = t
        return out

    @torch.no_grad()
    def gather_full(self, what: str = "params") -> dict[str, torch.Tensor]:
        """Full fp32 tensors by HF name, gathered from every rank (a collective: call on all ranks).
        A frozen unit's 16-bit master gives its values widened to fp32 (exact)."""
        if what == "grads":
            self.refuse_in_step_in_backward(
                "full_grads()", "no gradient is kept: each unit's lives only until its optimizer step, in backward",
                "read gradients with the ordinary step (drop step_in_backward)")
            self.check_grads_reduced("full_grads()")
        out: dict[str, torch.Tensor] = {}
        for u in self.units:
            if what == "params":
                shard = u.master.detach()
            elif what == "grads":
                shard = u.master.grad if u.master.grad is not None else torch.zeros_like(u.master)
            else:
                raise ValueError(f"what must be 'params' or 'grads', got {what!r}")
            flat = masters.gather_whole(self.comm, u, shard, what)
            if u.rebuild is not None:  # 4-bit weights: as their HF state dict has them (packed, with the state)
                if what == "params":
                    out.update(self._packed_state(u, flat))
                continue
            for entry, fqns in zip(u.layout.entries, u.fqns):
                t = flat[entry.offset : entry.end].view(entry.shape).clone()
                for fqn in fqns:
                    out[fqn] = t
        return out

    @staticmethod
    def _packed_state(u: Unit, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """A byte unit's 4-bit weights under the names of transformers' state dict of the 4-bit
        model: each weight's packed data, and its quantisation state as bitsandbytes serialises it."""
        out = {}
        for entry, fqns, rebuild in zip(u.layout.entries, u.fqns, u.rebuild):
            w = rebuild(flat[entry.offset : entry.end])
            for fqn in fqns:
                out[fqn] = w.detach().clone()
                out.update({f"{fqn}.{k}": v.clone() if torch.is_tensor(v) else v
                            for k, v in w.quant_state.as_dict(packed=True).items()})
        return out

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
