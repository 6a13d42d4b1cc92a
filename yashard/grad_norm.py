"""The global gradient norm, clipping, and the non-finite flags the optimizer step checks.

* :class:`GradNorms`: ``clip_grad_norm_`` over every rank's shards (a collective over the shard
  group) and, per unit, whether its gradient is finite (read off the last clip's partial norms
  when the gradients have not changed since).
* :class:`ForwardSums`: per unit, the sum of each grad-enabled forward's first floating output,
  NaN/inf if one held it, counted for the step once that forward's backward starts.

Neither allocates a temporary the size of a shard.
"""

from __future__ import annotations

import math

import torch

from .collectives import Comm
from .unit import Unit


class ForwardSums:
    """Did a unit's forward output hold a NaN/inf, in a forward whose gradients the step would use?

    The sum of each grad-enabled forward's first floating output, NaN/inf if one held it, in fp64
    where the device has it (fp32-finite sums of many forwards cannot overflow it). A forward's
    sums wait in ``pending`` and join ``sums`` when its backward starts (:meth:`count`): a forward
    that is never backwarded (a batch skipped for its NaN loss) counts for nothing, and gradients
    dropped since the last backward (``zero_grad``) take their forwards' sums with them."""

    def __init__(self, n_units: int, device: torch.device):
        dtype = torch.float64 if device.type in ("cpu", "cuda") else torch.float32
        self.sums = torch.zeros(n_units, device=device, dtype=dtype)  # what the step checks
        self.pending = torch.zeros_like(self.sums)
        self._pending_views = list(self.pending.unbind())  # (one persistent 0-d view per unit)
        self._pending_id = None  # the forward whose sums ``pending`` holds

    def record(self, unit: Unit, output: torch.Tensor) -> None:
        """Add ``output``'s sum to ``unit``'s pending flag (NaN and inf propagate through a sum)."""
        if self._pending_id != unit.fwd_id:  # (a forward never backwarded: dropped)
            self.pending.zero_()
            self._pending_id = unit.fwd_id
        self._pending_views[unit.order].add_(output.detach().sum(dtype=torch.float32))

    def count(self, fwd_id: int, kept: bool) -> None:
        """A backward of forward ``fwd_id`` starts: its sums now count for the step. ``kept``: some
        gradient the last backward left is still there; when none is (``zero_grad()``, either mode,
        with no step: a batch thrown away), the sums of the forwards that made them go too."""
        if not kept:
            self.sums.zero_()
        if self._pending_id == fwd_id:
            self.sums.add_(self.pending)
            self.pending.zero_()
            self._pending_id = None


class GradNorms:
    """``clip_grad_norm_`` and the per-unit finite flags over ``units``' master gradients."""

    def __init__(self, units: list[Unit], comm: Comm, device: torch.device):
        self.units = units
        self.comm = comm
        self.device = device
        self._clip_finite = None  # (per-unit 'gradient is finite' flags, the grads' versions) of the last clip

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip every gradient shard by the global norm (a collective over the shard group);
        returns the norm before clipping. No temporary the size of a shard is allocated (see
        :func:`squares_per_tensor`). Records which units' gradients were finite
        (:meth:`grads_finite`). ``error_if_nonfinite``: raise, before clipping, if the norm is not
        finite (as torch's; it reads the norm on the host)."""
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
            parts = powers_per_tensor(grads, norm_type) if grads else zero.view(1)
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
        return self._per_unit(lambda g: ~nonfinite(g))

    def _per_unit(self, flag) -> torch.Tensor:
        """``flag(unit.master.grad)`` (a 0-d bool) for each unit, in ``units`` order (= ``order``),
        True where a unit has no gradient; stacked on the device (an index tensor built on the host
        would be a copy that waits for the GPU)."""
        true = torch.ones((), dtype=torch.bool, device=self.device)
        return torch.stack([true if u.master.grad is None else flag(u.master.grad) for u in self.units])


def powers_per_tensor(ts: list[torch.Tensor], p: float) -> torch.Tensor:
    """1-d, one element per tensor of ``ts``: the sum of ``|x|**p`` over its elements, accumulated
    in fp64 (fp32 on devices without it); :func:`squares_per_tensor` for ``p == 2``. Other ``p``
    (rare) read 64K-element slices on the CPU, with a temporary of one slice."""
    if p == 2.0:
        return squares_per_tensor(ts)
    if ts[0].device.type != "cpu":
        acc = torch.float64 if ts[0].device.type == "cuda" else torch.float32
        return torch.stack(torch._foreach_norm(ts, p)).to(acc).pow(p)
    return torch.stack([torch.stack([c.abs().pow_(p).sum(dtype=torch.float64) for c in t.split(1 << 16)]).sum()
                        for t in ts])


def squares_per_tensor(ts: list[torch.Tensor]) -> torch.Tensor:
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


def nonfinite(t: torch.Tensor) -> torch.Tensor:
    """0-d bool: does ``t`` hold a NaN or inf? (One fp32 sum: NaN and inf propagate through it; no
    tensor of ``t``'s size is allocated.)"""
    return ~torch.isfinite(t.sum(dtype=torch.float32))
