"""load_checkpoint: every rank finds the same committed save, checks it against the model (and the
optimizer) and every file it will read, then reads just the stored ranges that overlap the flat
ranges it owns under the current layout. The files and keys are :mod:`yashard.checkpoint.format`'s."""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .._io import ST_DTYPES, sniff_foreign_format
from ..config_compare import config_diff, config_dict
from ..safetensors_io import read_flat_range
from ..saved_state import persistent_buffers
from ..call_gate import enter
from ..sharded_model import runtime_of
from ..step_in_backward import inner_optimizer
from .format import (INDEX, POINTER, SAVE_DIR_RE, CheckpointError, agree, decode_value, describe_params,
                     dtype_from_name, model_params, overlaps, params_diff, read_index, resolve_checkpoint,
                     tensor_crc32)

if TYPE_CHECKING:  # pragma: no cover
    from ..collectives import Comm
    from ..runtime import Runtime

logger = logging.getLogger("yashard")

_CRC_CHUNK = 1 << 22  # elements per read while checking a piece's checksum


def _pointer_now(root: Path) -> str | None:
    """The save directory ``root/LATEST`` names right now, or None (no readable pointer)."""
    try:
        name = (root / POINTER).read_text(encoding="utf-8").strip()
    except OSError:
        return None
    return name if SAVE_DIR_RE.match(name) else None


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
    changed = config_diff(index["model"].get("config"), config_dict(rt.model))
    if changed and rt.comm.rank == 0:
        logger.warning("yashard: checkpoint %s was saved from a model configured otherwise (same parameters): %s. "
                       "The weights load, but the model computes something else than the one that was trained",
                       save_dir, "; ".join(changed))


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
    dtype: str = "float32"  # the dtype its master piece is stored in (format version 3 on: the parameter's)


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
            param = index["params"][fqns[0]]
            pieces = param["pieces"]
            for i, a, b in overlaps([(pc["lo"], pc["hi"]) for pc in pieces], plo, phi):
                pc = pieces[i]
                reads.append(_Read(u.name, lo - s0 + (a - plo), pc["file"], pc["keys"], pc["hi"] - pc["lo"],
                                   a - pc["lo"], b - pc["lo"], pc.get("crc32"), param.get("dtype", "float32")))
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
        if list(value.shape) != rec["shape"] or value.dtype != dtype_from_name(rec["dtype"]):
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
        if shape != [read.piece_numel] or st != ST_DTYPES[dtype_from_name(dtype)]:
            raise CheckpointError(
                f"{self.dir / read.file}: tensor {key!r} is {st} {shape}, the index expects "
                f"{ST_DTYPES[dtype_from_name(dtype)]} [{read.piece_numel}]; the file is damaged"
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
    The stored and the held master dtypes may differ (a save of another ``param_dtype``): a frozen
    unit's 16-bit master rounds the stored value once, an fp32 master widens a 16-bit piece exactly.
    Masters are matched by unit name, so the optimizer must have the checkpoint's param groups.
    Gradients are not touched. Every file is checked before anything is modified; an error on
    any rank is raised on every rank. Every rank loads the same save: ranks that follow ``LATEST``
    while a ``save_checkpoint`` into ``path`` commits agree on the newest (with a warning); ranks
    given different checkpoints are refused. A save is known by the name its index records, so a
    renamed or linked save directory loads. Returns the ``extra`` given to ``save_checkpoint``.
    """
    rt = runtime_of(model, "load_checkpoint")
    optimizer = inner_optimizer(optimizer)  # (step_in_backward: the plain optimizer inside, its state)
    comm = rt.comm
    enter(comm, "load_checkpoint")
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
                    files.check(r, "master", r.dtype)
                    for k, dt in sharded.items():
                        files.check(r, f"optim.{k}", dt)
            buffers = {n: files.read_buffer(n, b) for n, b in (index.get("buffers") or {}).items()}
        except Exception as e:  # noqa: BLE001 - shared with every rank by agree
            err = e
        agree(comm, "load_checkpoint", err)

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
        agree(comm, "load_checkpoint", err)
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
    except Exception as e:  # noqa: BLE001 - shared with every rank by agree
        err = e
    found = agree(comm, "load_checkpoint", err, found)
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
    if not all(agree(comm, "load_checkpoint", err, here)):
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
        # read in fp32 (a 16-bit stored piece widens exactly), then into the master: a 16-bit frozen
        # one rounds the fp32 value once, as at shard(); a checkpoint of either param_dtype loads
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
                    buf = torch.zeros(u.layout.shard_numel, dtype=dtype_from_name(dt))
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
