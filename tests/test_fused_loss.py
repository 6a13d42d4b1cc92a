"""The chunked linear cross-entropy (yashard/fused_loss.py) against transformers' ForCausalLMLoss on
full logits: one process, no runtime. fp32 to 1e-6 relative, bf16 to bf16 tolerance."""

import pytest
import torch
from transformers.loss.loss_utils import ForCausalLMLoss

from yashard.fused_loss import ChunkedLinearCE, chunked_causal_lm_loss, softcap_logits


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


def hf_loss(hidden, weight, labels, softcap=None, **kw):
    logits = softcap_logits(hidden @ weight.t(), softcap)
    return ForCausalLMLoss(logits, labels, weight.shape[0], **kw)


def inputs(dtype, b=2, t=9, h=16, v=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, h, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) * 0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, v, (b, t), generator=g)
    labels[0, :3] = -100
    return hidden, weight, labels


def grads(loss, hidden, weight):
    return torch.autograd.grad(loss, (hidden, weight))


@pytest.mark.parametrize("softcap", [None, 2.5])
@pytest.mark.parametrize("chunk", [1, 4, 7, 1000])
@pytest.mark.parametrize("kw", [{}, {"num_items_in_batch": 11}, {"num_items_in_batch": torch.tensor(5)}])
def test_fp32_equals_hf_loss_and_gradients(softcap, chunk, kw):
    hidden, weight, labels = inputs(torch.float32)
    ref = hf_loss(hidden, weight, labels, softcap, **kw)
    got = chunked_causal_lm_loss(hidden, weight, labels, softcap=softcap, chunk_tokens=chunk, **kw)
    assert rel(got, ref) < 1e-6
    for a, b in zip(grads(got, hidden, weight), grads(ref, hidden, weight)):
        assert rel(a, b) < 1e-6


def test_shift_labels_and_ignore_index():
    hidden, weight, labels = inputs(torch.float32)
    shift = torch.randint(0, weight.shape[0], labels.shape)
    shift[1, 4:] = -7
    ref = hf_loss(hidden, weight, None, shift_labels=shift, ignore_index=-7)
    got = chunked_causal_lm_loss(hidden, weight, None, shift_labels=shift, ignore_index=-7, chunk_tokens=5)
    assert rel(got, ref) < 1e-6
    for a, b in zip(grads(got, hidden, weight), grads(ref, hidden, weight)):
        assert rel(a, b) < 1e-6


@pytest.mark.parametrize("softcap", [None, 2.5])
def test_bf16_within_bf16_tolerance(softcap):
    hidden, weight, labels = inputs(torch.bfloat16, t=33, v=301)
    ref = hf_loss(hidden, weight, labels, softcap)
    got = chunked_causal_lm_loss(hidden, weight, labels, softcap=softcap, chunk_tokens=8)
    assert got.dtype == ref.dtype == torch.float32
    assert rel(got, ref) < 1e-3
    for a, b in zip(grads(got, hidden, weight), grads(ref, hidden, weight)):
        assert a.dtype == b.dtype == torch.bfloat16
        assert rel(a, b) < 2e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("accumulate", [False, True])
def test_weight_gradient_goes_into_the_sink(dtype, accumulate):
    """The sink's tensor gets the weight gradient (added, or written over what it held); autograd
    gets none for the weight. An fp32 sink under bf16 compute is filled in vocabulary blocks."""
    hidden, weight, labels = inputs(dtype, v=50)
    ref_w = grads(hf_loss(hidden, weight, labels), hidden, weight)[1].float()
    for sink_dtype in (dtype, torch.float32):
        held = torch.full(weight.shape, 3.0, dtype=sink_dtype)
        begun = []
        loss = chunked_causal_lm_loss(hidden, weight, labels, chunk_tokens=3, sink=lambda: (held, accumulate),
                                      begin=lambda: begun.append(1))
        (gh,) = torch.autograd.grad(loss, (hidden,))
        assert begun == [1]
        want = ref_w + 3.0 if accumulate else ref_w
        assert rel(held, want) < (1e-6 if dtype == torch.float32 else 2e-2)
        assert gh.shape == hidden.shape


def test_a_sink_with_nothing_to_write_and_a_frozen_weight():
    hidden, weight, labels = inputs(torch.float32)
    loss = chunked_causal_lm_loss(hidden, weight, labels, sink=lambda: None)
    loss.backward()
    assert weight.grad is None and hidden.grad is not None
    frozen = weight.detach()
    hidden.grad = None
    chunked_causal_lm_loss(hidden, frozen, labels, chunk_tokens=2).backward()
    ref = torch.autograd.grad(hf_loss(hidden, frozen, labels), hidden)[0]
    assert rel(hidden.grad, ref) < 1e-6


def test_all_ignored_is_nan_as_hf():
    hidden, weight, labels = inputs(torch.float32)
    labels[:] = -100
    assert torch.isnan(hf_loss(hidden, weight, labels))
    assert torch.isnan(chunked_causal_lm_loss(hidden, weight, labels))


def test_bad_inputs_are_refused():
    hidden, weight, labels = inputs(torch.float32)
    with pytest.raises(ValueError, match="positions of hidden states but"):
        chunked_causal_lm_loss(hidden[:, -1:], weight, labels)
    with pytest.raises(ValueError, match="chunk_tokens must be a positive int"):
        chunked_causal_lm_loss(hidden, weight, labels, chunk_tokens=0)


def test_forward_keeps_no_logits():
    """What the forward saves for backward is the inputs and one fp32 number per token."""
    hidden, weight, labels = inputs(torch.float32, t=40, v=200)
    flat = hidden.reshape(-1, hidden.shape[-1])
    targets = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].reshape(-1)
    total = ChunkedLinearCE.apply(flat, weight, targets, -100, None, 8, None, None)
    saved = total.grad_fn.saved_tensors
    assert max(t.numel() for t in saved) == max(flat.numel(), weight.numel())
    assert sum(t.numel() for t in saved) < flat.numel() + weight.numel() + 4 * flat.shape[0]
