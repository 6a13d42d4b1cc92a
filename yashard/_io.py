"""File-system helpers for checkpoints and exports: durable writes, atomic swaps, streamed safetensors.

Nothing here touches torch.distributed. Everything that makes a checkpoint crash-safe lives here:

* :class:`StreamedSafetensors` writes a safetensors file tensor by tensor (the header first, then
  each tensor's bytes), so a writer never holds more than one tensor's CPU copy; the result is a
  standard file that ``safetensors.safe_open`` reads.
* :func:`fsync_file` / :func:`fsync_dir` / :func:`write_text_atomic` make data durable before the
  rename that publishes it.
* :func:`exchange_dirs` swaps two directories in one step (Linux ``renameat2(RENAME_EXCHANGE)``).
* :func:`sniff_foreign_format` recognises pickle and ``torch.save`` files by their first bytes, so
  they are refused by name and never unpickled.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import math
import os
import struct
from pathlib import Path
from typing import Sequence

import torch

ST_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}


class StreamedSafetensors:
    """Write a safetensors file whose tensors are declared up front and written one at a time.

    ``specs`` lists ``(key, dtype, shape)`` in the order the tensors will be passed to
    :meth:`write`. The header (with ``metadata`` as ``__metadata__``) is written on construction;
    :meth:`close` checks that every declared tensor was written, flushes and fsyncs the file.
    """

    def __init__(self, path: str | os.PathLike, specs: Sequence[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        header: dict[str, object] = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        offset = 0
        self._expected: list[tuple[str, torch.dtype, tuple[int, ...], int]] = []
        for key, dtype, shape in specs:
            if key in header:
                raise ValueError(f"tensor key {key!r} is declared twice")
            if dtype not in ST_DTYPES:
                raise ValueError(f"tensor {key!r} has dtype {dtype}, which safetensors cannot store")
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            header[key] = {"dtype": ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self._expected.append((key, dtype, tuple(shape), nbytes))
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self.path = Path(path)
        self.nbytes = 8 + len(raw) + offset
        self._f = open(self.path, "wb")
        self._f.write(struct.pack("<Q", len(raw)))
        self._f.write(raw)
        self._next = 0

    def write(self, key: str, tensor: torch.Tensor) -> None:
        """Append the next declared tensor (any device; it is copied to the CPU if needed)."""
        if self._next >= len(self._expected):
            raise ValueError(f"tensor {key!r} was not declared (all {len(self._expected)} are written)")
        want_key, dtype, shape, nbytes = self._expected[self._next]
        if key != want_key or tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(
                f"tensor {self._next} must be {want_key!r} {dtype} {shape}, got {key!r} {tensor.dtype} {tuple(tensor.shape)}"
            )
        if nbytes:
            t = tensor.detach().to("cpu").contiguous().reshape(-1)
            self._f.write(memoryview(t.view(torch.uint8).numpy()))
        self._next += 1

    def close(self) -> None:
        """Check completeness, flush and fsync. The file is durable when this returns."""
        if self._next != len(self._expected):
            self._f.close()
            raise ValueError(f"{self.path}: only {self._next} of {len(self._expected)} declared tensors were written")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()

    def abort(self) -> None:
        """Close without the completeness check (the file stays partial; its directory is never
        published). Never raises: it runs while another error (a full disk, say) is handled, and
        closing flushes the buffer, which fails again on a full disk."""
        with contextlib.suppress(OSError):
            self._f.close()


def fsync_file(path: str | os.PathLike) -> None:
    """Flush ``path``'s data to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make the directory entries of ``path`` (files created or renamed in it) durable (POSIX only)."""
    if not hasattr(os, "O_DIRECTORY"):  # pragma: no cover - Windows has no directory fsync
        return
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as e:  # pragma: no cover - some file systems refuse fsync on directories
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Replace ``path`` by a file holding ``text`` in one rename: readers see the old or the new file, never a mix."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def exchange_dirs(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Atomically swap the directories ``a`` and ``b`` (both must exist).

    Returns False when the platform or file system cannot (no ``renameat2``, or NFS); the caller
    then falls back to two renames.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):  # pragma: no cover
        return False
    raise OSError(err, f"renameat2(RENAME_EXCHANGE) failed: {os.strerror(err)}", str(a), None, str(b))


def sniff_foreign_format(path: str | os.PathLike) -> str | None:
    """Name the format of ``path`` if it is a pickle or a ``torch.save`` archive, else None.

    Reads the first bytes only; never unpickles anything.
    """
    with open(path, "rb") as f:
        head = f.read(4)
    if head[:2] in (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05"):
        return "a pickle file"
    if head == b"PK\x03\x04":
        return "a zip archive (torch.save writes these; they hold pickles)"
    return None
