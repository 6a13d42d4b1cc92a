"""``torch.distributed.checkpoint`` (DCP) views of the sharded model.

:meth:`ShardedModel.sharded_state_dict` maps every HF parameter name to a :class:`ShardedParameter`:
a tensor of the parameter's full shape whose data lives in the rank's master shards, in their dtype
(fp32; a frozen unit's 16-bit ``param_dtype``: DCP stores that dtype, and its load casts what it
reads into the master's, so a checkpoint of either ``param_dtype`` loads into the other). A rank's
shard of a unit is one flat range, so its part of a parameter is a flat range of that parameter,
which :func:`yashard.layout.flat_range_boxes` cuts into at most ``2 * ndim - 1`` rectangular
boxes; DCP sees them as the chunks this rank holds (the protocol DTensor implements:
``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``). So::

    dcp.save(model.sharded_state_dict(), checkpoint_id=path)   # every rank writes its own boxes
    dcp.load(model.sharded_state_dict(), checkpoint_id=path)   # in place into the masters

store full-shape tensors under HF names, as FSDP2 and a plain model's ``state_dict()`` do: a
checkpoint saved by yashard at one world size loads at any other, into FSDP2, or into an unsharded
model (``dcp.load(hf_model.state_dict(), ..., no_dist=True)``), and theirs load into yashard. Loads
write the masters through views that share their version counter, so the runtime sees them change
(gathered weights and ``param_dtype`` copies are refreshed).

:meth:`ShardedModel.sharded_optim_state_dict` does the same for an optimizer's state, in the layout
``torch.distributed.checkpoint.state_dict`` gives FSDP2's optimizers (``{"state": {name: {...}},
"param_groups": [...]}``): each state tensor shaped like a master shard becomes one
:class:`ShardedParameter` per parameter over it. ``opt.state_dict()`` itself must never go into
DCP: it holds this rank's flat shards under keys every rank shares, which DCP takes for replicated
state and keeps once.

``dcp.async_save`` needs :class:`SnapshotStager` (``async_stager=yashard.dcp.SnapshotStager()``): it
copies each rank's boxes to CPU memory before training goes on (DCP's default stager would try to
allocate every parameter's full shape). Give it a process group of its own
(``process_group=dist.new_group(backend="gloo")``), as DCP advises: its collectives then never
interleave with training's. The process mode (``AsyncCheckpointerType.PROCESS``) works too: the
stager's copies pickle to DCP's background process.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from .layout import flat_range_boxes, shard_pieces
from .saved_state import optimizer_units, persistent_buffers
from .step_in_backward import inner_optimizer


class ShardedParameter(torch.Tensor):
    """One parameter's full shape, backed by the boxes of it this rank holds (views of its masters).

    Contract: it is a container for DCP, not a tensor to compute with (every operation on it raises);
    ``boxes`` lists ``(offsets, view)`` per box this rank holds, possibly none; the union over the
    ranks of a shard group is the whole parameter, each element exactly once. One over live views of
    the masters refuses pickling; a ``snapshot`` (:class:`SnapshotStager`'s CPU copies) pickles, so
    ``dcp.async_save``'s process mode can hand it to its background process.
    """

    @staticmethod
    def __new__(cls, shape: torch.Size, boxes: list[tuple[torch.Size, torch.Tensor]], dtype, device, name: str,
                snapshot: bool = False):
        r = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=False)
        r.boxes = boxes
        r.fqn = name
        r.snapshot = snapshot
        return r

    def __repr__(self) -> str:  # noqa: D105
        return (f"ShardedParameter({self.fqn}, shape={tuple(self.shape)}, "
                f"{sum(v.numel() for _, v in self.boxes)} elements on this rank in {len(self.boxes)} boxes)")

    def __reduce_ex__(self, protocol):
        if self.snapshot:
            return _rebuild_snapshot, (tuple(self.shape), [(tuple(o), v) for o, v in self.boxes], self.dtype, self.fqn)
        raise TypeError(
            f"pickling (torch.save) a yashard ShardedParameter ({self.fqn}) would keep only this rank's part; save "
            "with dcp.save(model.sharded_state_dict(), checkpoint_id=path) or yashard.save_checkpoint, or torch.save "
            "model.full_state_dict() (a collective) on one rank (dcp.async_save, thread or process mode, takes "
            "async_stager=yashard.dcp.SnapshotStager())"
        )

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise TypeError(
            f"{func} on a yashard ShardedParameter: sharded_state_dict() is for torch.distributed.checkpoint "
            "(dcp.save / dcp.load; dcp.async_save with async_stager=yashard.dcp.SnapshotStager()); read full "
            "tensors with model.full_state_dict()"
        )

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        return [
            WriteItem(index=MetadataIndex(fqn, offsets, i), type=WriteItemType.SHARD,
                      tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets, view.shape),
                                                  properties=TensorProperties.create_from_tensor(view),
                                                  size=self.shape))
            for i, (offsets, view) in enumerate(self.boxes)
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets, view.shape) for offsets, view in self.boxes]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        if index.index is not None and index.index < len(self.boxes) and self.boxes[index.index][0] == index.offset:
            return self.boxes[index.index][1]
        for offsets, view in self.boxes:
            if offsets == index.offset:
                return view
        raise ValueError(f"{self.fqn}: this rank holds no box at offset {tuple(index.offset or ())}")


def _rebuild_snapshot(shape: tuple, boxes: list, dtype: torch.dtype, fqn: str) -> ShardedParameter:
    """Unpickle a snapshot :class:`ShardedParameter` (in ``dcp.async_save``'s background process)."""
    return ShardedParameter(torch.Size(shape), [(torch.Size(o), v) for o, v in boxes], dtype, torch.device("cpu"),
                            fqn, snapshot=True)


class SnapshotStager(AsyncStager):
    """The stager for ``dcp.async_save(model.sharded_state_dict(), ..., async_stager=SnapshotStager())``.

    Contract: ``stage`` returns the state dict with every :class:`ShardedParameter` rebuilt over CPU
    copies of this rank's boxes (and every other tensor copied to CPU), taken when ``async_save`` is
    called; the masters may change as soon as it returns. The snapshots pickle, so the process mode
    (``async_checkpointer_type=AsyncCheckpointerType.PROCESS``) works as well as the default thread
    mode. Extra memory: this rank's shard of the weights, in CPU memory, until the save finishes.
    """

    _synchronize_after_execute = False

    def stage(self, state_dict):  # noqa: D102
        from torch.utils._pytree import tree_map_only

        def snap(t: torch.Tensor) -> torch.Tensor:
            if isinstance(t, ShardedParameter):
                return ShardedParameter(t.shape, [(o, v.to("cpu", copy=True)) for o, v in t.boxes], t.dtype,
                                        torch.device("cpu"), t.fqn, snapshot=True)
            return t.detach().to("cpu", copy=True)

        return tree_map_only(torch.Tensor, snap, state_dict)

    def synchronize_staging(self) -> None:  # noqa: D102 - stage() copies synchronously
        pass


def _entry_views(u, flat: torch.Tensor, rank: int) -> list[ShardedParameter]:
    """Per layout entry of unit ``u``: the :class:`ShardedParameter` over ``flat`` (a tensor shaped like
    the unit's shard: the master or an optimizer state of it), named by the entry's first HF name."""
    held = {p.entry: p for p in shard_pieces(u.layout, rank)}
    out = []
    for i, (entry, fqns) in enumerate(zip(u.layout.entries, u.fqns)):
        boxes = []
        piece = held.get(i)
        if entry.numel == 0 and rank == 0:  # no element to hold, but the name must reach the checkpoint
            boxes.append((torch.Size([0] * len(entry.shape)), flat.narrow(0, 0, 0).view(entry.shape)))
        elif piece is not None:
            base = piece.shard_start - piece.entry_start  # index in ``flat`` of the entry's element 0
            for offsets, sizes, start in flat_range_boxes(entry.shape, piece.entry_start, piece.entry_end):
                boxes.append((torch.Size(offsets), flat.narrow(0, base + start, math.prod(sizes)).view(sizes)))
        out.append(ShardedParameter(torch.Size(entry.shape), boxes, flat.dtype, flat.device, fqns[0]))
    return out


def sharded_state_dict(rt) -> dict[str, torch.Tensor]:
    """Every HF parameter name (tied names included) -> its :class:`ShardedParameter` on this rank,
    and every persistent buffer's name -> the buffer itself (replicated: DCP writes one copy and
    loads it in place on every rank), as the model's own ``state_dict()`` holds them."""
    out: dict[str, torch.Tensor] = {}
    for u in rt.units:
        # the master's detach() shares its version counter: a load is seen as a change
        for view, fqns in zip(_entry_views(u, u.master.detach(), rt.comm.shard_rank), u.fqns):
            for fqn in fqns:
                out[fqn] = view if fqn == fqns[0] else ShardedParameter(view.shape, view.boxes, view.dtype,
                                                                        view.device, fqn)
    for name, b in persistent_buffers(rt.model):
        out[name] = b
    return out


@torch.no_grad()
def _init_state(rt, optimizer, units: list) -> None:
    """Create the optimizer's state for the masters of ``units`` that have none, as FSDP does: one
    step with zero gradients at learning rate 0, taken by those masters only (the others have no
    gradient for it). Then the weights are put back as they were (an optimizer that ignores ``lr``
    may still have applied weight decay) and every new state tensor is zeroed, ``step`` included: the
    state a fresh optimizer's first step would start from (SGD with ``dampening`` aside). Masters of
    parameters all frozen at ``shard()`` get none, as with torch's own helpers."""
    fresh = [u for u in units if not optimizer.state.get(u.master) and u.trains]
    others = [u for u in units if u not in fresh]
    saved = [(u.master.grad, u.grad_unwritten) for u in units]
    weights = [u.master.detach().clone() for u in fresh]
    lrs = [g["lr"] for g in optimizer.param_groups]
    warned, stepped = rt.warned_fp16, rt.state.stepped_since_backward
    rt.creating_optimizer_state = True  # (the step's checks are for training steps: see guards._before_step)
    try:
        for u in fresh:
            u.master.grad = torch.zeros_like(u.master)
        for u in others:
            u.master.grad = None
        for g in optimizer.param_groups:
            g["lr"] = 0.0 if not torch.is_tensor(g["lr"]) else torch.zeros_like(g["lr"])
        optimizer.step()
    finally:
        rt.creating_optimizer_state = False
        rt.warned_fp16 = warned   # the fp16 warning belongs to the first real step
        rt.state.stepped_since_backward = stepped  # (the gradient flags still count toward the next real step)
        for g, lr in zip(optimizer.param_groups, lrs):
            g["lr"] = lr
        for u, (grad, unwritten) in zip(units, saved):
            u.master.grad, u.grad_unwritten = grad, unwritten
        for u, w in zip(fresh, weights):
            u.master.detach().copy_(w)
    for u in fresh:
        for value in optimizer.state.get(u.master, {}).values():
            if torch.is_tensor(value):
                value.zero_()


# torch optimizers whose state, created by _init_state (a zero-gradient step at lr 0, then zeroed),
# is not what their first real step starts from (Rprop's step sizes start at lr, NAdam's mu_product
# at 1, ASGD's averages, SGD's momentum with dampening): they need state from a real step first.
_FRESH_STATE_WRONG = {"Rprop", "NAdam", "ASGD", "LBFGS", "SparseAdam"}


def sharded_optim_state_dict(rt, optimizer) -> dict:
    """``{"state": {name: {key: value}}, "param_groups": [{..., "params": [names]}]}`` for DCP, in the
    layout torch.distributed.checkpoint.state_dict gives FSDP2's optimizers: per HF parameter (its
    first name), each state tensor shaped like the master shard as a :class:`ShardedParameter` over
    it, other state values as they are. Collective when the optimizer has no state yet (it is
    created first: :func:`_init_state`), so call it on every rank."""
    optimizer = inner_optimizer(optimizer)  # (step_in_backward: the plain optimizer inside, its state)
    groups = optimizer_units(rt, optimizer)
    units = [u for g in groups for u in g]
    # (a master of parameters all frozen at shard() gets no state, as with torch's own helpers; one
    # only turned off for now does, so that a load into it is not silently dropped)
    if any(not optimizer.state.get(u.master) for u in units if u.trains):
        name = type(optimizer).__name__
        if name in _FRESH_STATE_WRONG or (name == "SGD" and any(g.get("dampening") for g in optimizer.param_groups)):
            raise ValueError(
                f"{name} has no state yet, and creating it here (a zero-gradient step) would not give the state its "
                "first real step starts from. Take sharded_optim_state_dict after the first optimizer step (to load "
                "a checkpoint into a fresh optimizer, use yashard.load_checkpoint)"
            )
        pending = ("between a forward and its backward" if rt.state.backward_pending else
                   "while a model.no_sync() accumulation waits for its reducing backward"
                   if any(u.unreduced for u in units) else None)
        if pending:
            raise RuntimeError(
                f"{name} has no state yet, and creating it takes an optimizer step, which cannot run {pending}. "
                "Call sharded_optim_state_dict between steps (after backward and the optimizer step), or run the "
                "forward under torch.no_grad() if no backward follows it"
            )
        _init_state(rt, optimizer, units)
    rank = rt.comm.shard_rank
    state: dict[str, dict] = {}
    scalars = []  # 0-d state tensors other than 'step': stored once, so they must agree across ranks
    for u in units:
        per_key = {}
        for key, value in optimizer.state[u.master].items():
            if torch.is_tensor(value) and value.shape == u.master.shape and value.dim() == 1:
                per_key[key] = _entry_views(u, value, rank)
            elif torch.is_tensor(value) and value.dim() == 0 and key != "step":
                scalars.append((u.name, key, value.item()))
            elif torch.is_tensor(value) and key != "step":
                raise ValueError(
                    f"{type(optimizer).__name__} keeps state {key!r} of shape {tuple(value.shape)}, neither shaped like "
                    "the master shard nor a scalar: DCP cannot store it per parameter. Save with yashard.save_checkpoint"
                )
        for i, fqns in enumerate(u.fqns):
            state[fqns[0]] = {key: per_key[key][i] if key in per_key else value
                              for key, value in optimizer.state[u.master].items()}
    every = rt.comm.all_gather_object(scalars, "sharded_optim_state_dict (scalar state)")
    for other, theirs in enumerate(every):
        if theirs != every[0]:
            (unit, key, v), (_, _, w) = next((a, b) for a, b in zip(every[0], theirs) if a != b)
            raise ValueError(
                f"{type(optimizer).__name__} keeps scalar state {key!r} of {unit} that differs between ranks ({v} on "
                f"rank 0, {w} on rank {other}): it was computed from each rank's shard, and DCP would store one "
                "rank's value for every rank. Save with yashard.save_checkpoint"
            )
    param_groups = [{**{k: v for k, v in g.items() if k != "params"},
                     "params": [fqns[0] for u in units for fqns in u.fqns]}
                    for g, units in zip(optimizer.param_groups, groups)]
    return {"state": state, "param_groups": param_groups}


def load_sharded_optim_state_dict(rt, optimizer, state_dict: dict) -> None:
    """After ``dcp.load`` filled ``state_dict`` (from :func:`sharded_optim_state_dict` of this
    optimizer; its tensors were loaded in place): put its non-tensor state values back into the
    optimizer, and set each param group's hyperparameters to those of the saved group that holds its
    parameters. The saved groups must hold the same parameters as this optimizer's (DCP itself
    refuses a checkpoint with fewer groups: "Missing key ... param_groups.<i>...")."""
    optimizer = inner_optimizer(optimizer)  # (step_in_backward: the plain optimizer inside, its state)
    groups = optimizer_units(rt, optimizer)
    saved = state_dict.get("param_groups")
    if not isinstance(saved, list) or not isinstance(state_dict.get("state"), dict):
        raise ValueError("the optimizer state dict has no 'state' dict or 'param_groups' list: pass the dict "
                         "model.sharded_optim_state_dict(opt) made and dcp.load filled")
    for units in groups:
        for u in units:
            loaded = state_dict["state"].get(u.fqns[0][0], {})
            for key, value in loaded.items():
                if not torch.is_tensor(value):
                    optimizer.state[u.master][key] = value
    group_of = {name: i for i, sg in enumerate(saved) for name in sg.get("params", ())}
    for gi, (g, units) in enumerate(zip(optimizer.param_groups, groups)):
        names = [fqns[0] for u in units for fqns in u.fqns]
        missing = [n for n in names if n not in group_of]
        if missing:
            raise ValueError(f"param group {gi} holds {missing[0]}, which no saved param group holds "
                             f"({len(saved)} saved groups)")
        found = sorted({group_of[n] for n in names})
        hyper = [{k: v for k, v in saved[i].items() if k != "params"} for i in found]
        if any(h != hyper[0] for h in hyper[1:]):
            differ = sorted(k for k in hyper[0] if any(h.get(k) != hyper[0][k] for h in hyper[1:]))
            raise ValueError(
                f"param group {gi} of {type(optimizer).__name__} (e.g. {names[0]}) holds parameters that the "
                f"checkpoint keeps in groups {found}, which differ in {', '.join(differ)}: yashard keeps a unit's "
                "parameters in one group (model.param_groups puts every matrix in the decay group and the norm "
                "group in the no-decay one); regroup the saving run the same way, or set the hyperparameters by hand"
            )
        if hyper:
            g.update(hyper[0])
