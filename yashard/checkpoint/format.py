"""The on-disk format of a yashard checkpoint: directory and file names, tensor keys, the encoding
of values that are not tensors, finding a committed save and reading its index (checked: the pieces
tile every parameter), the model's description and fingerprint; and :func:`agree`, which shares
every rank's error in each collective step of a save or a load.

On-disk format (``format_version`` 3)
-------------------------------------
::

    <path>/                                   what save_checkpoint / load_checkpoint are given
      LATEST                                  one line: the name of the committed save directory
      save-000007-3fa2c1d0/                   one directory per save: save-<sequence>-<random>
        shard-00000-of-00002.safetensors      what shard rank 0 of 2 owned
        shard-00001-of-00002.safetensors
        index.json                            written last, by rank 0

Each shard file holds, for every parameter piece inside that rank's flat shards (``layout.shard_pieces``),
one 1-D tensor per kind, keyed ``<kind>/<HF name>[<lo>:<hi>]`` where ``[lo, hi)`` is the piece's range
of the parameter's flattened elements and the kind is ``master`` (the master weights, in the dtype
the run keeps them in: fp32, or a frozen unit's 16-bit ``param_dtype``) or
``optim.<state key>`` (every optimizer state tensor with the master's shape: AdamW ``exp_avg`` /
``exp_avg_sq``, amsgrad ``max_exp_avg_sq``, SGD ``momentum_buffer``, ...). Padding is not stored.
Rank 0's file also holds the model's persistent buffers (what ``state_dict()`` holds besides
parameters: a router's score-correction bias, ...), whole, keyed ``buffer/<name>``: every rank has
the same copy, and a training loop may change them.

``index.json`` holds ``format`` / ``format_version`` / ``yashard_version`` / ``torch_version``; the
world, shard world and replica world of the save; ``model`` (class, config class, the config itself,
and a sha256 ``fingerprint`` of the parameter names, shapes and ties); ``files`` (name -> bytes and
shard rank); ``params`` (every HF parameter, by its canonical name: full ``shape``, the ``unit``,
the names ``tied`` to it, the ``dtype`` its master pieces are stored in (version 3 on; absent:
``float32``), and its ``pieces``: file, ``lo``, ``hi``, the tensor key per kind and the
``crc32`` of each tensor's bytes, checked at load over every piece a rank reads); ``buffers``
(name -> file, key, dtype, shape, crc32; version 2 on: version 1 saves stored none, and loading one
leaves the model's buffers as they are);
``optimizer`` (``null`` or: class, module, ``param_groups`` as unit names plus every
hyperparameter but ``params``, and per unit the sharded state keys with their dtypes and the
replicated scalars, e.g. AdamW's ``step``, checked equal on every rank and taken from rank 0); and the user's ``extra``.
Each shard file's safetensors metadata names the save that wrote it (``save``), so a file copied in
from another save is refused. Non-JSON values (0-d tensors, tuples) are stored as tagged objects (``{"__tensor__": dtype,
"value": x}``, ``{"__tuple__": [...]}``). Nothing is ever pickled; a pickle or ``torch.save``
file where a shard should be is refused unread.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch

from .._io import ST_DTYPES
from ..config import dtype_name

if TYPE_CHECKING:  # pragma: no cover
    from ..collectives import Comm
    from ..runtime import Runtime

FORMAT = "yashard-checkpoint"
# 2: persistent buffers are stored (a version-1 reader would drop them). 3: master pieces may be
# stored in a 16-bit dtype (frozen units under a 16-bit param_dtype), named per parameter; a save
# whose masters are all fp32 is written as version 2, which version-2 readers load.
FORMAT_VERSION = 3
FP32_MASTERS_VERSION = 2
INDEX = "index.json"
POINTER = "LATEST"
SAVE_DIR_RE = re.compile(r"^save-(\d{6,})-([0-9a-f]{8})$")
SHARD_FILE_RE = re.compile(r"^shard-(\d{5,})-of-(\d{5,})\.safetensors$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded: the message names the file or the mismatch, and the fix."""


