"""The global gradient norm's local part: accurate for long fp32 shards, for any length."""

import torch

from yashard.grad_norm import squares_per_tensor as _squares_per_tensor


def test_squares_per_tensor_is_accurate_on_long_fp32_shards():
    g = torch.Generator().manual_seed(0)
    t = torch.randn(5_000_003, generator=g) * 1e-3   # several slices, the last one short
    exact = t.double().pow(2).sum()
    got = _squares_per_tensor([t])
    assert got.dtype == torch.float64 and got.shape == (1,)
    assert abs(got.item() / exact.item() - 1) < 1e-6


def test_squares_per_tensor_short_empty_and_several():
    assert _squares_per_tensor([torch.tensor([3.0, 4.0])]).tolist() == [25.0]
    assert _squares_per_tensor([torch.zeros(0), torch.tensor([2.0]), torch.tensor([float("nan")])])[:2].tolist() == [0.0, 4.0]
