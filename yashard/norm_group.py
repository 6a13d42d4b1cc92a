"""The resident groups: the norm group of all 1-D parameters, and the adapter group.

Gathering a few kilobytes per layer would make every layer pay a latency-bound collective, so all
1-D parameters of the whole model form one unit with its own slot, the norm group. The trainable
weights of PEFT adapters (LoRA's ``lora_A`` / ``lora_B``) form another, the adapter group, with
its own slot; it is a separate unit so that its master goes into the decay param group. Each
resident group is:

* gathered once per forward, at the forward's start, and resident for that forward and its backward;
* its views are plain ``Narrow`` views from a leaf token (no gate: nothing waits for it mid-pass);
* its gradients accumulate in its own grad slot over the whole backward and are reduced once, at the
  end of the backward (the autograd engine's final callback), SUM then post-divide like every unit
  (over one rank they accumulate in its ``master.grad`` and nothing is reduced). The adapter group
  is reduced before the norm group.
"""

from __future__ import annotations

from typing import Callable

import torch

from .unit import Unit


def is_small_param(p: torch.Tensor) -> bool:
    """Parameters that belong to the norm group: every parameter with fewer than two dimensions."""
    return p.dim() < 2


class NormGroup:
    """Schedules the resident units (kind ``"small"``: the adapter group, then the norm group): one
    gather per forward, one reduction per backward, each."""

    def __init__(self, units: list[Unit], prefetch: Callable[[Unit], None], reduce: Callable[[Unit], None]):
        self.units = units
        self._prefetch = prefetch  # issue a gather of a unit unless one for its weights is in flight
        self._reduce = reduce      # reduce a unit's gradients (the backward schedule's end of a unit)
        self._ready = False

    def begin_forward(self, grad_enabled: bool) -> None:
        """Issue the gathers (unless one for these weights is in flight) and install the views
        (data lands before the first unit computes)."""
        for unit in self.units:
            self._prefetch(unit)
        self._ready = False
        for unit in self.units:
            if grad_enabled:  # (a no-grad forward before this one's backward changes nothing of it)
                unit.fwd_id = unit.state.grad_fwd_id
                unit.fwd_trains = unit.master.requires_grad  # frozen: plain views, no reduction
            unit.install_views(unit.token if grad_enabled and unit.fwd_trains else None, grad_forward=grad_enabled)

    def ensure_ready(self) -> None:
        """Make the compute stream wait for the gathers, once per forward."""
        if not self._ready:
            for unit in self.units:
                unit.gathered.wait()
            self._ready = True

    def restore_backward_views(self) -> None:
        """Put back the views of the grad-enabled forward (an activation-checkpointed layer's
        recompute reads them)."""
        for unit in self.units:
            unit.restore_backward_views()

    def end_backward(self) -> None:
        """Reduce the groups' gradients; every backward of a grad-enabled forward reduces each once,
        on every rank, so the collective sequence never depends on which parameters got gradients."""
        for unit in self.units:
            if unit.fwd_id == unit.state.grad_fwd_id and not unit.reduced_in_pass:
                self._reduce(unit)
