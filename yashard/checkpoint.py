"""Sharded checkpoints: every rank saves its own flat pieces; a load at any world size reads back
exactly the ranges it owns.

On-disk format (``format_version`` 2)
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
of the parameter's flattened elements and the kind is ``master`` (the fp32 master weights) or
``optim.<state key>`` (every optimizer state tensor with the master's shape: AdamW ``exp_avg`` /
``exp_avg_sq``, amsgrad ``max_exp_avg_sq``, SGD ``momentum_buffer``, ...). Padding is not stored.
Rank 0's file also holds the model's persistent buffers (what ``state_dict()`` holds besides
parameters: a router's score-correction bias, ...), whole, keyed ``buffer/<name>``: every rank has
the same copy, and a training loop may change them.

``index.json`` holds ``format`` / ``format_version`` / ``yashard_version`` / ``torch_version``; the
world, shard world and replica world of the save; ``model`` (class, config class, the config itself,
and a sha256 ``fingerprint`` of the parameter names, shapes and ties); ``files`` (name -> bytes and
shard rank); ``params`` (every HF parameter, by its canonical name: full ``shape``, the ``unit``,
the names ``tied`` to it, and its ``pieces``: file, ``lo``, ``hi``, the tensor key per kind and the
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

Atomic protocol
---------------
1. Every rank validates its input (``extra``, optimizer state); rank 0 validates ``<path>`` and
   creates a fresh ``save-<seq>-<random>`` directory. One ``all_gather_object`` shares rank 0's
   choice and every rank's error: a problem on any rank is raised on all ranks, nothing written.
2. Every rank with ``replica_rank == 0`` streams its shard file (header first, one tensor at a
   time) and fsyncs it. An ``all_gather_object`` of the files' descriptions is the barrier
   "every shard file is durable".
3. Rank 0 writes ``index.json`` (temp file, fsync, rename) and fsyncs the save directory, then
   writes ``LATEST.tmp``, fsyncs it and ``os.replace``-s it onto ``LATEST`` and fsyncs ``<path>``.
   That rename is the commit point.
4. Rank 0 removes every other ``save-*`` directory (the previous save and leftovers of killed
   saves). A last ``all_gather_object`` makes every rank return only after the commit.

A crash or kill at any moment before the rename of step 3 leaves ``LATEST`` naming the previous,
untouched save; after it, the new one. ``load_checkpoint`` follows ``LATEST``; given a save
directory without ``index.json`` (a save that never committed) it refuses with a message saying so.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import re
import secrets
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch

from ._io import ST_DTYPES, StreamedSafetensors, fsync_dir, sniff_foreign_format, write_text_atomic
from .config import _dtype_name
from .layout import shard_pieces
from .safetensors_io import read_flat_range

if TYPE_CHECKING:  # pragma: no cover
    from .collectives import Comm
    from .runtime import Runtime

logger = logging.getLogger("yashard")

FORMAT = "yashard-checkpoint"
FORMAT_VERSION = 2  # 2: persistent buffers are stored (a version-1 reader would drop them)
INDEX = "index.json"
_CRC_CHUNK = 1 << 22  # elements per read while checking a piece's checksum
POINTER = "LATEST"
SAVE_DIR_RE = re.compile(r"^save-(\d{6,})-([0-9a-f]{8})$")
SHARD_FILE_RE = re.compile(r"^shard-(\d{5,})-of-(\d{5,})\.safetensors$")
_ST_NAMES = {v: k for k, v in ST_DTYPES.items()}


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


def _dtype_from_name(name: str) -> torch.dtype:
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
        return {"__tensor__": _dtype_name(v.dtype), "value": v.item()}
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
            return torch.tensor(v["value"], dtype=_dtype_from_name(v["__tensor__"]))
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
# Collective plumbing


def _runtime(model, what: str) -> "Runtime":
    from .api import ShardedModel

    if not isinstance(model, ShardedModel):
        raise TypeError(f"{what} expects the ShardedModel returned by yashard.shard, got {type(model).__name__}")
    return model.runtime


def _agree(comm: "Comm", what: str, err: BaseException | None, payload: Any = None) -> list:
    """Share every rank's error and ``payload``; raise on every rank if any rank failed."""
    msg = None if err is None else f"{type(err).__name__}: {err}"
    got = comm.all_gather_object((msg, payload), what)
    if err is not None:
        raise err
    for r, (m, _) in enumerate(got):
        if m is not None:
            raise CheckpointError(f"{what} failed on rank {r}: {m}")
    return [p for _, p in got]


def model_params(rt: "Runtime") -> dict[str, dict]:
    """Every parameter of the sharded model by canonical HF name: shape, unit, tied names."""
    out = {}
    for u in rt.units:
        for e, fqns in zip(u.layout.entries, u.fqns):
            out[fqns[0]] = {"shape": list(e.shape), "unit": u.name, "tied": list(fqns[1:])}
    return out


