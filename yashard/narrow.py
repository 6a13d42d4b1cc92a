"""``Narrow``: parameters as views into a weight slot, gradients written straight into a grad slot
(over one rank, into ``master.grad``)."""

from __future__ import annotations

import torch


class Narrow(torch.autograd.Function):
    """Expose one parameter of a unit as a view of the unit's weight slot.

    Contract:
      * forward returns ``weights[offset:offset + numel].view(shape)``: no copy, no allocation. The
        view reads whatever the slot holds when a kernel runs, so the runtime must have gathered the
        unit into the slot first (events rule R2), in forward and again in backward.
      * ``token`` is the unit's gate token (see :class:`yashard.gate_grad_flow.GateGradFlow`): the
        view depends on it, so the gate's backward can only run after every ``Narrow.backward`` of
        the unit has run.
      * backward hands the incoming gradient to ``unit.write_grad(index, grad)``, which copies it
        into the unit's gradient slot (in its dtype: ``reduce_dtype``, or ``param_dtype``, the
        gradient's own, see :func:`yashard.build.compact_grads`), or over one data-parallel rank
        (``PassState.direct_grads``) adds it to the unit's fp32 ``master.grad`` in place; autograd never
        allocates a ``.grad`` for the parameter. It returns no gradient for any input. A consumer that
        gave no gradient (None: the fused chunked loss wrote it through ``Unit.grad_destination``)
        writes nothing: gradients are not materialised as zeros.
      * the node holds the unit weakly: parameter views left on the module keep no runtime alive
        (Python's cycle collector cannot see references held by autograd nodes). A backward that
        outlives its model writes nothing.
    """

    @staticmethod
    def forward(ctx, token, weights, unit, index):  # noqa: D102
        ctx.unit = unit.ref
        ctx.index = index
        # a consumer that wrote the gradient itself (the fused chunked loss) hands autograd none: no
        # zeros of the parameter's size are made for it
        ctx.set_materialize_grads(False)
        entry = unit.layout.entries[index]
        return weights.narrow(0, entry.offset, entry.numel).view(entry.shape)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        unit = ctx.unit()
        if grad is not None and unit is not None:
            unit.write_grad(ctx.index, grad)
        return None, None, None, None
