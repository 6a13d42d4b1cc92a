"""save_checkpoint: every rank writes its own flat pieces, rank 0 writes the index and commits.

The files and keys are :mod:`yashard.checkpoint.format`'s.

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
import json
import logging
import math
import os
import secrets
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .._io import ST_DTYPES, StreamedSafetensors, fsync_dir, write_text_atomic
from ..config import dtype_name
from ..config_compare import config_dict
from ..layout import shard_pieces
from ..saved_state import optimizer_units, persistent_buffers
from ..call_gate import enter
from ..sharded_model import runtime_of
from ..step_in_backward import inner_optimizer
from ..version import __version__
from .format import (FORMAT, INDEX, POINTER, SAVE_DIR_RE, CheckpointError, agree, buffer_key, check_extra,
                     coverage_problem, describe_params, encode_value, fingerprint, model_params, piece_key,
                     save_version, shard_file_name, tensor_crc32)

if TYPE_CHECKING:  # pragma: no cover
    from ..runtime import Runtime

logger = logging.getLogger("yashard")


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
                sharded[k] = dtype_name(v.dtype)
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
        "format": "pt", "yashard_checkpoint": str(save_version(rt)),
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
                stored[name] = {"file": fname, "key": buffer_key(name), "dtype": dtype_name(b.dtype),
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
    comm = rt.comm
    params = model_params(rt)
    for p in params.values():
        p["pieces"] = []
    for u in rt.units:  # (the dtype the master pieces are written in: _write_rank_file)
        for fqns in u.fqns:
            params[fqns[0]]["dtype"] = dtype_name(u.master.dtype)
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
        "format": FORMAT, "format_version": save_version(rt), "yashard_version": __version__,
        "torch_version": torch.__version__,
        "world": comm.world, "shard_world": comm.shard_world, "replica_world": comm.replica_world,
        "model": {"class": type(hf).__name__,
                  "config_class": type(getattr(hf, "config", None)).__name__,
                  "fingerprint": fingerprint(described),
                  "config": config_dict(hf)},
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
    """Save ``model``'s master shards, ``optimizer``'s state and ``extra`` to the directory ``path``.

    Collective: every rank calls it with the same ``path`` (on a file system all writing ranks
    share). Ranks with ``comm.replica_rank == 0`` each write one safetensors file with their flat
    pieces; rank 0 writes the JSON index and commits by atomically replacing ``path/LATEST``
    (protocol in the module docstring), so a crash at any moment leaves the previous checkpoint at
    ``path`` loadable. ``extra`` is any JSON-serialisable value (step number, scheduler state) and
    comes back from :func:`load_checkpoint`. Masters are stored in the dtype they are kept in (fp32;
    a frozen unit's 16-bit ``param_dtype``), recorded in the index. Optimizer state tensors must
    have their master's shape; 0-d tensors and Python scalars (AdamW's ``step``) are stored in the
    index from rank 0.
    Returns the committed save directory. Errors on any rank are raised on every rank.
    """
    rt = runtime_of(model, "save_checkpoint")
    optimizer = inner_optimizer(optimizer)  # (step_in_backward: the plain optimizer inside, its state)
    comm = rt.comm
    enter(comm, "save_checkpoint")
    root = Path(path)
    err, name, opt_meta = None, None, None
    try:
        extra = check_extra(extra)
        opt_meta = _optimizer_meta(optimizer, rt)
        if comm.rank == 0:
            name = _prepare_root(root)
    except Exception as e:  # noqa: BLE001 - shared with every rank by agree
        err = e
    got = agree(comm, "save_checkpoint", err, (name, extra, opt_meta and opt_meta["state"]))
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
    metas = [m for m in agree(comm, "save_checkpoint", err, meta) if m is not None]

    err = None
    try:
        if comm.rank == 0:
            index = {"save": name, **_build_index(rt, metas, opt_meta, extra)}
            _commit(root, save_dir, index)
            _cleanup(root, keep=name)
    except Exception as e:  # noqa: BLE001
        err = e
    agree(comm, "save_checkpoint", err)
    return save_dir