def persistent_buffers(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of every buffer ``model.state_dict()`` holds (persistent, not None), each
    tensor once (under its first name), less the model's ``_keys_to_ignore_on_save``: what
    ``save_pretrained`` stores besides parameters."""
    ignore = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    out, seen = [], set()
    for mod_name, module in model.named_modules():
        for name, buf in module._buffers.items():
            fqn = f"{mod_name}.{name}" if mod_name else name
            if buf is None or name in module._non_persistent_buffers_set or fqn in ignore or id(buf) in seen:
                continue
            seen.add(id(buf))
            out.append((fqn, buf))
    return out


def buffer_key(name: str) -> str:
    """Tensor key of persistent buffer ``name`` in rank 0's shard file."""
    return f"buffer/{name}"


def _config_dict(hf) -> dict | None:
    cfg = getattr(hf, "config", None)
    if cfg is None or not hasattr(cfg, "to_json_string"):
        return None
    return json.loads(cfg.to_json_string(use_diff=False))


# ------------------------------------------------------------------------------------------------
# Save


def optimizer_units(rt: "Runtime", optimizer) -> list[list]:
    """Per param group of ``optimizer``, the units whose master shards it holds (refusing anything else)."""
    unit_of = {id(u.master): u for u in rt.units}
    groups = []
    for gi, g in enumerate(optimizer.param_groups):
        units = []
        for p in g["params"]:
            u = unit_of.get(id(p))
            if u is None:
                raise ValueError(
                    f"optimizer param group {gi} holds a tensor of shape {tuple(p.shape)} that is not a master "
                    "shard of this model; build the optimizer from model.parameters() or model.param_groups(...)"
                )
            units.append(u)
        groups.append(units)
    return groups


def _optimizer_meta(optimizer, rt: "Runtime") -> dict | None:
    """Classify the optimizer's state (sharded tensors / replicated scalars) and encode its groups."""
    if optimizer is None:
        return None
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
    groups = []
    for gi, (g, units) in enumerate(zip(optimizer.param_groups, optimizer_units(rt, optimizer))):
        names = [u.name for u in units]
        hparams = {k: encode_value(v, f"optimizer.param_groups[{gi}][{k!r}]") for k, v in g.items() if k != "params"}
        groups.append({"units": names, "hparams": hparams})
    state = {}
    for u in rt.units:
        st = optimizer.state.get(u.master)
        if not st:
            continue
        sharded, scalars = {}, {}
        for k, v in st.items():
            where = f"optimizer state {k!r} of unit {u.name}"
            if not isinstance(k, str):
                raise TypeError(f"{where}: state keys must be strings to be checkpointed")
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                if tuple(v.shape) != tuple(u.master.shape):
                    encode_value(v, where)  # raises, naming the shape
                if v.dtype not in ST_DTYPES:
                    raise TypeError(f"{where} has dtype {v.dtype}, which safetensors cannot store")
                sharded[k] = _dtype_name(v.dtype)
            else:
                scalars[k] = encode_value(v, where)
        state[u.name] = {"sharded": sharded, "scalars": scalars}
    return {"class": type(optimizer).__qualname__, "module": type(optimizer).__module__,
            "param_groups": groups, "state": state}


def _prepare_root(root: Path) -> str:
    """Check ``root`` (rank 0), create it and a fresh save directory in it; return that directory's name."""
    if root.exists() and not root.is_dir():
        raise CheckpointError(f"save_checkpoint path {root} is a file; pass a directory (it is created if missing)")
    seq = 0
    if root.is_dir():
        foreign = []
        for name in sorted(os.listdir(root)):
            m = SAVE_DIR_RE.match(name)
            if m and (root / name).is_dir():
                seq = max(seq, int(m.group(1)))
            elif name != POINTER and not name.startswith(f".{POINTER}.tmp-"):
                foreign.append(name)
        if foreign:
            shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
            raise CheckpointError(
                f"save_checkpoint path {root} exists and is not a yashard checkpoint directory (it holds {shown}); "
                "save into a new or empty directory, or into an existing yashard checkpoint to replace it"
            )
    name = f"save-{seq + 1:06d}-{secrets.token_hex(4)}"
    (root / name).mkdir(parents=True)
    return name


def _jobs(rt: "Runtime", shard_rank: int, sharded: dict[str, dict[str, str]]):
    """What one rank writes: ``(key, unit, kind, shard_start, numel)`` grouped by unit and kind, plus piece metadata."""
    jobs, pieces = [], []
    for u in rt.units:
        kinds = ["master"] + [f"optim.{k}" for k in sharded.get(u.name, {})]
        unit_pieces = shard_pieces(u.layout, shard_rank)
        for pc in unit_pieces:
            name = u.fqns[pc.entry][0]
            pieces.append({"param": name, "lo": pc.entry_start, "hi": pc.entry_end,
                           "keys": {k: piece_key(k, name, pc.entry_start, pc.entry_end) for k in kinds}})
        for kind in kinds:
            for pc in unit_pieces:
                name = u.fqns[pc.entry][0]
                jobs.append((piece_key(kind, name, pc.entry_start, pc.entry_end), u, kind, pc.shard_start, pc.numel))
    return jobs, pieces


def _write_rank_file(save_dir: Path, rt: "Runtime", optimizer, opt_meta: dict | None) -> dict:
    comm = rt.comm
    state_meta = opt_meta["state"] if opt_meta else {}
    sharded = {unit: s["sharded"] for unit, s in state_meta.items()}
    jobs, pieces = _jobs(rt, comm.shard_rank, sharded)

    def source(u, kind) -> torch.Tensor:
        if kind == "master":
            return u.master.detach()
        return optimizer.state[u.master][kind[len("optim."):]].detach()

    specs = [(key, source(u, kind).dtype, (n,)) for key, u, kind, _, n in jobs]
    buffers = persistent_buffers(rt.model) if comm.rank == 0 else []  # (replicated: rank 0's copy)
    for name, b in buffers:
        if b.dtype not in ST_DTYPES:
            raise TypeError(f"buffer {name} has dtype {b.dtype}, which a yashard checkpoint (safetensors) cannot store")
        specs.append((buffer_key(name), b.dtype, tuple(b.shape)))
    fname = shard_file_name(comm.shard_rank, comm.shard_world)
    writer = StreamedSafetensors(save_dir / fname, specs, metadata={
        "format": "pt", "yashard_checkpoint": str(FORMAT_VERSION),
        "shard_rank": str(comm.shard_rank), "shard_world": str(comm.shard_world), "save": save_dir.name})
    crcs: dict[str, int] = {}
    try:
        cached: tuple[Any, str, torch.Tensor] | None = None
        with torch.no_grad():
            for key, u, kind, start, n in jobs:
                if cached is None or cached[0] is not u or cached[1] != kind:
                    cached = (u, kind, source(u, kind).to("cpu"))  # one unit's shard on the host at a time
                piece = cached[2][start:start + n]
                crcs[key] = tensor_crc32(piece)
                writer.write(key, piece)
            stored = {}
            for name, b in buffers:
                value = b.detach().to("cpu").contiguous()
                stored[name] = {"file": fname, "key": buffer_key(name), "dtype": _dtype_name(b.dtype),
                                "shape": list(b.shape), "crc32": tensor_crc32(value)}
                writer.write(buffer_key(name), value)
    except BaseException:
        writer.abort()
        raise
    writer.close()
    for pc in pieces:
        pc["crc32"] = {kind: crcs[key] for kind, key in pc["keys"].items()}
    return {"file": fname, "bytes": writer.nbytes, "shard_rank": comm.shard_rank, "pieces": pieces,
            "buffers": stored if comm.rank == 0 else None}


def _build_index(rt: "Runtime", metas: list[dict], opt_meta: dict | None, extra: Any) -> dict:
    """The index, from rank 0's view of the model and every writer's file description."""
    from . import __version__

    comm = rt.comm
    params = model_params(rt)
    for p in params.values():
        p["pieces"] = []
    files = {}
    for meta in metas:
        files[meta["file"]] = {"bytes": meta["bytes"], "shard_rank": meta["shard_rank"]}
        for pc in meta["pieces"]:
            params[pc["param"]]["pieces"].append({"file": meta["file"], "lo": pc["lo"], "hi": pc["hi"], "keys": pc["keys"],
                                                  "crc32": pc["crc32"]})
    for name, p in params.items():
        p["pieces"].sort(key=lambda pc: pc["lo"])
        problem = coverage_problem(math.prod(p["shape"]), [(pc["lo"], pc["hi"]) for pc in p["pieces"]])
        if problem:  # pragma: no cover - would be a layout bug
            raise CheckpointError(f"internal error: the saved pieces of {name} do not tile it: {problem}")
    optimizer = None
    if opt_meta is not None:
        optimizer = {k: opt_meta[k] for k in ("class", "module", "param_groups")}
        optimizer["state"] = opt_meta["state"]  # (every rank's was checked equal before the save began)
    hf = rt.model
    described = describe_params(params)
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "yashard_version": __version__,
        "torch_version": torch.__version__,
        "world": comm.world, "shard_world": comm.shard_world, "replica_world": comm.replica_world,
        "model": {"class": type(hf).__name__,
                  "config_class": type(getattr(hf, "config", None)).__name__,
                  "fingerprint": fingerprint(described),
                  "config": _config_dict(hf)},
        "files": files, "params": params, "optimizer": optimizer, "extra": extra,
        "buffers": next(m["buffers"] for m in metas if m["buffers"] is not None),
        "comm_hook_state": rt.hook_state_dict(),
    }


