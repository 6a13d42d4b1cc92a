"""Identity autograd Functions that give the runtime reliable backward hook points."""

from __future__ import annotations

import torch


class GateGradFlow(torch.autograd.Function):
    """Identity on ``(token, *inputs)`` whose backward calls ``unit.on_grads_complete()``.

    Contract: the runtime applies it to a unit's gate token and to every differentiable input of the
    unit (positional or keyword) before the unit runs. Every ``Narrow`` view of the unit is built
    from the returned token, and the unit computes on the returned inputs. Autograd therefore runs
    this backward
      * after every ``Narrow.backward`` of the unit (all weight gradients are in the grad slot, or over
        one rank in ``master.grad``), and
      * before any gradient reaches the ops that produced the unit's inputs (the previous layer).
    That is the moment the unit's gradients are complete, independent of the engine's scheduling
    order. Gradients pass through unchanged. Outputs are views of the inputs, so the unit must not
    modify its inputs in place (PyTorch raises if it does). The node holds the unit weakly (as
    :class:`yashard.narrow.Narrow` does); once the model is gone it only passes gradients through.
    """

    @staticmethod
    def forward(ctx, unit, token, *inputs):  # noqa: D102
        ctx.unit = unit.ref
        return (token, *inputs)

    @staticmethod
    def backward(ctx, *grads):  # noqa: D102
        unit = ctx.unit()
        if unit is not None:
            unit.on_grads_complete()
        return (None, *grads)


class BackwardEntry(torch.autograd.Function):
    """Identity on a unit's outputs whose backward calls ``unit.on_backward_start(fwd_id)``.

    Contract: applied to every differentiable output of a unit after its forward. Its backward runs
    once, when the gradients of all those outputs are ready and before any backward op of the unit,
    so the runtime can re-gather the unit's weights (and prefetch the next unit) in time. ``fwd_id``
    is the id of the forward that built this node, so a backward through an older forward is caught.
    ``views`` (activation-checkpointed layers: the unit's parameter views of that forward, else
    None) live on the node, as long as the graph does, and are handed back to the unit, whose
    recompute reads them. The unit is held weakly, as in :class:`GateGradFlow`.
    """

    @staticmethod
    def forward(ctx, unit, fwd_id, views, *outputs):  # noqa: D102
        ctx.unit = unit.ref
        ctx.fwd_id = fwd_id
        ctx.views = views
        return outputs

    @staticmethod
    def backward(ctx, *grads):  # noqa: D102
        unit = ctx.unit()
        if unit is not None:
            unit.on_backward_start(ctx.fwd_id, ctx.views)
        return (None, None, None, *grads)


def will_accumulate(leaf: torch.Tensor) -> bool:
    """Inside a backward pass: whether the engine will accumulate a gradient into ``leaf`` (a tensor
    that requires grad) in this pass. True for ``loss.backward()`` when ``leaf`` is in the graph;
    False when it is not, and for ``torch.autograd.grad(...)`` and ``backward(inputs=...)`` that do
    not name it (those leave every other leaf's ``.grad`` untouched)."""
    node = torch.autograd.graph.get_gradient_edge(leaf).node
    return bool(torch._C._will_engine_execute_node(node))

