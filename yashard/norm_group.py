"""The group of all small 1-D parameters (norm weights, biases, q/k norms).

Gathering a few kilobytes per layer would make every layer pay a latency-bound collective, so all
1-D parameters of the whole model form one unit with its own slot:

* gathered once per forward, at the forward's start, and resident for that forward and its backward;
* its views are plain ``Narrow`` views from a leaf token (no gate: nothing waits for it mid-pass);
* its gradients accumulate in its own grad slot over the whole backward and are reduced once, at the
  end of the backward (the autograd engine's final callback), SUM then post-divide like every unit
  (over one rank they accumulate in its ``master.grad`` and nothing is reduced).
"""

from __future__ import annotations

from typing import Callable

import torch

from .unit import Unit


def is_small_param(p: torch.Tensor) -> bool:
    """Parameters that belong to the norm group: every parameter with fewer than two dimensions."""
    return p.dim() < 2


class NormGroup:
    """Schedules the small-parameter unit: one gather per forward, one reduction per backward."""

    def __init__(self, unit: Unit, prefetch: Callable[[Unit], None], reduce: Callable[[Unit], None]):
        self.unit = unit
        self._prefetch = prefetch  # issue a gather of a unit unless one for its weights is in flight
        self._reduce = reduce      # reduce a unit's gradients (the backward schedule's end of a unit)
        self._ready = False

    def begin_forward(self, grad_enabled: bool) -> None:
        """Issue the gather (unless one for these weights is in flight) and install the views
        (data lands before the first unit computes)."""
        unit = self.unit
        self._prefetch(unit)
        self._ready = False
        if grad_enabled:  # (a no-grad forward before this one's backward changes nothing of it)
            unit.fwd_trains = unit.master.requires_grad  # frozen: plain views, no reduction
        unit.install_views(unit.token if grad_enabled and unit.fwd_trains else None, grad_forward=grad_enabled)

    def ensure_ready(self) -> None:
        """Make the compute stream wait for the gather, once per forward."""
        if not self._ready:
            self.unit.gathered.wait()
            self._ready = True

    def end_backward(self) -> None:
        """Reduce the group's gradients; every backward of a grad-enabled forward reduces once,
        on every rank, so the collective sequence never depends on which parameters got gradients."""
        if self.unit.fwd_id == self.unit.state.grad_fwd_id and not self.unit.reduced_in_pass:
            self._reduce(self.unit)