def _commit(root: Path, save_dir: Path, index: dict) -> None:
    write_text_atomic(save_dir / INDEX, json.dumps(index, indent=1))
    fsync_dir(save_dir)
    write_text_atomic(root / POINTER, save_dir.name + "\n")  # the commit point


def _cleanup(root: Path, keep: str) -> None:
    """Remove every save directory but ``keep`` and stale pointer temp files (after the commit)."""
    for name in os.listdir(root):
        try:
            if name != keep and SAVE_DIR_RE.match(name) and (root / name).is_dir():
                shutil.rmtree(root / name)
            elif name.startswith(f".{POINTER}.tmp-"):
                (root / name).unlink()
        except OSError as e:  # the save itself is committed; leftovers are only disk space
            logger.warning("yashard: could not remove %s after the save: %s", root / name, e)


def _check_same_extra(got: list) -> None:
    """``extra`` is stored once: refuse a save whose ranks passed different values."""
    texts = [json.dumps(x, sort_keys=True) for _, x, _ in got]
    r = next((i for i, t in enumerate(texts) if t != texts[0]), None)
    if r is None:
        return
    a, b = got[0][1], got[r][1]
    keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k)) if isinstance(a, dict) and isinstance(b, dict) else None
    raise CheckpointError(
        f"save_checkpoint: extra differs between rank 0 and rank {r}"
        + (f" (keys {keys})" if keys else "") + ", and the checkpoint keeps one copy of it. Pass the same extra on "
        "every rank; per-rank state (RNG states, data-loader positions) can go in as a list of every rank's value "
        "(torch.distributed.all_gather_object), indexed by rank after load_checkpoint"
    )


