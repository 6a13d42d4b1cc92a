"""A causal LM's cross-entropy over its output projection, in chunks of tokens: pure math.

``logits = hidden @ weight.T`` (optionally soft-capped, ``tanh(logits / c) * c``) and their
cross-entropy are computed ``chunk`` tokens at a time, so neither the full logits nor their fp32
gradients ever exist. The forward keeps nothing but its inputs; the backward recomputes each
chunk's logits and turns them into that chunk's gradients at once.

* The gradient of ``hidden`` is written chunk by chunk into one tensor of ``hidden``'s size.
* The gradient of ``weight`` is added chunk by chunk into a destination ``sink()`` names (a
  gradient slot's view), in place: no full-size temporary. Without a sink it goes into a fresh
  tensor, returned to autograd as usual.
* Each op runs in the dtype the unfused HF path runs it in: the matmuls and the soft-cap in the
  compute dtype, the softmax in fp32, the logits' gradient cast back to the compute dtype before
  the matmuls. So fp32 results equal HF's to rounding, and bf16 ones are within bf16 tolerance.

Semantics are transformers' ``ForCausalLMLoss`` (``loss/loss_utils.py``): labels shifted left and
padded with ``ignore_index``, or ``shift_labels`` as given; mean over the tokens whose label is not
``ignore_index``, or the sum divided by ``num_items_in_batch``.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.autograd.function import once_differentiable
from torch.nn import functional as F

# what a gradient sink answers: the tensor to write into, and whether to add to what it holds
# (False: overwrite it); None when nothing is to be written in this backward
Sink = Callable[[], "tuple[torch.Tensor, bool] | None"]


def softcap_logits(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Gemma-style final soft-capping, with the ops of the HF forward, in the logits' dtype."""
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap


def shifted_targets(labels: torch.Tensor | None, shift_labels: torch.Tensor | None, ignore_index: int) -> torch.Tensor:
    """The flat targets ``ForCausalLMLoss`` compares the logits with: ``shift_labels`` as given,
    else ``labels`` shifted left by one, the last position of each row padded with ``ignore_index``."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return shift_labels.reshape(-1)


class ChunkedLinearCE(torch.autograd.Function):
    """``sum`` over tokens of ``cross_entropy(softcap(hidden @ weight.T), targets)``, in fp32, with
    ``ignore_index`` tokens contributing nothing. ``hidden`` is ``[N, h]``, ``weight`` ``[V, h]``,
    ``targets`` ``[N]``.

    ``sink``: where the weight's gradient goes (see :data:`Sink`); the backward then returns none
    for it. ``begin``: run first in the backward, before the weight is read (the runtime
    re-gathers it there).
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index: int, softcap: float | None, chunk: int,
                sink: Sink | None, begin: Callable[[], None] | None):  # noqa: D102
        n = hidden.shape[0]
        valid = targets != ignore_index
        safe = torch.where(valid, targets, torch.zeros((), dtype=targets.dtype, device=targets.device))
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            logp = torch.log_softmax(softcap_logits(hidden[lo:hi] @ weight.t(), softcap).float(), dim=-1)
            nll = -logp.gather(1, safe[lo:hi, None]).squeeze(1)
            total += torch.where(valid[lo:hi], nll, 0.0).sum()
            del logp
        ctx.save_for_backward(hidden, weight, safe, valid)
        ctx.softcap, ctx.chunk, ctx.sink, ctx.begin = softcap, chunk, sink, begin
        return total

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_total):  # noqa: D102
        if ctx.begin is not None:
            ctx.begin()
        hidden, weight, safe, valid = ctx.saved_tensors
        cap, chunk = ctx.softcap, ctx.chunk
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w, dst, add = None, None, False
        if need_w:
            if ctx.sink is None:
                grad_w = dst = torch.zeros_like(weight)
                add = True
            else:
                target = ctx.sink()
                if target is not None:
                    dst, add = target
        g0 = grad_total.float()
        scale = torch.where(valid, g0, torch.zeros((), dtype=torch.float32, device=g0.device))
        for lo in range(0, hidden.shape[0], chunk):
            hi = min(hidden.shape[0], lo + chunk)
            h_c = hidden[lo:hi]
            raw = h_c @ weight.t()
            t = torch.tanh(raw / cap) if cap is not None else None
            z = t * cap if cap is not None else raw
            # the backward of nll_loss(log_softmax(z)), op by op as torch's: exp(log p) * s at every
            # class, less s at the target (one fp32 chunk, in place from the log-softmax on)
            p = torch.log_softmax(z.float(), dim=-1)
            del z, raw
            s_c = scale[lo:hi, None]
            p.exp_().mul_(s_c)
            p.scatter_add_(1, safe[lo:hi, None], -s_c)
            g = p.to(hidden.dtype)  # (the backward of HF's logits.float())
            del p
            if cap is not None:  # (the backward of tanh(x / c) * c, op by op)
                g = torch.ops.aten.tanh_backward(g * cap, t) / cap
                del t
            if grad_h is not None:
                torch.mm(g, weight, out=grad_h[lo:hi])
            if dst is not None:
                _add_weight_grad(dst, g, h_c, add)
                add = True
        return grad_h, grad_w, None, None, None, None, None, None