# ------------------------------------------------------------------------------------------------
# Pure helpers (unit-tested without a process group)


def shard_file_name(shard_rank: int, shard_world: int) -> str:
    """The file that shard rank ``shard_rank`` of ``shard_world`` writes."""
    return f"shard-{shard_rank:05d}-of-{shard_world:05d}.safetensors"


def piece_key(kind: str, name: str, lo: int, hi: int) -> str:
    """Tensor key of the piece ``[lo, hi)`` of parameter ``name`` (kind ``master`` or ``optim.<key>``)."""
    return f"{kind}/{name}[{lo}:{hi}]"


def buffer_key(name: str) -> str:
    """Tensor key of persistent buffer ``name`` in rank 0's shard file."""
    return f"buffer/{name}"


def overlaps(ranges: Sequence[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int, int]]:
    """``(i, a, b)`` for every ``ranges[i]`` that intersects ``[lo, hi)``; ``[a, b)`` is the intersection."""
    out = []
    for i, (r0, r1) in enumerate(ranges):
        a, b = max(r0, lo), min(r1, hi)
        if a < b:
            out.append((i, a, b))
    return out


def coverage_problem(numel: int, ranges: Sequence[tuple[int, int]]) -> str | None:
    """None if ``ranges`` tile ``[0, numel)`` exactly (no gap, no overlap), else what is wrong."""
    cursor = 0
    for r0, r1 in sorted(ranges):
        if not 0 <= r0 < r1 <= numel:
            return f"piece [{r0}, {r1}) is outside [0, {numel})"
        if r0 > cursor:
            return f"elements [{cursor}, {r0}) are in no piece"
        if r0 < cursor:
            return f"pieces overlap at [{r0}, {min(cursor, r1)})"
        cursor = r1
    if cursor != numel:
        return f"elements [{cursor}, {numel}) are in no piece"
    return None


def describe_params(params: dict[str, dict]) -> dict[str, str]:
    """``name -> "shape (a, b)"`` for every parameter and ``alias -> "tied to name"`` for tied names."""
    out: dict[str, str] = {}
    for name, p in params.items():
        out[name] = f"shape {tuple(p['shape'])}"
        for alias in p.get("tied", []):
            out[alias] = f"tied to {name}"
    return out


def params_diff(ckpt: dict[str, str], model: dict[str, str], limit: int = 5) -> list[str]:
    """The first ``limit`` differences between two :func:`describe_params` results, one line each."""
    lines = []
    for name in sorted(set(ckpt) | set(model)):
        if name not in model:
            lines.append(f"{name}: in the checkpoint ({ckpt[name]}), not in the model")
        elif name not in ckpt:
            lines.append(f"{name}: in the model ({model[name]}), not in the checkpoint")
        elif ckpt[name] != model[name]:
            lines.append(f"{name}: checkpoint {ckpt[name]}, model {model[name]}")
    if len(lines) > limit:
        lines = lines[:limit] + [f"... and {len(lines) - limit} more"]
    return lines


def fingerprint(described: dict[str, str]) -> str:
    """sha256 of the sorted parameter descriptions (names, shapes, ties)."""
    return hashlib.sha256(json.dumps(sorted(described.items())).encode()).hexdigest()


def tensor_crc32(t: torch.Tensor, crc: int = 0) -> int:
    """CRC-32 of a contiguous CPU tensor's bytes (any dtype), continuing ``crc``."""
    return zlib.crc32(t.contiguous().view(-1).view(torch.uint8).numpy(), crc)


