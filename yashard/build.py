"""Building the units and slots of a model (run once, by ``shard()``).

From the partition (:mod:`yashard.partition`) and the ``ShardConfig``: each unit's flat layout,
the slots the units take turns in and their sizes, the units themselves around their master shards
(the HF modules lose their parameters to them; reading one gives a :class:`~yashard.stub.ShardedStub`),
and the order they run in (:class:`UnitSet`).
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass

import torch
from torch import nn

from . import bnb4
from .buffers import SharedBuffer, Slot
from .collectives import Comm
from .config import ShardConfig
from .layout import FlatLayout, build_layout, outer_arena, reduce_chunk, slot_assignment
from .memory import dtype_bytes
from .packed import PART_ALIGN, byte_shard_align
from .pass_state import PassState
from .patch.spec import ModelSpec
from .stub import ShardedStub, sharded_message
from .unit import MasterShard, Unit, own_version_alias, same_named_subclass

logger = logging.getLogger("yashard")

# Every parameter starts at a multiple of this many elements in its unit's flat buffer (64 bytes
# in fp32): the views the layers compute with are as aligned as freshly allocated tensors.
PARAM_ALIGN = 16


def direct_grads(direct: bool, dp_world: int, config: ShardConfig) -> bool:
    """Over one data-parallel rank with direct slots and fp32 reductions, reducing a unit's gradients
    is adding them to its master gradient: ``Narrow`` writes them there in place (no gradient slot,
    no copy, no reduction). A registered comm hook turns this off (it reduces from the slots: comm_hook_registry),
    and so does ``step_in_backward``: the slots' gradient buffers are then the workspace the step reads."""
    return direct and dp_world == 1 and config.wire_dtype == torch.float32 and not config.step_in_backward


def compact_grads(config: ShardConfig, shard_world: int, direct: bool) -> bool:
    """Whether the slots' gradient buffers are in ``param_dtype`` rather than ``reduce_dtype``:
    when ``param_dtype`` is the narrower (bf16 or fp16 compute, fp32 reduction), the gradients
    autograd hands ``Narrow`` are in ``param_dtype``, so keeping them in it loses nothing. They are
    widened to ``reduce_dtype`` a chunk at a time, into one staging buffer shared by the slots, and
    each chunk is reduce-scattered on its own (:class:`yashard.reduction.Reducer`): the same values
    go over the wire. Only with the alternating slots (``reshard_after_forward=True``), where a slot
    never accumulates gradients across backwards (``no_sync()`` needs per-unit slots), over a shard
    group of more than one rank (a direct slot reduces nothing), and with the default comm hook (a
    registered hook reads ``reduce_dtype`` buffers: :mod:`yashard.comm_hook_registry` turns it off)."""
    return (config.reshard_after_forward and not direct and shard_world > 1
            and dtype_bytes(config.param_dtype) < dtype_bytes(config.wire_dtype))


def master_dtype(config: ShardConfig, trains: bool) -> torch.dtype:
    """The dtype a unit's master shard is kept in: fp32, except for a frozen unit (every parameter
    frozen at ``shard()``) under a 16-bit ``param_dtype``, which keeps its shard in ``param_dtype``.
    Its weights never change and are gathered in ``param_dtype`` anyway, so the fp32 master rounded
    once at build gives the bits every gather would (the gathers need no cast, and direct slots no
    cast copy); 2 bytes per element instead of 4. (A byte unit's is uint8: :func:`unit_master_dtype`.)"""
    if not trains and dtype_bytes(config.param_dtype) < 4:
        return config.param_dtype
    return torch.float32