def _check_same_optimizer_state(got: list) -> None:
    """Every rank must hold state for the same units, with the same tensor keys and dtypes, and the
    same scalar values (one copy of them is stored): refuse, before anything is written, naming the
    first unit that differs."""
    first = got[0][2] or {}
    for r, (_, _, state) in enumerate(got[1:], 1):
        state = state or {}
        for unit in sorted(set(first) | set(state), key=str):
            a, b = first.get(unit), state.get(unit)
            if a == b:
                continue
            if a is None or b is None or a["sharded"] != b["sharded"]:
                raise CheckpointError(
                    f"optimizer state of unit {unit} differs between ranks: rank 0 has "
                    f"{a and a['sharded']}, rank {r} has {b and b['sharded']}; every rank must have stepped the "
                    "same parameters"
                )
            raise CheckpointError(
                f"optimizer scalar state of unit {unit} differs between ranks: rank 0 has {a['scalars']}, rank {r} "
                f"has {b['scalars']}; the checkpoint stores one value for every rank, so a per-rank scalar (an "
                "optimizer that keeps one) cannot be saved"
            )


_VISIBLE_TIMEOUT = 10.0  # seconds a writer waits to see the save directory rank 0 created


def _wait_visible(save_dir: Path, rank: int) -> None:
    """Rank 0 created ``save_dir``; every writer must see it (a file system all ranks share). Waits a
    little for a network file system's directory cache, then refuses."""
    import time

    timeout = _VISIBLE_TIMEOUT
    deadline = time.monotonic() + timeout
    while not save_dir.is_dir():
        if time.monotonic() > deadline:
            raise CheckpointError(
                f"rank {rank} cannot see {save_dir}, which rank 0 created {timeout:g} s ago: the checkpoint path must "
                "be on a file system every rank shares (each rank writes its shard file into that one directory)"
            )
        time.sleep(0.05)


def save_checkpoint(path: str | os.PathLike, model, optimizer: torch.optim.Optimizer | None = None, *,
                    extra: Any = None) -> Path:
    """Save ``model``'s fp32 master shards, ``optimizer``'s state and ``extra`` to the directory ``path``.

    Collective: every rank calls it with the same ``path`` (on a file system all writing ranks
    share). Ranks with ``comm.replica_rank == 0`` each write one safetensors file with their flat
    pieces; rank 0 writes the JSON index and commits by atomically replacing ``path/LATEST``
    (protocol in the module docstring), so a crash at any moment leaves the previous checkpoint at
    ``path`` loadable. ``extra`` is any JSON-serialisable value (step number, scheduler state) and
    comes back from :func:`load_checkpoint`. Optimizer state tensors must have their master's shape;
    0-d tensors and Python scalars (AdamW's ``step``) are stored in the index from rank 0.
    Returns the committed save directory. Errors on any rank are raised on every rank.
    """
    rt = _runtime(model, "save_checkpoint")
    comm = rt.comm
    root = Path(path)
    err, name, opt_meta = None, None, None
    try:
        extra = check_extra(extra)
        opt_meta = _optimizer_meta(optimizer, rt)
        if comm.rank == 0:
            name = _prepare_root(root)
    except Exception as e:  # noqa: BLE001 - shared with every rank by _agree
        err = e
    got = _agree(comm, "save_checkpoint", err, (name, extra, opt_meta and opt_meta["state"]))
    name = got[0][0]
    save_dir = root / name
    try:
        _check_same_extra(got)
        _check_same_optimizer_state(got)
    except CheckpointError:
        if comm.rank == 0:  # nothing was written into it yet
            with contextlib.suppress(OSError):
                save_dir.rmdir()
        raise

    err, meta = None, None
    try:
        if comm.replica_rank == 0:
            _wait_visible(save_dir, comm.rank)
            meta = _write_rank_file(save_dir, rt, optimizer, opt_meta)
    except Exception as e:  # noqa: BLE001
        err = e
    metas = [m for m in _agree(comm, "save_checkpoint", err, meta) if m is not None]

    err = None
    try:
        if comm.rank == 0:
            index = {"save": name, **_build_index(rt, metas, opt_meta, extra)}
            _commit(root, save_dir, index)
            _cleanup(root, keep=name)
    except Exception as e:  # noqa: BLE001
        err = e
    _agree(comm, "save_checkpoint", err)
    return save_dir