def _add_weight_grad(dst: torch.Tensor, g: torch.Tensor, h: torch.Tensor, add: bool) -> None:
    """``dst (+)= g.T @ h`` in place. In ``dst``'s dtype directly when it is the compute dtype;
    otherwise (an fp32 slot, bf16 compute) in blocks of vocabulary rows, each product made in the
    compute dtype, as the unfused matmul makes it, and widened into ``dst``: the temporary is one
    block, never the whole weight."""
    if dst.dtype == g.dtype:
        dst.addmm_(g.t(), h, beta=1 if add else 0)
        return
    rows = max(1, g.shape[0])
    for v0 in range(0, dst.shape[0], rows):
        v1 = min(dst.shape[0], v0 + rows)
        part = g[:, v0:v1].t() @ h
        if add:
            dst[v0:v1].add_(part)
        else:
            dst[v0:v1].copy_(part)


def chunked_causal_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor | None, *,
                           num_items_in_batch=None, ignore_index: int = -100,
                           shift_labels: torch.Tensor | None = None, softcap: float | None = None,
                           chunk_tokens: int = 1024, sink: Sink | None = None,
                           begin: Callable[[], None] | None = None) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss(softcap(hidden @ weight.T), labels, ...)``, computed in chunks
    of ``chunk_tokens`` tokens (see :class:`ChunkedLinearCE` for ``sink`` and ``begin``).
    ``hidden`` is ``[..., h]``, its leading dimensions those of ``labels`` (or ``shift_labels``)."""
    total, count = chunked_causal_lm_sum(hidden, weight, labels, ignore_index=ignore_index,
                                         shift_labels=shift_labels, softcap=softcap, chunk_tokens=chunk_tokens,
                                         sink=sink, begin=begin)
    return normalise(total, count, num_items_in_batch)


def chunked_causal_lm_sum(hidden, weight, labels, *, ignore_index: int = -100, shift_labels=None,
                          softcap: float | None = None, chunk_tokens: int = 1024, sink: Sink | None = None,
                          begin: Callable[[], None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The sum of the token losses (fp32) and the number of tokens not ignored: what
    :func:`normalise` turns into the HF loss."""
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be a positive int, got {chunk_tokens!r}")
    targets = shifted_targets(labels, shift_labels, ignore_index).to(hidden.device)
    flat = hidden.reshape(-1, hidden.shape[-1])
    if targets.numel() != flat.shape[0]:
        raise ValueError(
            f"the fused chunked loss got {flat.shape[0]} positions of hidden states but {targets.numel()} labels: "
            "the labels (or shift_labels) must have one entry per position the lm_head computes, as the HF loss "
            "needs (logits_to_keep keeps fewer positions)"
        )
    total = ChunkedLinearCE.apply(flat, weight, targets, ignore_index, softcap, chunk_tokens, sink, begin)
    return total, (targets != ignore_index).sum()


def normalise(total: torch.Tensor, count: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
    """``fixed_cross_entropy``'s reduction: the mean over ``count`` tokens, or the sum divided by
    ``num_items_in_batch`` (Trainer's normalisation over accumulated micro-batches)."""
    if num_items_in_batch is None:
        return total / count
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch
