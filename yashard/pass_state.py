"""The state of the current forward/backward pass, shared by the runtime's components.

One small dataclass, passed by reference to every component that reads or moves it (the forward
and backward schedules, the gathers, the reduction, the integrity checks): none of them holds a
reference to the runtime. Each field says who writes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PassState:
    """Where the runtime is between forwards, backwards and optimizer steps."""

    # Over one data-parallel rank with fp32 reductions, Narrow adds gradients to master.grad in
    # place: nothing is reduced (build.direct_grads). A registered comm hook turns it off.
    direct_grads: bool
    grad_fwd_id: int = 0            # id of the latest grad-enabled forward (forward schedule)
    require_grad_sync: bool = True  # False inside ShardedModel.no_sync()
    fwd_sync: bool = True           # require_grad_sync at the latest grad-enabled forward (its backward's)
    in_backward: bool = False       # between a backward's first hook and its final callback
    root_active: bool = False       # between the model's forward pre-hook and its forward hook
    backward_pending: bool = False  # a grad-enabled forward ran and its backward has not ended
    accumulating: bool = True       # this backward accumulates into .grad (not autograd.grad)
    discard_reductions: bool = False  # a failed backward's reductions are waited for and thrown away
    stepped_since_backward: bool = False  # an optimizer step ran since the last backward began
    # ShardConfig.step_in_backward: a backward stepped the units and opt.step() has not run since
    # (backward schedule sets it, the runtime's optimizer-step post-hook clears it)
    step_pending: bool = False
    fwd_cursor: int = 0             # the decoder layer the forward expects next
    bwd_last_layer: int | None = None  # the last decoder layer whose backward started

    def phase(self) -> tuple[bool, bool, int]:
        """Where the runtime is, for :class:`What` (formatted only if an error needs it)."""
        return self.in_backward, torch.is_grad_enabled(), self.grad_fwd_id


class What:
    """Names a collective for error messages, formatted only when one is raised; ``hint`` (if set)
    replaces the usual advice (see :func:`yashard.collectives.collective_failure`)."""

    __slots__ = ("op", "unit", "state", "hint")

    def __init__(self, op: str, unit: str, state: tuple[bool, bool, int], hint: str | None = None):
        self.op, self.unit, self.state, self.hint = op, unit, state, hint

    def __str__(self) -> str:
        in_backward, grad, fwd = self.state
        phase = (f"backward of forward #{fwd}" if in_backward else f"forward #{fwd}" if grad else "no-grad forward")
        return f"{self.op} of {self.unit} ({phase})"