# ------------------------------------------------------------------------------------------------
# Load


def _pointer_now(root: Path) -> str | None:
    """The save directory ``root/LATEST`` names right now, or None (no readable pointer)."""
    try:
        name = (root / POINTER).read_text(encoding="utf-8").strip()
    except OSError:
        return None
    return name if SAVE_DIR_RE.match(name) else None


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


def _describe_buffers(described: dict[str, dict]) -> dict[str, str]:
    return {name: f"buffer of shape {tuple(b['shape'])}" for name, b in described.items()}


def _check_model(index: dict, rt: "Runtime", save_dir: Path) -> None:
    ck = describe_params(index["params"])
    mine = describe_params(model_params(rt))
    if index.get("buffers") is not None:  # (version 1 saves stored none: the model keeps its own)
        ck.update(_describe_buffers(index["buffers"]))
        mine.update(_describe_buffers({n: {"shape": list(b.shape)} for n, b in persistent_buffers(rt.model)}))
    diff = params_diff(ck, mine)
    if diff:
        m = index["model"]
        raise CheckpointError(
            f"checkpoint {save_dir} does not match the model: the checkpoint holds {len(index['params'])} parameters "
            f"of a {m['class']} ({m['config_class']}), the model has {len(model_params(rt))} ({type(rt.model).__name__}). "
            "First differences:\n  " + "\n  ".join(diff) +
            "\nBuild the model from the config the checkpoint was saved with (index.json 'model.config')"
        )
    cfg_class = type(getattr(rt.model, "config", None)).__name__
    if index["model"]["config_class"] != cfg_class:
        if rt.comm.rank == 0:  # (one copy, as the config difference below)
            logger.warning("yashard: checkpoint %s was saved from a %s model, loading into a %s one (same parameters)",
                           save_dir, index["model"]["config_class"], cfg_class)
        return
    changed = config_diff(index["model"].get("config"), _config_dict(rt.model))
    if changed and rt.comm.rank == 0:
        logger.warning("yashard: checkpoint %s was saved from a model configured otherwise (same parameters): %s. "
                       "The weights load, but the model computes something else than the one that was trained",
                       save_dir, "; ".join(changed))


# config fields that do not change what a model computes from its weights, nor how it trains
# (pad_token_id does: it is the embedding's padding_idx, whose row gets no gradient)
_CONFIG_NOISE = {"_name_or_path", "architectures", "transformers_version", "torch_dtype", "dtype", "use_cache",
                 "_attn_implementation", "_attn_implementation_autoset", "attn_implementation", "output_attentions",
                 "output_hidden_states", "return_dict", "bos_token_id", "eos_token_id",
                 "max_position_embeddings", "_commit_hash", "id2label", "label2id", "problem_type", "tokenizer_class"}


def _rope_reads_length(cfg: dict) -> bool:
    """Whether the config's RoPE frequencies depend on max_position_embeddings: dynamic NTK, YaRN
    and LongRoPE scaling read it, Llama 3's when its own original_max_position_embeddings is unset;
    plain and linear RoPE do not."""
    for key in ("rope_parameters", "rope_scaling"):
        rope = cfg.get(key)
        if not isinstance(rope, dict):
            continue
        # (per attention type in some models: {"full_attention": {...}, "sliding_attention": {...}})
        for params in [rope, *(v for v in rope.values() if isinstance(v, dict))]:
            kind = params.get("rope_type", params.get("type"))
            if kind in ("dynamic", "yarn", "longrope") or (
                    kind == "llama3" and not params.get("original_max_position_embeddings")):
                return True
    return False


def config_diff(saved: dict | None, now: dict | None, limit: int = 5) -> list[str]:
    """``field: saved -> now`` for the config fields that differ (those that change what the model
    computes or how it trains; the noise fields above are left out, and max_position_embeddings
    unless the RoPE reads it), at most ``limit``."""
    if not saved or not now:
        return []
    reads_length = _rope_reads_length(saved) or _rope_reads_length(now)
    noise = _CONFIG_NOISE - {"max_position_embeddings"} if reads_length else _CONFIG_NOISE
    keys = sorted(k for k in set(saved) | set(now) if k not in noise and saved.get(k) != now.get(k))
    return [f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in keys[:limit]]


