"""Reading flat ranges of tensors from safetensors files (pure I/O, no process group)."""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from yashard.safetensors_io import read_flat_range, rows_covering


def test_rows_covering():
    assert rows_covering((4, 5), 0, 20) == (0, 4, 0)
    assert rows_covering((4, 5), 7, 12) == (1, 3, 2)
    assert rows_covering((4, 5), 10, 10) == (2, 2, 0)
    assert rows_covering((9,), 3, 5) == (3, 5, 0)
    with pytest.raises(ValueError, match=r"flat range \[3, 21\) is outside a tensor of shape \(4, 5\) \(20 elements\)"):
        rows_covering((4, 5), 3, 21)


def test_every_range_of_every_shape(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"mat": torch.randn(7, 5, generator=g), "vec": torch.randn(11, generator=g),
               "cube": torch.randn(3, 4, 5, generator=g).bfloat16(), "scalar": torch.tensor(3.5)}
    path = tmp_path / "t.safetensors"
    save_file(tensors, str(path))
    with safe_open(str(path), "pt") as h:
        for name, t in tensors.items():
            flat = t.reshape(-1)
            for lo in range(flat.numel() + 1):
                for hi in range(lo + 1, flat.numel() + 1):
                    got = read_flat_range(h, name, tuple(t.shape), lo, hi)
                    assert got.dtype == t.dtype and torch.equal(got, flat[lo:hi]), (name, lo, hi)