def dtype_from_name(name: str) -> torch.dtype:
    """The dtype an index names (``"float32"``: ``torch.float32``); an unknown name is a damaged index."""
    d = getattr(torch, str(name), None)
    if not isinstance(d, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in the checkpoint index")
    return d


def encode_value(v: Any, where: str) -> Any:
    """A JSON-ready form of an optimizer hyperparameter or scalar state value (inverse: :func:`decode_value`).

    JSON values pass through; 0-d tensors and tuples become tagged objects. Anything else raises
    ``TypeError`` naming ``where``.
    """
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, torch.Tensor) and v.dim() == 0 and v.dtype in ST_DTYPES:
        return {"__tensor__": dtype_name(v.dtype), "value": v.item()}
    if isinstance(v, tuple):
        return {"__tuple__": [encode_value(x, f"{where}[{i}]") for i, x in enumerate(v)]}
    if isinstance(v, list):
        return [encode_value(x, f"{where}[{i}]") for i, x in enumerate(v)]
    if isinstance(v, dict) and all(isinstance(k, str) and not k.startswith("__") for k in v):
        return {k: encode_value(x, f"{where}[{k!r}]") for k, x in v.items()}
    what = f"a {tuple(v.shape)} tensor" if isinstance(v, torch.Tensor) else f"a {type(v).__name__}"
    raise TypeError(
        f"{where} is {what}, which a yashard checkpoint cannot store: it keeps optimizer tensors of the "
        "master's shape (sharded), 0-d tensors, and JSON values (None, bool, int, float, str, lists, "
        "tuples, dicts with str keys)"
    )


def decode_value(v: Any) -> Any:
    """Inverse of :func:`encode_value` (0-d tensors come back on the CPU)."""
    if isinstance(v, list):
        return [decode_value(x) for x in v]
    if isinstance(v, dict):
        if "__tensor__" in v:
            return torch.tensor(v["value"], dtype=dtype_from_name(v["__tensor__"]))
        if "__tuple__" in v:
            return tuple(decode_value(x) for x in v["__tuple__"])
        return {k: decode_value(x) for k, x in v.items()}
    return v


def check_extra(extra: Any) -> Any:
    """Return ``extra`` as it will be loaded (its JSON round trip), or raise ``TypeError`` naming the bad part."""

    def walk(x, where):
        if x is None or isinstance(x, (bool, int, float, str)):
            return
        if isinstance(x, (list, tuple)):
            for i, y in enumerate(x):
                walk(y, f"{where}[{i}]")
            return
        if isinstance(x, dict):
            for k, y in x.items():
                if not isinstance(k, str):
                    raise TypeError(
                        f"save_checkpoint(extra=...) must be JSON-serialisable: {where} has the non-string key "
                        f"{k!r}; use string keys"
                    )
                walk(y, f"{where}[{k!r}]")
            return
        hint = " (use .item() or .tolist())" if isinstance(x, torch.Tensor) else ""
        raise TypeError(
            f"save_checkpoint(extra=...) must be JSON-serialisable: {where} is a {type(x).__name__}{hint}; "
            "store plain numbers, strings, lists and dicts (e.g. the step number, scheduler.state_dict())"
        )

    walk(extra, "extra")
    return json.loads(json.dumps(extra))


# ------------------------------------------------------------------------------------------------
# Collective plumbing and the model's description


def agree(comm: "Comm", what: str, err: BaseException | None, payload: Any = None) -> list:
    """Share every rank's error and ``payload``; raise on every rank if any rank failed."""
    msg = None if err is None else f"{type(err).__name__}: {err}"
    got = comm.all_gather_object((msg, payload), what)
    if err is not None:
        raise err
    for r, (m, _) in enumerate(got):
        if m is not None:
            raise CheckpointError(f"{what} failed on rank {r}: {m}")
    return [p for _, p in got]


def save_version(rt: "Runtime") -> int:
    """The format version a save of ``rt`` is written as: the lowest that describes it (a reader of
    version 2 would take a 16-bit master piece for a damaged file)."""
    return FORMAT_VERSION if any(u.master.dtype != torch.float32 for u in rt.units) else FP32_MASTERS_VERSION