def _check_optimizer(index: dict, optimizer, rt: "Runtime", save_dir: Path) -> None:
    if optimizer is None:
        return
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
    ck = index["optimizer"]
    if ck is None:
        raise CheckpointError(
            f"checkpoint {save_dir} holds no optimizer state (it was saved without an optimizer); "
            "call load_checkpoint(path, model) without one, and the optimizer starts fresh"
        )
    mine = type(optimizer).__qualname__
    if ck["class"] != mine:
        raise CheckpointError(
            f"checkpoint {save_dir} holds {ck['class']} state ({ck['module']}), but the optimizer passed is {mine} "
            f"({type(optimizer).__module__}); build a {ck['class']} to resume, or pass optimizer=None to load the weights only"
        )
    unit_of = {id(u.master): u.name for u in rt.units}
    groups = []
    for gi, g in enumerate(optimizer.param_groups):
        names = []
        for p in g["params"]:
            if id(p) not in unit_of:
                raise ValueError(
                    f"optimizer param group {gi} holds a tensor of shape {tuple(p.shape)} that is not a master "
                    "shard of this model; build the optimizer from model.parameters() or model.param_groups(...)"
                )
            names.append(unit_of[id(p)])
        groups.append(names)
    saved = [g["units"] for g in ck["param_groups"]]
    if [sorted(g) for g in groups] != [sorted(g) for g in saved]:
        raise CheckpointError(
            f"the optimizer's param groups differ from the checkpoint's: checkpoint {saved}, optimizer {groups}; "
            "build the optimizer with the same groups (e.g. model.param_groups(weight_decay))"
        )


@dataclass(frozen=True)
class _Read:
    """Copy elements ``[a, b)`` of stored piece ``keys`` (of ``piece_numel`` elements) to ``dst`` of a unit's shard."""

    unit: str
    dst: int
    file: str
    keys: dict
    piece_numel: int
    a: int
    b: int
    crc32: dict | None = None  # per kind, of the whole stored piece (checkpoints written before it: None)


def _plan_reads(index: dict, rt: "Runtime", shard_rank: int) -> dict[str, list[_Read]]:
    """Per unit: the stored ranges that overlap what this rank owns under the current layout."""
    plan: dict[str, list[_Read]] = {}
    for u in rt.units:
        s0, s1 = u.layout.shard_range(shard_rank)
        reads = plan.setdefault(u.name, [])
        for e, fqns in zip(u.layout.entries, u.fqns):
            lo, hi = max(e.offset, s0), min(e.end, s1)
            if lo >= hi:
                continue
            plo, phi = lo - e.offset, hi - e.offset
            pieces = index["params"][fqns[0]]["pieces"]
            for i, a, b in overlaps([(pc["lo"], pc["hi"]) for pc in pieces], plo, phi):
                pc = pieces[i]
                reads.append(_Read(u.name, lo - s0 + (a - plo), pc["file"], pc["keys"], pc["hi"] - pc["lo"],
                                   a - pc["lo"], b - pc["lo"], pc.get("crc32")))
    return plan


class _Files:
    """Opens shard files lazily, each checked once (present, size, not a pickle, valid safetensors)."""

    def __init__(self, save_dir: Path, index: dict, stack: contextlib.ExitStack, via_pointer: bool = False):
        self.dir, self.index, self.stack = save_dir, index, stack
        self.via_pointer = via_pointer  # the save was found through its root's LATEST
        self.handles: dict[str, Any] = {}
        self.verified: set[tuple[str, int]] = set()  # pieces whose checksum was read and matched

    def get(self, fname: str):
        if fname in self.handles:
            return self.handles[fname]
        from safetensors import safe_open

        f = self.dir / fname
        rec = self.index["files"][fname]
        if not f.is_file():
            replaced = _replaced_message(self.dir, self.via_pointer, f"lost {fname}")
            if replaced:
                raise CheckpointError(replaced)
            raise CheckpointError(
                f"checkpoint {self.dir} is missing {fname} (written by shard rank {rec['shard_rank']} of "
                f"{self.index['shard_world']}); restore that file or load an earlier checkpoint"
            )
        foreign = sniff_foreign_format(f)
        if foreign:
            raise CheckpointError(
                f"{f} is {foreign}, not a safetensors shard; yashard never unpickles checkpoint files. "
                "Restore the shard written by save_checkpoint"
            )
        size = f.stat().st_size
        if size != rec["bytes"]:
            raise CheckpointError(
                f"{f} is {size} bytes but the index records {rec['bytes']}: it was truncated or replaced after the "
                "save; restore it or load an earlier checkpoint"
            )
        try:
            h = self.stack.enter_context(safe_open(str(f), framework="pt"))
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error type
            raise CheckpointError(
                f"{f} is not a readable safetensors file ({type(e).__name__}: {e}); it is corrupt: restore it or "
                "load an earlier checkpoint"
            ) from e
        saved_by, own = (h.metadata() or {}).get("save"), _save_identity(self.dir, self.index)
        if saved_by is not None and saved_by != own:
            raise CheckpointError(
                f"{f} was written by the save {saved_by}, not by {own} whose index lists it: a shard file "
                "was copied in from another checkpoint; restore this save's own file or load an earlier checkpoint"
            )
        self.handles[fname] = (h, set(h.keys()))
        return self.handles[fname]

    def read_buffer(self, name: str, rec: dict) -> torch.Tensor:
        """Persistent buffer ``name`` as the index describes it (``rec``), checked against its CRC-32."""
        h, keys = self.get(rec["file"])
        f = self.dir / rec["file"]
        if rec["key"] not in keys:
            raise CheckpointError(f"{f} lacks the tensor {rec['key']!r} its index lists; it is damaged")
        value = h.get_tensor(rec["key"])
        if list(value.shape) != rec["shape"] or value.dtype != _dtype_from_name(rec["dtype"]):
            raise CheckpointError(
                f"{f}: tensor {rec['key']!r} is {value.dtype} {list(value.shape)}, the index expects "
                f"{rec['dtype']} {rec['shape']}; the file is damaged"
            )
        if tensor_crc32(value) != rec["crc32"]:
            raise CheckpointError(
                f"{f}: the bytes of tensor {rec['key']!r} do not match the checksum the save recorded (CRC-32): the "
                "file was damaged after the save; restore it or load an earlier checkpoint"
            )
        return value

    def check(self, read: _Read, kind: str, dtype: str) -> None:
        h, keys = self.get(read.file)
        key = read.keys.get(kind)
        if key is None or key not in keys:
            raise CheckpointError(f"{self.dir / read.file} lacks the tensor {key or kind!r} its index lists; it is damaged")
        sl = h.get_slice(key)
        shape, st = list(sl.get_shape()), sl.get_dtype()
        if shape != [read.piece_numel] or st != ST_DTYPES[_dtype_from_name(dtype)]:
            raise CheckpointError(
                f"{self.dir / read.file}: tensor {key!r} is {st} {shape}, the index expects "
                f"{ST_DTYPES[_dtype_from_name(dtype)]} [{read.piece_numel}]; the file is damaged"
            )
        want = (read.crc32 or {}).get(kind)
        if want is not None and (key, want) not in self.verified:
            crc, step = 0, _CRC_CHUNK
            for lo in range(0, read.piece_numel, step):  # the whole piece, a bounded slice at a time
                crc = tensor_crc32(read_flat_range(h, key, (read.piece_numel,), lo, min(lo + step, read.piece_numel)), crc)
            if crc != want:
                raise CheckpointError(
                    f"{self.dir / read.file}: the bytes of tensor {key!r} do not match the checksum the save recorded "
                    "(CRC-32): the file was damaged after the save; restore it or load an earlier checkpoint"
                )
            self.verified.add((key, want))


