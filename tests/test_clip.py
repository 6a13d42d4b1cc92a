"""The global gradient norm's local part: accurate for long fp32 shards, for any length."""

import torch

from yashard.runtime import _sum_of_squares


def test_sum_of_squares_is_accurate_on_long_fp32_shards():
    g = torch.Generator().manual_seed(0)
    t = torch.randn(5_000_003, generator=g) * 1e-3   # several slices, the last one short
    exact = t.double().pow(2).sum()
    got = _sum_of_squares([t])
    assert got.dtype == torch.float64
    assert abs(got.item() / exact.item() - 1) < 1e-6


def test_sum_of_squares_short_empty_and_several():
    assert _sum_of_squares([torch.tensor([3.0, 4.0])]).item() == 25.0
    assert _sum_of_squares([torch.zeros(0), torch.tensor([2.0])]).item() == 4.0
