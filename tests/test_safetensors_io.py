"""Reading flat ranges of tensors from safetensors files (pure I/O, no process group)."""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from yashard.safetensors_io import SafetensorsError, SafetensorsFile, read_flat_range, rows_covering


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


def test_safetensors_file_reads_every_range_without_a_memory_map(tmp_path):
    from yashard.safetensors_io import SafetensorsFile

    g = torch.Generator().manual_seed(1)
    tensors = {"mat": torch.randn(7, 5, generator=g), "half": torch.randn(13, generator=g).half(),
               "bf": torch.randn(2, 9, generator=g).bfloat16(), "ids": torch.arange(6)}
    path = tmp_path / "t.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    f = SafetensorsFile(path)
    assert set(f.keys()) == set(tensors) and f.metadata == {"format": "pt"}
    for name, t in tensors.items():
        assert f.shape(name) == tuple(t.shape) and f.dtype(name) == t.dtype
        flat = t.reshape(-1)
        assert torch.equal(f.read(name), flat)
        for lo in range(flat.numel() + 1):
            for hi in range(lo, flat.numel() + 1):
                assert torch.equal(f.read(name, lo, hi), flat[lo:hi]), (name, lo, hi)
    with pytest.raises(ValueError, match=r"flat range \[3, 99\) is outside mat of shape \[7, 5\]"):
        f.read("mat", 3, 99)


def test_safetensors_file_rejects_broken_files(tmp_path):
    import struct

    from yashard.safetensors_io import SafetensorsError, SafetensorsFile

    good = tmp_path / "good.safetensors"
    save_file({"a": torch.ones(64), "b": torch.zeros(8, 8)}, str(good))
    raw = good.read_bytes()
    cases = {
        "tiny": (b"\x01\x02", r"too short for a safetensors header"),
        "huge_header": (struct.pack("<Q", 10**12) + b"{}", r"header length 1000000000000 does not fit the file"),
        "not_json": (struct.pack("<Q", 4) + b"nope", r"the header is not valid JSON"),
        "truncated": (raw[: len(raw) - 100], r"claims bytes \[\d+, \d+\) but the data section holds \d+ bytes"),
        "pickle": (b"\x80\x04\x95" + b"\x00" * 40, r"does not fit the file|not valid JSON"),
    }
    for name, (data, pattern) in cases.items():
        path = tmp_path / f"{name}.safetensors"
        path.write_bytes(data)
        with pytest.raises(SafetensorsError, match=pattern):
            SafetensorsFile(path)


def test_aborting_a_streamed_file_on_a_full_disk_does_not_raise_again(tmp_path):
    """abort() runs while a write error is being handled; closing flushes the buffer, which fails
    again on a full disk (/dev/full): that second error must not replace the first."""
    from yashard._io import StreamedSafetensors

    w = StreamedSafetensors(tmp_path / "x.safetensors", [("a", torch.float32, (4,))])
    w._f.close()
    w._f = open("/dev/full", "wb")   # every flush fails with ENOSPC
    w._f.write(b"x" * 16)
    with pytest.raises(OSError):
        w._f.flush()
    w.abort()


def test_tensors_of_dtypes_torch_lacks_are_kept_out_until_read(tmp_path):
    """A valid file may hold tensors of other dtypes (U16/U32/U64, F8_E8M0, C64, or one this torch has
    no type for): the file opens and its float tensors read (before, one such entry refused the whole
    file as a bad header); reading such a tensor names its dtype."""
    import json
    import struct

    weight = torch.arange(6, dtype=torch.float32)
    header = {"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
              "counter": {"dtype": "U32", "shape": [2], "data_offsets": [24, 32]},
              "odd": {"dtype": "F4_NEW", "shape": [4], "data_offsets": [32, 34]}}
    blob = json.dumps(header).encode()
    path = tmp_path / "mixed.safetensors"
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + weight.numpy().tobytes()
                     + torch.tensor([7, 9], dtype=torch.int32).numpy().tobytes() + b"\x00\x00")
    f = SafetensorsFile(str(path))
    assert set(f.keys()) == {"w", "counter", "odd"}
    assert torch.equal(f.read("w"), weight)
    assert f.dtype("counter") == torch.uint32 and f.read("counter").tolist() == [7, 9]
    with pytest.raises(SafetensorsError, match="'odd' is stored as F4_NEW, a dtype this torch"):
        f.dtype("odd")