def load_checkpoint(path: str | os.PathLike, model, optimizer: torch.optim.Optimizer | None = None) -> Any:
    """Load a :func:`save_checkpoint` checkpoint into ``model`` (and ``optimizer``) at any world size.

    Collective. ``path`` is the directory given to ``save_checkpoint`` (its ``LATEST`` is followed)
    or one committed save directory inside it. Each rank reads only the stored pieces that overlap
    the flat ranges it owns under the current layout, fills every unit's ``master`` in place (the
    same ``nn.Parameter`` objects), and, with ``optimizer``, restores its state (created if the
    optimizer has none yet) and its param groups' hyperparameters via ``optimizer.load_state_dict``.
    Masters are matched by unit name, so the optimizer must have the checkpoint's param groups.
    Gradients are not touched. Every file is checked before anything is modified; an error on
    any rank is raised on every rank. Every rank loads the same save: ranks that follow ``LATEST``
    while a ``save_checkpoint`` into ``path`` commits agree on the newest (with a warning); ranks
    given different checkpoints are refused. A save is known by the name its index records, so a
    renamed or linked save directory loads. Returns the ``extra`` given to ``save_checkpoint``.
    """
    rt = _runtime(model, "load_checkpoint")
    comm = rt.comm
    save_dir, index, via_pointer = _agreed_save(comm, path)
    with contextlib.ExitStack() as stack:
        err = None
        try:
            _check_model(index, rt, save_dir)
            _check_optimizer(index, optimizer, rt, save_dir)
            files = _Files(save_dir, index, stack, via_pointer)
            plan = _plan_reads(index, rt, comm.shard_rank)
            opt_state = (index["optimizer"] or {}).get("state", {}) if optimizer is not None else {}
            for unit, reads in plan.items():
                sharded = opt_state.get(unit, {}).get("sharded", {})
                for r in reads:
                    files.check(r, "master", "float32")
                    for k, dt in sharded.items():
                        files.check(r, f"optim.{k}", dt)
            buffers = {n: files.read_buffer(n, b) for n, b in (index.get("buffers") or {}).items()}
        except Exception as e:  # noqa: BLE001 - shared with every rank by _agree
            err = e
        _agree(comm, "load_checkpoint", err)

        err = None
        try:
            _fill(rt, plan, files, optimizer, index)
            with torch.no_grad():
                for name, b in persistent_buffers(rt.model):
                    if name in buffers:
                        b.copy_(buffers[name])
            rt.restore_hook_state(index.get("comm_hook_state"))  # (or keeps it for a hook registered next)
        except Exception as e:  # noqa: BLE001
            err = e
        _agree(comm, "load_checkpoint", err)
        rt.masters_changed()  # (every rank: it gathers; the norm weights read now are the loaded ones)
    return index["extra"]


def _save_identity(save_dir: Path, index: dict) -> str:
    """The name a save was written under (its index records it; older saves: their directory's)."""
    return index.get("save") or save_dir.name