def model_params(rt: "Runtime") -> dict[str, dict]:
    """Every parameter of the sharded model by canonical HF name: shape, unit, tied names."""
    out = {}
    for u in rt.units:
        for e, fqns in zip(u.layout.entries, u.fqns):
            out[fqns[0]] = {"shape": list(e.shape), "unit": u.name, "tied": list(fqns[1:])}
    return out


# ------------------------------------------------------------------------------------------------
# Finding a committed save and reading its index


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """The committed save directory that ``path`` (a checkpoint root or a save directory) refers to."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint path {p} does not exist")
    if not p.is_dir():
        raise CheckpointError(f"checkpoint path {p} is a file; pass the directory given to save_checkpoint")
    if (p / INDEX).is_file():
        return p
    if (p / POINTER).is_file():
        name = (p / POINTER).read_text(encoding="utf-8").strip()
        if not SAVE_DIR_RE.match(name):
            raise CheckpointError(f"{p / POINTER} is corrupt: it should name a save-<n>-<hex> directory, it holds {name[:80]!r}")
        if not (p / name / INDEX).is_file():
            raise CheckpointError(
                f"{p / POINTER} names {name}, but {p / name / INDEX} is missing: the committed save was removed or "
                "damaged after it was written; restore it or load an earlier checkpoint"
            )
        return p / name
    entries = sorted(os.listdir(p))
    if SAVE_DIR_RE.match(p.name) or any(SHARD_FILE_RE.match(n) for n in entries):
        raise CheckpointError(
            f"{p} is an incomplete save (no {INDEX}): the save that wrote it was interrupted before it committed, "
            f"so it is never loaded; load its parent directory, whose {POINTER} names the last complete save"
        )
    saves = [n for n in entries if SAVE_DIR_RE.match(n)]
    if saves:
        raise CheckpointError(
            f"{p} holds no committed checkpoint: no {POINTER} file, only the interrupted save(s) {', '.join(saves)} "
            "(a save killed before its commit leaves this); save again, or load an earlier checkpoint"
        )
    if "config.json" in entries:
        raise CheckpointError(
            f"{p} is not a yashard checkpoint (no {POINTER} or {INDEX}); it looks like a HuggingFace model folder: "
            "load it with from_pretrained and pass the model to yashard.shard"
        )
    raise CheckpointError(f"{p} is not a yashard checkpoint (no {POINTER} or {INDEX} in it)")


def read_index(save_dir: Path) -> dict:
    """Read and check ``save_dir/index.json`` (format, version, file names, piece coverage)."""
    f = save_dir / INDEX
    try:
        index = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{f} is not a readable JSON index ({e}); the checkpoint is damaged") from e
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise CheckpointError(f"{f} is not a yashard checkpoint index (its 'format' is not {FORMAT!r})")
    version = index.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(
            f"{f} has format_version {version!r}, written by yashard {index.get('yashard_version')}; this yashard "
            f"reads format_version <= {FORMAT_VERSION}: upgrade yashard"
        )
    for fname in index["files"]:
        if not SHARD_FILE_RE.match(fname):
            raise CheckpointError(f"{f} lists the file {fname!r}, which is not a shard file name; the index is damaged")
    for name, p in index["params"].items():
        for pc in p["pieces"]:
            if pc["file"] not in index["files"]:
                raise CheckpointError(f"{f}: a piece of {name} is in {pc['file']!r}, which the index does not list")
        problem = coverage_problem(math.prod(p["shape"]), [(pc["lo"], pc["hi"]) for pc in p["pieces"]])
        if problem:
            raise CheckpointError(f"{f}: the pieces of {name} do not cover it ({problem}); the index is damaged")
    for name, b in (index.get("buffers") or {}).items():
        if b["file"] not in index["files"]:
            raise CheckpointError(f"{f}: buffer {name} is in {b['file']!r}, which the index does not list")
    return index
