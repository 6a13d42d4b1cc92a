"""The fused chunked loss on a sharded model (``ShardConfig(loss="chunked")``).

A grad-enabled call with ``labels`` computes the loss inside the lm_head's forward, in chunks of
tokens (:mod:`yashard.fused_loss`), while the lm_head's weights are gathered. Neither the full
logits nor their fp32 gradients exist. One place for every family:

* the model's forward pre-hook takes the call's ``labels``, ``shift_labels``,
  ``num_items_in_batch`` and ``ignore_index``;
* the lm_head's forward computes the loss from its input and its weight view, and returns a probe:
  three known values per position, on the CPU;
* the HF forward applies what it applies to logits (Gemma's soft-capping) to the probe and calls
  ``loss_function``, which this module replaced: it checks the probe came back as the loss assumed
  (unchanged, or soft-capped by ``final_logit_softcapping``) and returns the loss. Anything else
  raises, naming ``loss="hf"``: a family that changes its logits otherwise is never trained wrong;
* the model's forward hook replaces the output's ``logits`` by :class:`LogitsNotComputed`.

The weight's gradient is added chunk by chunk into its range of the gradient slot
(``Unit.grad_destination``); the backward re-gathers the lm_head first, as its ``BackwardEntry``
would. Forwards without grad, or without ``labels``, run the HF loss and return the logits.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from .build import UnitSet
from .config import ShardConfig
from .fused_loss import chunked_causal_lm_sum, normalise, softcap_logits
from .pass_state import PassState
from .patch.spec import FAMILIES, ModelSpec, get_path
from .unit import Unit

logger = logging.getLogger("yashard")

# three values per position: soft-capping at any cap a model uses changes the last two
_PROBE = (0.5, -3.0, 40.0)

NOT_COMPUTED = (
    "the logits were not computed: this call had labels, so yashard's fused chunked loss "
    "(ShardConfig(loss='chunked'), the default) computed the loss from the lm_head in chunks of tokens and "
    "the full logits never existed. Pass ShardConfig(loss='hf') to get the logits with the loss, or call the "
    "model without labels and compute the loss from the logits; forwards under torch.no_grad() return them"
)


class LogitsNotComputed(torch.Tensor):
    """What ``output.logits`` is after a fused call: the logits' shape, dtype and device, and no
    values. Every op on it raises, naming the switch (:data:`NOT_COMPUTED`)."""

    @staticmethod
    def __new__(cls, shape, dtype, device):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=False)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{func.__name__} on output.logits: " + NOT_COMPUTED)

    def __repr__(self, *, tensor_contents=None):
        return f"LogitsNotComputed(shape={tuple(self.shape)}, dtype={self.dtype}): " + NOT_COMPUTED

    def __reduce_ex__(self, proto):
        raise RuntimeError("pickling output.logits: " + NOT_COMPUTED)


@dataclass
class _Call:
    """One fused forward: what its pre-hook took, what its lm_head computed."""

    labels: Any
    shift_labels: Any
    num_items: Any
    ignore_index: int
    loss: torch.Tensor | None = None
    probe: torch.Tensor | None = None
    logits_shape: tuple = ()
    logits_dtype: torch.dtype | None = None
    consumed: Any = None  # the tensor the HF forward handed its loss_function (what it returns as logits)


def fusable(model: nn.Module, spec: ModelSpec, config: ShardConfig, head: nn.Module) -> str | None:
    """Why the fused loss is not used for ``model`` (None: it is)."""
    if config.loss != "chunked":
        return "ShardConfig(loss='hf')"
    if spec.family not in FAMILIES:
        return (f"model type {spec.family!r} is not one of the families whose forward yashard's fused loss "
                f"follows ({', '.join(FAMILIES)})")
    linear = isinstance(head, nn.Linear) and type(head).forward is nn.Linear.forward
    if not linear or head.__dict__.get("bias", head._parameters.get("bias")) is not None:
        return (f"the lm_head is a {type(head).__name__}{' with a bias' if linear else ''}, not an nn.Linear "
                "without bias")
    if "_loss_function" in model.__dict__:
        return "the model's loss_function was replaced before yashard.shard"
    from transformers.loss.loss_utils import ForCausalLMLoss

    if model.loss_function is not ForCausalLMLoss:
        return f"the model's loss is {getattr(model.loss_function, '__name__', model.loss_function)}, not ForCausalLMLoss"
    return None


class FusedHead:
    """The hooks of the fused chunked loss on one sharded model."""

    def __init__(self, model: nn.Module, spec: ModelSpec, config: ShardConfig, state: PassState, units: UnitSet,
                 record: Callable[[Unit, torch.Tensor], None]):
        self.model = model
        self.config = config
        self.state = state
        self.head = get_path(model, spec.lm_head)
        self.record = record  # the forward-output sums (yashard.grad_norm.ForwardSums.record)
        self.why_not = fusable(model, spec, config, self.head)
        self.call: _Call | None = None
        self.installed = None  # the loss_function the model was given
        text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.softcap = getattr(text, "final_logit_softcapping", None)
        self.vocab_size = getattr(text, "vocab_size", None)
        self.backward_unit = units.lm_head  # (tied: the head reads the embedding's views, which stay gathered)
        self.unit, self.index = None, None
        for unit in (units.lm_head, units.embed):
            for i, locs in enumerate(unit.locations if unit is not None else ()):
                if any(m is self.head and a == "weight" for m, a in locs):
                    self.unit, self.index = unit, i
        if self.why_not is None and self.unit is None:
            self.why_not = "the lm_head's weight is in no unit"
        if self.why_not is not None and config.loss == "chunked":
            logger.info("yashard: the HF loss runs, not the fused chunked loss: %s", self.why_not)

    def install(self) -> list:
        """The hooks, and the lm_head's forward and the model's loss_function replaced; [] when the
        fused loss is not used."""
        if self.why_not is not None:
            return []
        model, head = self.model, self.head
        self.delegate = model.loss_function
        # (opaque to torch.compile, as the runtime's hooks: Dynamo runs them as they are)
        model.loss_function = self.installed = torch.compiler.disable(self.loss_function)
        head.forward = torch.compiler.disable(functools.partial(self.head_forward, head.forward))
        return [model.register_forward_pre_hook(torch.compiler.disable(self.pre_forward), with_kwargs=True),
                model.register_forward_hook(torch.compiler.disable(self.post_forward), always_call=True)]

    # ---- the moments of one forward --------------------------------------------------------
    def pre_forward(self, module, args, kwargs):
        self.call = None
        labels = kwargs.get("labels")
        if labels is None or not torch.is_grad_enabled():
            return None
        if self.model.__dict__.get("_loss_function") is not self.installed:  # (replaced since: the HF loss)
            return None
        self.call = _Call(labels, kwargs.get("shift_labels"), kwargs.get("num_items_in_batch"),
                          kwargs.get("ignore_index", -100))
        return None

    def head_forward(self, own, hidden, *args, **kwargs):
        call = self.call
        if call is None or not self.state.root_active or args or kwargs or call.loss is not None:
            return own(hidden, *args, **kwargs)
        weight = self.head.__dict__.get("weight")
        unit, index, back = self.unit, self.index, self.backward_unit
        sink = begin = None  # (they hold the units weakly, as the units' autograd nodes do)
        if weight is not None and weight.requires_grad and not self._sum_in_autograd(weight):
            sink = functools.partial(_grad_destination, unit.ref, index)
        if back is not None and back.fwd_id == self.state.grad_fwd_id:
            begin = functools.partial(_backward_start, back.ref, back.fwd_id)
        if self.vocab_size is not None and weight.shape[0] != self.vocab_size:
            raise ValueError(
                f"the lm_head has {weight.shape[0]} outputs but the config's vocab_size is {self.vocab_size}: the HF "
                "loss would view the logits by vocab_size. Fix the config, or pass ShardConfig(loss='hf')")
        total, count = chunked_causal_lm_sum(
            hidden, weight, call.labels, ignore_index=call.ignore_index, shift_labels=call.shift_labels,
            softcap=self.softcap, chunk_tokens=self.config.loss_chunk_tokens, sink=sink, begin=begin)
        if back is not None and self.config.on_nonfinite != "ignore":
            self.record(back, total)  # (a NaN/inf in the lm_head's output shows in the sum of the token losses)
        call.loss = normalise(total, count, call.num_items)
        call.logits_shape = (*hidden.shape[:-1], weight.shape[0])
        call.logits_dtype = torch.result_type(hidden, weight)
        call.probe = torch.tensor(_PROBE, dtype=call.logits_dtype).expand(*hidden.shape[:-1], len(_PROBE))
        return call.probe

    def _sum_in_autograd(self, weight: torch.Tensor) -> bool:
        """Tied embeddings whose gradient buffer is wider than ``param_dtype`` (a comm hook's fp32
        slots; ``master.grad`` over one rank): the head's gradient goes back through autograd, which
        sums it with the embedding's in ``param_dtype``, as the HF loss's path does, so every kind of
        gradient slot holds the same values (design.md, 16-bit gradient slots)."""
        if self.backward_unit is not None:
            return False
        unit = self.unit
        wide = torch.float32 if self.state.direct_grads else unit.slot.grads.dtype
        return wide != weight.dtype

    def loss_function(self, logits, labels, vocab_size=None, **kwargs):
        call = self.call
        if call is None or call.loss is None or call.consumed is not None:
            return self.delegate(logits, labels, vocab_size, **kwargs)
        problems = []
        if labels is not call.labels:
            problems.append("labels other than the call's")
        for name, seen in (("shift_labels", call.shift_labels), ("num_items_in_batch", call.num_items)):
            if kwargs.get(name) is not seen:
                problems.append(f"{name} other than the call's")
        if kwargs.get("ignore_index", -100) != call.ignore_index:
            problems.append("another ignore_index")
        if not isinstance(logits, torch.Tensor) or logits.shape != call.probe.shape or logits.device.type != "cpu":
            problems.append("a tensor that is not what its lm_head returned")
        else:
            expected = softcap_logits(torch.tensor(_PROBE, dtype=call.logits_dtype), self.softcap)
            row = logits.reshape(-1, len(_PROBE))[:1]
            if row.numel() and not torch.equal(row[0].to(expected.dtype), expected):  # (an upcast is exact)
                problems.append("logits changed otherwise than " + (
                    "soft-capped by final_logit_softcapping" if self.softcap is not None else "not at all"))
        if problems:
            raise RuntimeError(
                f"{type(self.model).__name__}'s forward handed its loss_function {', '.join(problems)}: the fused "
                "chunked loss computed the loss inside the lm_head and cannot follow this forward. Pass "
                "ShardConfig(loss='hf')")
        call.consumed = logits
        return call.loss

    def post_forward(self, module, args, output):
        call, self.call = self.call, None
        if call is None or call.loss is None or output is None:  # (None: the forward raised)
            return None
        if call.consumed is None:
            raise RuntimeError(
                f"{type(self.model).__name__}'s forward did not hand its lm_head's output to its loss_function, "
                "so the fused chunked loss computed inside the lm_head would be lost. Pass ShardConfig(loss='hf')")
        placeholder = LogitsNotComputed(call.logits_shape, call.logits_dtype, call.loss.device)
        if isinstance(output, dict):  # (a ModelOutput)
            for key, value in list(output.items()):
                if value is call.consumed:
                    output[key] = placeholder
            return None
        if isinstance(output, tuple):  # (return_dict=False)
            return tuple(placeholder if v is call.consumed else v for v in output)
        if any(v is call.consumed for v in tree_leaves(output)):
            raise RuntimeError("the fused chunked loss cannot replace the logits in a "
                               f"{type(output).__name__}: pass ShardConfig(loss='hf')")
        return None


def _grad_destination(ref, index: int):
    """The sink of the lm_head weight's gradient: its range of the gradient slot (None once the
    model is gone: a backward that outlives it writes nothing)."""
    unit = ref()
    return unit.grad_destination(index) if unit is not None else None


def _backward_start(ref, fwd_id: int) -> None:
    """What the lm_head's ``BackwardEntry`` would do: re-gather it, check the forward is current."""
    unit = ref()
    if unit is not None:
        unit.on_backward_start(fwd_id)