def _replaced_message(save_dir: Path, via_pointer: bool, what: str) -> str | None:
    """Why ``save_dir`` fails mid-load when a newer save into its root removed it, or None."""
    now = _pointer_now(save_dir.parent)
    if now is None or now == save_dir.name:
        return None
    if not via_pointer and save_dir.is_dir():  # (named by the caller and still there: plain damage)
        return None
    return (f"checkpoint {save_dir} {what} while it was being loaded: a save_checkpoint into {save_dir.parent} "
            f"committed {now} meanwhile and removed this save; load {save_dir.parent} again (its LATEST names {now}), "
            "and do not save into a directory another job is loading from")


def _read_save(path) -> tuple[Path, dict, bool]:
    """This rank's committed save under ``path``, its index, and whether ``LATEST`` led to it."""
    save_dir = resolve_checkpoint(path)
    via_pointer = save_dir != Path(path)
    try:
        return save_dir, read_index(save_dir), via_pointer
    except CheckpointError as e:
        replaced = _replaced_message(save_dir, via_pointer, "was removed")
        raise CheckpointError(replaced) if replaced else e


def _agreed_save(comm: "Comm", path) -> tuple[Path, dict, bool]:
    """The committed save every rank loads (collective), with its index and whether ``LATEST`` led to it.

    Every rank resolves ``path`` on its own; they compare the saves they found by the name each
    was written under (so one save reached through different paths, or renamed, agrees). Found
    through ``LATEST`` on every rank, different saves mean a ``save_checkpoint`` into ``path``
    committed while the ranks read it: all take the newest, which its cleanup keeps, with a
    warning (each would otherwise load another complete save, silently). Anything else (ranks
    given different checkpoints) is refused, naming each rank's."""
    err, found = None, None
    try:
        save_dir, index, via_pointer = _read_save(path)
        found = (_save_identity(save_dir, index), via_pointer)
    except Exception as e:  # noqa: BLE001 - shared with every rank by _agree
        err = e
    found = _agree(comm, "load_checkpoint", err, found)
    names = [name for name, _ in found]
    if len(set(names)) == 1:
        return save_dir, index, via_pointer
    newest = max(names, key=lambda n: int(m.group(1)) if (m := SAVE_DIR_RE.match(n)) else -1)
    different = CheckpointError(
        "load_checkpoint: the ranks were given different checkpoints ("
        + ", ".join(f"{n} on rank {names.index(n)}" for n in dict.fromkeys(names))
        + "); pass the same checkpoint to every rank")
    if not all(via for _, via in found):  # (a rank named a save directory)
        raise different
    err, here = None, True  # here: the newest is in this rank's root too (not only in another root)
    try:
        if newest != save_dir.name:
            here = (save_dir.parent / newest / INDEX).is_file()
            if here:
                save_dir = save_dir.parent / newest
                index = read_index(save_dir)
                here = _save_identity(save_dir, index) == newest
    except Exception as e:  # noqa: BLE001
        err = e
    if not all(_agree(comm, "load_checkpoint", err, here)):
        raise different
    if comm.rank == 0:
        logger.warning("yashard: load_checkpoint: the ranks found different committed saves under %s (%s): a "
                       "save_checkpoint into it committed while they read LATEST; every rank loads the newest, %s",
                       path, ", ".join(sorted(set(names))), newest)
    return save_dir, index, True


def _read_into(buf: torch.Tensor, reads: list[_Read], files: _Files, kind: str) -> torch.Tensor:
    for r in reads:
        h, _ = files.get(r.file)
        part = read_flat_range(h, r.keys[kind], (r.piece_numel,), r.a, r.b)
        buf[r.dst:r.dst + (r.b - r.a)].copy_(part)
    return buf


@torch.no_grad()
def _fill(rt: "Runtime", plan: dict[str, list[_Read]], files: _Files, optimizer, index: dict) -> None:
    """Phase two of a load: copy the planned ranges into the masters and build the optimizer state."""
    for u in rt.units:
        buf = torch.zeros(u.layout.shard_numel, dtype=torch.float32)  # padding stays zero
        u.master.copy_(_read_into(buf, plan[u.name], files, "master"))
    if optimizer is None:
        return
    ck = index["optimizer"]
    unit_of = {id(u.master): u for u in rt.units}
    state, groups, idx = {}, [], 0
    for g in optimizer.param_groups:
        ids = []
        for p in g["params"]:
            u = unit_of[id(p)]
            saved = ck["state"].get(u.name)
            if saved:
                st = {k: decode_value(v) for k, v in saved["scalars"].items()}
                for k, dt in saved["sharded"].items():
                    buf = torch.zeros(u.layout.shard_numel, dtype=_dtype_from_name(dt))
                    st[k] = _read_into(buf, plan[u.name], files, f"optim.{k}").to(p.device)
                state[idx] = st
            ids.append(idx)
            idx += 1
        groups.append(ids)
    # _check_optimizer made sure group i holds the units of the checkpoint's group i.
    new_groups = []
    for g, ids, saved_group in zip(optimizer.param_groups, groups, ck["param_groups"]):
        hp = {k: decode_value(v) for k, v in saved_group["hparams"].items()}
        new_groups.append({**{k: v for k, v in g.items() if k != "params"}, **hp, "params": ids})
    optimizer.load_state_dict({"state": state, "param_groups": new_groups})
