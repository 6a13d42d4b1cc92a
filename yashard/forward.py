"""The forward schedule: the hooks that run a unit's forward on its gathered weights.

Every forward starts at the model's forward pre-hook (the checks, the wait for what is in flight,
the refresh of the gather sources, then the norm group and the first unit are gathered). Each unit's
pre-hook checks the order the alternating slots require, waits for its gather (events rule R2),
prefetches the next unit and installs its parameter views; with grad, behind a
:class:`~yashard.gate_grad_flow.GateGradFlow` on its inputs. Each unit's post-hook releases its slot
(R1), takes views off a slot another unit takes over, and puts a
:class:`~yashard.gate_grad_flow.BackwardEntry` on its outputs so its backward can re-gather it.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ._tree import diff_leaves, is_diff_tensor, put_back
from .activation_checkpointing import checkpointed_forward, no_cache_when_checkpointing
from .build import UnitSet
from .config import ShardConfig
from .errors import OrderError
from .gate_grad_flow import BackwardEntry, GateGradFlow
from .gathers import Gathers
from .grad_norm import ForwardSums
from .norm_group import NormGroup
from .pass_state import PassState
from .patch.spec import ModelSpec, get_path
from .unit import Unit


class ForwardSchedule:
    """The forward hooks of one sharded model."""

    def __init__(self, model: nn.Module, spec: ModelSpec, config: ShardConfig, state: PassState, units: UnitSet,
                 gathers: Gathers, norm_group: NormGroup | None, sums: ForwardSums,
                 begin_forward: Callable[[bool], None], first_grad_forward: Callable[[], None]):
        self.model = model
        self.spec = spec
        self.config = config
        self.state = state
        self.units = units
        self.gathers = gathers
        self.norm_group = norm_group
        self.sums = sums
        # What starts every forward (the checks, the recovery after a backward that raised, the wait
        # for what is in flight, the refresh of the gather sources: composed by the runtime).
        self.begin_forward = begin_forward
        self.first_grad_forward = first_grad_forward  # before the first grad-enabled forward (comm hook state)

    def install_hooks(self) -> list:
        """The forward hooks on the model and its units' modules (their handles, to remove them)."""
        model, spec, hooks = self.model, self.spec, []
        hooks.append(model.register_forward_pre_hook(_opaque(self.root_pre_forward)))
        hooks.append(model.register_forward_hook(_opaque(self.root_post_forward), always_call=True))
        modules = {"embed": get_path(model, spec.embed), "lm_head": get_path(model, spec.lm_head)}
        layer_modules = get_path(model, spec.layers)
        ckpt = self.config.checkpoint_layers
        if ckpt and "use_cache" in inspect.signature(model.forward).parameters:
            hooks.append(model.register_forward_pre_hook(_opaque(no_cache_when_checkpointing), with_kwargs=True))
        for unit in self.units.forward_order:
            if unit.kind == "layer":
                module = layer_modules[unit.index]
                if unit.index < ckpt:
                    module.forward = functools.partial(checkpointed_forward, module, module.forward)
            else:
                module = modules[unit.name]
            hooks.append(module.register_forward_pre_hook(_opaque(functools.partial(self.pre_forward, unit)),
                                                          with_kwargs=True))
            hooks.append(module.register_forward_hook(_opaque(functools.partial(self.post_forward, unit))))
        embed = self.units.embed
        if self.units.lm_head is None and embed is not None and any(
                m is modules["lm_head"] for locs in embed.locations for m, _ in locs):
            # tied embeddings: the head multiplies by the embedding unit's views
            hooks.append(modules["lm_head"].register_forward_pre_hook(_opaque(self.tied_head_pre_forward),
                                                                      with_kwargs=True))
        return hooks

    def root_pre_forward(self, module, args):
        """Start of a forward: refresh gather sources, gather the norm group and the first unit.

        A unit whose slot still holds its weights, gathered from the masters as they are now
        (same ``_version``), is not gathered again: the norm group (its own slot) is gathered once
        per optimizer step, however many micro-batches it has; so are the units gathered right
        after the step (``Runtime.after_optimizer_step``) and, with gradient accumulation, the layers
        the previous backward left in the slots."""
        grad = torch.is_grad_enabled()
        state, units = self.state, self.units
        self.begin_forward(grad)
        state.root_active = True
        if grad:
            if state.grad_fwd_id == 0:
                self.first_grad_forward()
            state.grad_fwd_id += 1
            state.fwd_sync = state.require_grad_sync
            # (until its backward ends; a no-grad forward in between, an evaluation, leaves it pending)
            state.backward_pending = True
            for u in units.units:
                u.fwd_version = u.master._version
        state.fwd_cursor = 0
        state.bwd_last_layer = None
        Gathers.forget_stale(units.units)  # masters changed (optimizer step, load) or the slot was reused
        if self.norm_group is not None:  # (the resident groups: the norm group and the adapter group)
            self.norm_group.begin_forward(grad)
        if units.forward_order:
            self.gathers.prefetch(units.forward_order[0])
        return None

    def root_post_forward(self, module, args, output):
        self.state.root_active = False
        return None

    def pre_forward(self, unit: Unit, module, args, kwargs):
        state, units = self.state, self.units
        if not state.root_active and unit is units.embed:  # (never re-run in a backward: not checkpointed)
            return self._embedding_ahead_of_forward(unit, args, kwargs)
        if not state.root_active and not state.in_backward:  # (a checkpointed layer's recompute is in one)
            raise OrderError(
                f"{unit.name} ran outside a forward of the whole model: yashard gathers each unit's weights "
                f"as the model's own forward reaches it. Call the model itself ({type(self.model).__name__}, or "
                "the ShardedModel) with input_ids or inputs_embeds; output_hidden_states=True returns every layer's "
                "hidden states. Calling the base model or a decoder layer on its own is not supported (the input "
                "embedding is: inputs_embeds = model.get_input_embeddings()(input_ids))"
            )
        if unit.kind == "layer":
            expected = state.fwd_cursor
            if unit.index != expected:
                raise OrderError(self._order_message(unit.index, expected))
            state.fwd_cursor += 1
        elif unit is units.lm_head and state.fwd_cursor != len(units.layers):
            raise OrderError(
                f"{self.spec.lm_head} ran after {state.fwd_cursor} of the {len(units.layers)} decoder layers "
                f"({self.spec.layers}.{state.fwd_cursor} was expected next); yashard's alternating buffers need "
                "every layer to run exactly once per forward, in order"
            )
        self.gathers.ensure(unit)
        if self.norm_group is not None:
            self.norm_group.ensure_ready()
        self.gathers.prefetch(unit.next_forward)  # R5: one unit ahead
        return self._enter(unit, state.grad_fwd_id, args, kwargs)

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

    def tied_head_pre_forward(self, module, args, kwargs):
        """The output embedding of a tied model reads the embedding unit's views. Usually the
        embedding ran earlier in the same forward and installed them; when it did not run with
        grad in this forward (``inputs_embeds`` computed under ``torch.no_grad()`` or outside the
        model, after an evaluation or ``generate()``), the views are plain ones of another forward
        and the tied weight would get no gradient from the head. Contract: the head reads weights
        gathered from the masters as they are now, waited for (R2), and in a grad-enabled forward
        the views it reads are this forward's (``Narrow`` outputs behind a gate on the head's
        inputs, so the gradient reaches the tied weight and its reduction waits for it)."""
        unit = self.units.embed
        if not self.state.root_active:
            return None  # (outside a model forward: nothing to join; the views in place are read)
        Gathers.forget_stale([unit])
        fresh = unit.gathered is None
        self.gathers.ensure(unit)
        if torch.is_grad_enabled():
            if unit.fwd_id == self.state.grad_fwd_id:
                return None  # the embedding ran in this forward: its views are this forward's
            unit.fwd_version = unit.master._version
            return self._enter(unit, self.state.grad_fwd_id, args, kwargs)
        if fresh:
            unit.install_views(None)
        return None

    def _embedding_ahead_of_forward(self, unit: Unit, args, kwargs):
        """The input embedding called on its own, ahead of the model forward that takes its output
        as ``inputs_embeds`` (LLaVA-style multimodal inputs, prompt tuning): it runs as the first
        unit of that coming forward, whose id it takes (``grad_fwd_id + 1``), so its backward and
        its reduction belong to that forward's backward. It starts as the model's forward does
        (``begin_forward``)."""
        grad = torch.is_grad_enabled()
        self.begin_forward(grad)
        Gathers.forget_stale([unit])
        self.gathers.ensure(unit)
        self.gathers.prefetch(unit.next_forward)
        if grad:
            unit.fwd_version = unit.master._version
        return self._enter(unit, self.state.grad_fwd_id + 1, args, kwargs)  # the coming forward's id

    def _order_message(self, got: int, expected: int) -> str:
        layers = self.spec.layers
        if expected >= len(self.units.layers):
            return (
                f"decoder layer {layers}.{got} ran after all {len(self.units.layers)} layers of this forward already "
                "ran; yashard's alternating buffers need every layer to run exactly once per forward, in order"
            )
        return (
            f"decoder layer {layers}.{got} ran its forward but {layers}.{expected} was expected next; yashard's "
            "alternating buffers need every layer to run exactly once per forward, in order "
            "(a layer was skipped, repeated or called out of order)"
        )

    def post_forward(self, unit: Unit, module, args, output):
        self.gathers.release(unit.slot)  # R1 for the next owner
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
        elif unit.views_until is None and (unit.kind == "layer" or unit is self.units.lm_head):
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
            self.sums.record(unit, first)  # which unit first produced a NaN/inf (guards.step_checks)
        if unit is self.units.embed or not diff:
            return None  # (the embedding needs no weights in backward)
        unit.fwd_backward = True
        outs = BackwardEntry.apply(unit, self.state.grad_fwd_id, views, *diff)
        if spec is None:
            return outs[0]
        return tree_unflatten(put_back(flat, iter(outs)), spec)


def _opaque(hook):
    """A forward hook that ``torch.compile`` runs as it is, outside any graph.

    The hooks gather, install views, issue collectives and move the runtime's state on: Python
    side effects that Dynamo would either trace into (recompiling per layer, since each unit is
    another object) or break on anyway. Disabled, each is one clean graph break, and the module
    bodies between them (a decoder layer's forward) compile on the views the hook installed."""
    return torch.compiler.disable(hook)