def staging_chunk(grad_sizes: dict[str, int], world: int, config: ShardConfig) -> int:
    """Each rank's part of one chunk of the chunked reduction (:func:`compact_grads`): the staging
    buffer holds ``world`` times it."""
    return reduce_chunk(max(grad_sizes.values(), default=0) // world, world, config.shard_align)


def direct_slots(shard_world: int, config: ShardConfig) -> bool:
    """Over one rank a shard is its whole unit: the slots show the units' own shards (no gather
    copies, no weight buffers), unless qwZ or hpZ are asked for (they change what is gathered)."""
    return shard_world == 1 and not config.quantized_weights and config.secondary_group_size is None


def warn_idle_settings(config: ShardConfig, comm: Comm) -> None:
    """Warn (rank 0) about settings that change nothing here, so nobody tunes a no-op."""
    if comm.rank != 0:
        return
    if comm.shard_world == 1 and (config.quantized_weights or config.secondary_group_size):
        logger.warning("yashard: over a one-rank shard group nothing is gathered, yet %s: drop it",
                       "qwZ (quantized_weights) quantizes the weights for nothing, losing precision"
                       if config.quantized_weights else
                       "hpZ (secondary_group_size) keeps a copy of every layer for nothing")
    if comm.shard_world > 1 and config.secondary_group_size == comm.shard_world:
        logger.warning(
            "yashard: secondary_group_size=%d (hpZ) equals the shard group's size, so the backward re-gathers "
            "run over the same ranks as without it, and each rank keeps a layer slice in param_dtype for nothing: "
            "use a smaller group (the ranks of one node) or drop secondary_group_size", comm.shard_world)
    if config.quant_block != ShardConfig.quant_block and not config.quantized_weights:  # (the field's default)
        logger.warning(
            "yashard: quant_block=%d is ignored: it sizes qwZ's quantization blocks and quantized_weights is off "
            "(set quantized_weights=8 or 4, or drop quant_block; qgZ's block is QgzState(block=))",
            config.quant_block)


def layouts_of(groups: dict[str, list], world: int, config: ShardConfig) -> dict[str, FlatLayout]:
    """Each unit's flat layout over ``world`` ranks. A byte unit (bitsandbytes 4-bit weights:
    :func:`is_packed`) is laid out in bytes: each weight one entry, the bytes of its record
    (:func:`yashard.bnb4.record_of`), every entry at a multiple of 64 bytes and every shard a multiple
    of ``shard_align`` fp32 elements' bytes."""
    out = {}
    for key, members in groups.items():
        if is_packed(members):
            out[key] = build_layout([(fqns[0], (bnb4.record_of(p).nbytes,)) for p, _, fqns in members], world,
                                    param_align=PART_ALIGN, shard_align=byte_shard_align(config.shard_align))
        else:
            out[key] = build_layout([(fqns[0], p.shape) for p, _, fqns in members], world, param_align=PARAM_ALIGN,
                                    shard_align=config.shard_align)
    return out


def unit_master_dtype(config: ShardConfig, members: list) -> torch.dtype:
    """The dtype of a unit's master: its bytes, uint8, for a byte unit (bitsandbytes 4-bit weights
    with their quantisation state, :mod:`yashard.bnb4`), else :func:`master_dtype`."""
    if is_packed(members):
        return torch.uint8
    return master_dtype(config, any(p.requires_grad for p, _, _ in members))


def is_packed(members: list) -> bool:
    """A unit of bitsandbytes 4-bit weights, held as bytes (``partition.check_packed`` made sure
    all of its members are)."""
    return any(bnb4.is_4bit(p) for p, _, _ in members)


def packed_slots(groups: dict[str, list], slot_of: dict[str, str]) -> set[str]:
    """The slots of byte units: their weight buffers are bytes (uint8)."""
    return {slot_of[key] for key, members in groups.items() if is_packed(members)}


def slot_sizes(groups: dict[str, list], layouts: dict[str, FlatLayout], config: ShardConfig, direct: bool = False):
    """``(slot of each unit, weight elements per slot, gradient elements per slot)``: a slot is as
    large as the largest unit it holds; its gradient buffer as the largest that trains (units whose
    parameters are all frozen write no gradients). ``direct``: :func:`direct_slots`."""
    if config.share_outer_slot and "lm_head" not in groups and any(len(locs) > 1 for _, locs, _ in groups.get("embed", [])):
        raise ValueError(
            "ShardConfig.share_outer_slot=True needs an lm_head of its own, but this model ties it to the input "
            "embedding: one weight read at both ends of every step, whose gradients add up over the whole backward, "
            "so it cannot give its buffer to the layers in between. Use share_outer_slot=False (the default)"
        )
    slot_of = slot_assignment(list(groups), alternate=config.reshard_after_forward,
                              share_outer=shares_outer(config, direct))
    sizes: dict[str, int] = {}
    grad_sizes: dict[str, int] = {}
    for key, name in slot_of.items():
        sizes[name] = max(sizes.get(name, 0), layouts[key].padded)
        trains = any(p.requires_grad for p, _, _ in groups[key])
        grad_sizes[name] = max(grad_sizes.get(name, 0), layouts[key].padded if trains else 0)
    return slot_of, sizes, grad_sizes


def shares_outer(config: ShardConfig, direct: bool) -> bool:
    """Whether the embedding and the lm_head gather into the layer slots' buffer
    (``ShardConfig.share_outer_slot``; a direct slot holds no weights to share)."""
    return config.share_outer_slot and not direct


def shared_arenas(sizes: dict[str, int], grad_sizes: dict[str, int], n_layers: int):
    """The weight and gradient :class:`~yashard.layout.Arena` of the shared buffer, over the slots
    that take part in it (the layer slots and the outer units')."""
    names = [n for n in sizes if n in ("layer_even", "layer_odd", "embed", "lm_head") and sizes[n] > 0]
    return (outer_arena({n: sizes[n] for n in names}, n_layers),
            outer_arena({n: grad_sizes[n] for n in names}, n_layers))


def make_slots(sizes: dict[str, int], grad_sizes: dict[str, int], world: int, config: ShardConfig,
               device: torch.device, direct: bool, direct_grads: bool, compact: bool = False,
               n_layers: int = 0, packed: set[str] = frozenset()) -> tuple[dict[str, Slot], SharedBuffer | None]:
    """The slot buffers (a slot of size 0, every unit in it empty, is left out) and the buffer
    they share, if they do (:func:`shares_outer`); ``compact``: the gradient buffers in
    ``param_dtype`` (:func:`compact_grads`); ``packed``: the slots whose weights are bytes
    (:func:`packed_slots`)."""
    grad_dtype = config.param_dtype if compact else config.wire_dtype
    grad_sizes = {name: 0 if direct_grads else g for name, g in grad_sizes.items()}
    shared = None
    if shares_outer(config, direct):
        shared = SharedBuffer(*shared_arenas(sizes, grad_sizes, n_layers), config.param_dtype, grad_dtype, device)
    slots = {
        name: Slot(name, numel, world, torch.uint8 if name in packed else config.param_dtype, grad_dtype, device,
                   direct=direct,
                   grad_numel=grad_sizes[name],
                   shared=shared if shared is not None and name in shared.weight_arena.offsets else None)
        for name, numel in sizes.items()
        if numel > 0
    }
    if shared is not None:
        shared.link(slots)
    return slots, shared


@dataclass
class UnitSet:
    """The units of one model, in the orders the schedules walk them."""

    units: list[Unit]          # forward order, then the resident groups (``unit.order`` indexes this)
    forward_order: list[Unit]  # embedding, layers, lm_head
    layers: list[Unit]
    embed: Unit | None
    lm_head: Unit | None
    small: Unit | None         # the norm group
    adapters: Unit | None = None  # the adapter group (PEFT adapters' trainable weights)

    @property
    def resident(self) -> list[Unit]:
        """The units gathered at the forward's start and reduced at the backward's end (kind
        ``"small"``): the adapter group, then the norm group."""
        return [u for u in (self.adapters, self.small) if u is not None]


def make_units(groups: dict[str, list], layouts: dict[str, FlatLayout], slots: dict[str, Slot],
               slot_of: dict[str, str], masters: dict[str, torch.Tensor], config: ShardConfig, state: PassState,
               shard_rank: int, device: torch.device, direct: bool,
               spec: ModelSpec) -> tuple[UnitSet, dict[nn.Parameter, str]]:
    """The units around their master shards, and ``{removed parameter: its name}``: the HF modules
    no longer own their parameters (a read gives a stub until the unit's views are installed).
    Each unit's collectives are labelled with its HF module path in profiler traces."""
    removed: dict[nn.Parameter, str] = {}
    units: list[Unit] = []
    layers: list[Unit] = []
    embed = lm_head = small = adapters = None
    for key, members in groups.items():
        layout = layouts[key]
        slot = slots[slot_of[key]]
        if key.startswith("layer_"):
            idx, kind = int(key.split("_")[1]), "layer"
        else:
            idx, kind = -1, "small" if key in ("small", "adapters") else "outer"  # (resident groups: "small")
        shard = masters.pop(key)
        master = MasterShard(shard, requires_grad=shard.is_floating_point())  # (a byte unit's: frozen bytes)
        unit = Unit(
            state, shard_rank, key, kind, idx, layout,
            locations=[locs for _, locs, _ in members],
            fqns=[fqns for _, _, fqns in members],
            slot=slot, master=master, trainable=[p.requires_grad for p, _, _ in members],
            keep_grads=not config.step_in_backward,
        )
        unit.name_in_traces({"small": "norm group", "adapters": "adapter group"}.get(key) or module_name(spec, unit))
        # Over a one-rank shard group the views read the unit's own shard in place (direct slots):
        # with a 16-bit param_dtype that is a cast copy of an fp32 master, kept (a frozen unit's
        # master is in param_dtype already: master_dtype). Every other gather casts an fp32 master
        # into this rank's own chunk of the slot and gathers in place (gathers.py).
        if direct and master.dtype != slot.weights.dtype:
            unit.gather_src = torch.empty(master.shape, dtype=config.param_dtype, device=device)
        if direct:  # (an alias: the views' in-place writes move its own version counter)
            unit.direct_source = own_version_alias(unit.gather_src)
        if config.secondary_group_size is not None and kind == "layer":  # hpZ: this rank's secondary slice
            unit.secondary = torch.empty(layout.padded // config.secondary_group_size, dtype=config.param_dtype,
                                         device=device)
        if is_packed(members):  # a 4-bit weight's view: a Params4bit over its record's bytes in the slot
            unit.rebuild = [bnb4.Rebuild(p, bnb4.record_of(p)) for p, _, _ in members]
        for entry, (p, locs, fqns) in enumerate(members):  # the HF modules no longer own these parameters
            removed[p] = fqns[0]
            if unit.rebuild is not None:
                for module, _ in locs:  # (bitsandbytes' copy of the state: the views carry their own)
                    if getattr(module, "quant_state", None) is not None:
                        module.quant_state = None
            for (module, attr), fqn in zip(locs, fqns):
                module._parameters.pop(attr, None)
                mark_sharded(module, attr, fqn, p.shape, unit, entry, config.param_dtype, device)
        units.append(unit)
        if kind == "layer":
            layers.append(unit)
        elif key == "small":
            small = unit
        elif key == "adapters":
            adapters = unit
        elif key == "embed":
            embed = unit
        else:
            lm_head = unit
    layers.sort(key=lambda u: u.index)
    order = ([embed] if embed else []) + layers + ([lm_head] if lm_head else [])
    units = order + [u for u in (adapters, small) if u is not None]
    for a, b in zip(order, order[1:] + [None]):
        a.next_forward = b
    sharing = collections.Counter(u.slot.name for u in units)
    for i, u in enumerate(units):
        u.order = i
        # Views of a unit whose slot other units reuse (or whose memory other slots share) come off
        # once nothing reads them any more: after its forward, or (activation checkpointing
        # recomputes the forward) its backward.
        checkpointed = u.kind == "layer" and u.index < config.checkpoint_layers
        if sharing[u.slot.name] > 1 or u.slot.overlaps:
            u.views_until = "backward" if checkpointed else "forward"
        # the recompute of a checkpointed layer reads its own views and the norm group's: those
        # of the grad-enabled forward it belongs to are put back when its backward starts
        u.keep_backward_views = checkpointed or (u.kind == "small" and config.checkpoint_layers > 0)
    return UnitSet(units, order, layers, embed, lm_head, small, adapters), removed


def module_name(spec: ModelSpec, unit: Unit) -> str:
    """The HF path of ``unit`` ("model.layers.3", "lm_head", ...), for messages."""
    if unit.kind == "layer":
        return f"{spec.layers}.{unit.index}"
    return {"embed": spec.embed, "lm_head": spec.lm_head, "adapters": "the adapter group"}.get(unit.name,
                                                                                            "the norm group")


_MARKED_CLASSES: dict[type, type] = {}


def mark_sharded(module: nn.Module, attr: str, fqn: str, shape: torch.Size, unit: Unit, entry: int,
                 dtype: torch.dtype, device: torch.device) -> None:
    """Give ``module`` (an HF submodule that lost parameter ``attr`` to a shard) a same-named
    subclass of its class whose attribute ``attr``, while no view of the running unit is installed,
    is a :class:`~yashard.stub.ShardedStub`: the parameter's shape, the dtype and device its unit
    computes in, whether it trains, and no values (``print(model)`` reads shapes; HF forwards read
    an embedding's device or the head's dtype from outside its unit)."""
    cls = type(module)
    if cls not in _MARKED_CLASSES.values():
        def __getattr__(self, name):
            try:
                return cls.__getattr__(self, name)
            except AttributeError:
                fqn, shape, unit_ref, entry, dtype, device = self.__dict__.get("_yashard_sharded", {}).get(
                    name, (None,) * 6)
                if fqn is None:
                    raise
                u = unit_ref()
                if u is None:  # (its runtime is gone)
                    raise AttributeError(sharded_message(fqn)) from None
                return ShardedStub(fqn, shape, dtype, device,
                                   u.trainable[entry] and u.master.requires_grad)

        module.__class__ = same_named_subclass(cls, _MARKED_CLASSES, {"__getattr__": __getattr__})
    module.__dict__.setdefault("_yashard_sharded", {})[attr] = (fqn, torch.Size(shape), unit.ref, entry, dtype, device)
