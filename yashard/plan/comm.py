"""The communication plan of one training step: every collective a rank issues, as the runtime's
``CollectiveLog`` records it, with no process group (issue 36, item 2).

The rules are yashard's schedule (docs/design.md, "No gather twice"):

- every unit is gathered once per optimizer step: the norm group, the embedding and layers 0 and 1
  by the step's post-hook, the other layers and the lm_head by the forward;
- the backward re-gathers every decoder layer but the last two, still in their slots; the
  embedding's backward needs no weights and the lm_head is still in the outer slot;
- a frozen unit is not gathered again by the post-hook when it is still in its slot from the
  backward (layers 0 and 1) or, with ``reshard_after_forward=False``, in its own buffer; tied
  embeddings are one unit, in the outer slot;
- with accumulation every later micro-batch gathers again what is not in a slot when a backward
  ends (everything but the norm group, layers 0 and 1 and a tied embedding), re-gathers in its
  backward as the first, and reduces every trained unit again;
- with ``reshard_after_forward=False`` nothing is gathered twice; over a shard group of one rank
  (hybrid with ``shard_group_size=1``) nothing is gathered at all: the slots are direct;
- every trained unit is reduce-scattered once per backward, over the shard group, in
  ``reduce_dtype``; under hybrid sharding its chunk is then all-reduced over the replica group;
  when the gradient slots are in ``param_dtype`` (``build.compact_grads``: 16-bit compute, fp32
  reduction, the default hook) it is reduce-scattered in chunks of at most the staging buffer
  (``layout.reduce_chunk``), the same bytes in more messages;
- qwZ gathers each rank's int8 or int4 codes and fp32 scales (``quant.qwz_workspace_nbytes``)
  instead of ``param_dtype`` values, the norm group exact; with hpZ the backward re-gathers read
  the secondary group, exact;
- qgZ replaces a reduce-scatter by an all-to-all inside the node (``W`` packed parts) and one
  across nodes (``nodes`` packed parts); a bucket it does not pay for, and the norm group, keep the
  exact reduce-scatter (``zeropp.qgz_fallback_reason``).

``nbytes`` is the full tensor's size, as the log counts it; :attr:`Collective.sent` is what one
rank sends with ring or pairwise algorithms: ``(g-1)/g`` of it over ``g`` ranks, twice that for an
all-reduce. :func:`peer_collectives` gives FSDP2's and ZeRO-3's by the same counting.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import build, partition
from ..config import ShardConfig
from ..layout import chunk_bounds, outer_arena, reduce_chunk
from ..memory import dtype_bytes
from ..patch.spec import resolve_spec
from ..quant import packed_nbytes, qwz_workspace_nbytes
from ..zeropp import qgz_fallback_reason
from .activations import ModelShape
from .peers import deepspeed_gathered_numel, deepspeed_kept_layers

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


@dataclass(frozen=True)
class Collective:
    kind: str         # all_gather, reduce_scatter, all_reduce, all_to_all
    phase: str        # "forward" (the step's post-hook gathers included) or "backward"
    unit: str         # as the runtime names it: embed, layer_<i>, lm_head, small
    group: str        # world, shard, secondary, replica, node, cross_node
    group_size: int
    numel: int        # as the log records it
    nbytes: int

    @property
    def sent(self) -> float:
        """Bytes one rank sends: ``(g-1)/g * nbytes``, twice that for an all-reduce."""
        share = (self.group_size - 1) / self.group_size * self.nbytes
        return 2 * share if self.kind == "all_reduce" else share


@dataclass(frozen=True)
class Qgz:
    """qgZ's settings, as ``QgzState`` takes them."""

    ranks_per_node: int
    bits: int = 4
    block: int = 64


def unit_sizes(model, config: ShardConfig, shard_world: int) -> dict[str, tuple[int, bool]]:
    """``{unit: (padded numel, trains)}`` in the runtime's order, from the model's shapes alone."""
    spec = resolve_spec(model)
    groups = partition.partition(model, spec)
    layouts = build.layouts_of(groups, shard_world, config)
    return {key: (layouts[key].padded, any(p.requires_grad for p, _, _ in members))
            for key, members in groups.items()}


def yashard_collectives(units: dict[str, tuple[int, bool]], *, world: int, config: ShardConfig,
                        qgz: Qgz | None = None, micro_batches: int = 1) -> tuple[Collective, ...]:
    """Every collective of one step of ``micro_batches`` micro-batches (each reduced, no
    ``no_sync``) of one rank, in the log's units and sizes, from the second step on."""
    s = config.shard_group_size or world
    replicas = world // s
    h = config.secondary_group_size
    p, g = dtype_bytes(config.param_dtype), dtype_bytes(config.wire_dtype)
    group = "world" if s == world else "shard"
    layers = [k for k in units if k.startswith("layer_")]
    out: list[Collective] = []
    chunk = 0  # (a registered hook, qgZ's, reduces reduce_dtype slots whole)
    if qgz is None and build.compact_grads(config, s, build.direct_slots(s, config)):
        chunk = reduce_chunk(max((padded // s for padded, trains in units.values() if trains), default=0), s,
                             config.shard_align)

    def gather(phase: str, unit: str, secondary: bool = False) -> None:
        padded = units[unit][0]
        if secondary:
            out.append(Collective("all_gather", phase, unit, "secondary", h, padded, padded * p))
        elif config.quantized_weights and unit != "small":
            b = qwz_workspace_nbytes(padded // s, s, bits=config.quantized_weights, block=config.quant_block)
            out.append(Collective("all_gather", phase, unit, group, s, b, b))
        else:
            out.append(Collective("all_gather", phase, unit, group, s, padded, padded * p))

    if s > 1 and config.share_outer_slot:  # (the outer units in the layer slots' buffer)
        arena_units = [u for u in units if u in ("embed", "lm_head") or u.startswith("layer_")]
        for micro in range(micro_batches):
            for unit, (_, trains) in units.items():
                if unit not in arena_units and (trains if micro == 0 else unit != "small"):
                    gather("forward", unit)
        for phase, unit in _shared_outer_gathers(units, arena_units, micro_batches):
            gather(phase, unit, secondary=h is not None and phase == "backward" and unit.startswith("layer_"))
        for micro in range(micro_batches):
            _reductions(out, units, s, replicas, g, group, qgz, config, chunk)
        return tuple(out)
    in_slots = {"small", *layers[:2]}  # still gathered when a backward ends
    if "lm_head" not in units:
        in_slots.add("embed")              # tied: the outer slot holds the embedding and the lm_head
    for micro in range(micro_batches):
        if s > 1 and micro == 0:
            for unit, (_, trains) in units.items():
                # a frozen unit has not changed: one that never leaves its buffer (no reshard),
                # or is still in its slot from the backward, is not gathered again
                if trains or (config.reshard_after_forward and unit not in layers[:2] and unit != "small"):
                    gather("forward", unit)
        elif s > 1 and config.reshard_after_forward:
            for unit in units:
                if unit not in in_slots:
                    gather("forward", unit)
        if s > 1 and config.reshard_after_forward:
            for unit in layers[:-2]:
                gather("backward", unit, secondary=h is not None)
        _reductions(out, units, s, replicas, g, group, qgz, config, chunk)
    return tuple(out)


def _shared_outer_gathers(units: dict[str, tuple[int, bool]], order: list[str],
                          micro_batches: int) -> list[tuple[str, str]]:
    """``ShardConfig.share_outer_slot``: the gathers of the embedding, the layers and the lm_head in
    one step, ``(phase, unit)``, found by running the schedule's rules on the slots' overlaps
    (:mod:`yashard.gathers`: a gather takes over every slot it overlaps; a prefetch waits while an
    overlapped slot is read or holds a gather not used yet). Two steps run; the second is returned,
    its optimizer step's post-hook gathers first."""
    layers = [u for u in order if u.startswith("layer_")]
    slot_of = {u: u if not u.startswith("layer_") else ("layer_even" if int(u.split("_")[1]) % 2 == 0
                                                         else "layer_odd") for u in order}
    sizes: dict[str, int] = {}
    for u in order:
        sizes[slot_of[u]] = max(sizes.get(slot_of[u], 0), units[u][0])
    arena = outer_arena(sizes, len(layers))
    overlaps = {name: set(arena.overlaps(name)) for name in sizes}
    owner: dict[str, str] = {}
    fresh: set[str] = set()
    reading: set[str] = set()
    current: set[str] = set()  # units gathered at their masters' current version
    log: list[tuple[str, str]] = []

    def have(u):
        return owner.get(slot_of[u]) == u and u in current

    def gather(u, phase):
        log.append((phase, u))
        slot = slot_of[u]
        owner[slot] = u
        fresh.add(slot)
        for o in overlaps[slot]:
            owner.pop(o, None)
            fresh.discard(o)
        current.add(u)

    def prefetch(u, phase):
        if u is not None and not have(u) and not any(o in owner and (o in reading or o in fresh)
                                                     for o in overlaps[slot_of[u]]):
            gather(u, phase)

    def run(u, nxt, phase):  # ensure, prefetch the next unit, release
        if not have(u):
            gather(u, phase)
        reading.add(slot_of[u])
        fresh.discard(slot_of[u])
        prefetch(nxt, phase)
        reading.discard(slot_of[u])

    backward = (["lm_head"] if "lm_head" in order else []) + layers[::-1]
    for step in range(2):
        if step:  # the optimizer step: masters change; its post-hook gathers the first unit of every slot
            start = len(log)
            current -= {u for u in order if units[u][1]}
            seen = set()
            for u in order:
                if slot_of[u] not in seen:
                    seen.add(slot_of[u])
                    prefetch(u, "forward")
        for _ in range(micro_batches if step else 1):
            reading.clear()
            prefetch(order[0], "forward")
            for i, u in enumerate(order):
                run(u, order[i + 1] if i + 1 < len(order) else None, "forward")
            reading.clear()
            for i, u in enumerate(backward):
                run(u, backward[i + 1] if i + 1 < len(backward) else None, "backward")
    return log[start:]


def _reductions(out: list, units: dict[str, tuple[int, bool]], s: int, replicas: int, g: int, group: str,
                qgz: Qgz | None, config: ShardConfig, chunk: int) -> None:
    """One backward's reductions: every trained unit's, in the log's units and sizes (``chunk``:
    elements per rank of each reduce-scatter of 16-bit gradient slots; 0: whole units)."""
    for unit, (padded, trains) in units.items():
        if not trains:
            continue
        reason = "no qgZ" if qgz is None or unit == "small" else qgz_fallback_reason(
            padded, s, qgz.ranks_per_node, dtype=config.wire_dtype, bits=qgz.bits, block=qgz.block)
        if reason is None:
            part = packed_nbytes(padded // s, qgz.bits, qgz.block)
            local, nodes = qgz.ranks_per_node, s // qgz.ranks_per_node
            if local > 1:
                out.append(Collective("all_to_all", "backward", unit + "/intra", "node", local, s * part, s * part))
            if nodes > 1 or local == 1:
                out.append(Collective("all_to_all", "backward", unit + "/inter", "cross_node", nodes, nodes * part,
                                      nodes * part))
        elif chunk:
            for _, k in chunk_bounds(padded // s, chunk):
                out.append(Collective("reduce_scatter", "backward", unit, group, s, s * k, s * k * g))
        else:
            out.append(Collective("reduce_scatter", "backward", unit, group, s, padded, padded * g))
        if replicas > 1:
            out.append(Collective("all_reduce", "backward", unit, "replica", replicas, padded // s, padded // s * g))


def peer_collectives(shape: ModelShape, *, world: int, param_bytes: int, reduce_bytes: int = 4,
                     engine: str = "fsdp2") -> tuple[Collective, ...]:
    """FSDP2's (``fully_shard`` per decoder layer, then the root) or ZeRO-3's collectives of one
    step, counted as yashard's are (padding left out).

    FSDP2 gathers each layer in forward and again in backward (``reshard_after_forward=True``),
    the root once (it is not resharded after forward), and reduce-scatters every group.
    ZeRO-3 (DeepSpeed's defaults) never gathers parameters under ``stage3_param_persistence_threshold``
    elements; it keeps a gathered layer for its backward when the parameters fetched in between
    stay under ``stage3_max_reuse_distance`` (1e9 elements); it reduce-scatters every gradient."""
    w, p, r = world, param_bytes, reduce_bytes
    root = shape.total_numel - shape.layers * shape.layer_numel
    out = []
    if engine == "fsdp2":
        out.append(Collective("all_gather", "forward", "root", "world", w, root, root * p))
        for k in range(shape.layers):
            out.append(Collective("all_gather", "forward", f"layer_{k}", "world", w, shape.layer_numel,
                                  shape.layer_numel * p))
        for k in reversed(range(shape.layers)):
            out.append(Collective("all_gather", "backward", f"layer_{k}", "world", w, shape.layer_numel,
                                  shape.layer_numel * p))
            out.append(Collective("reduce_scatter", "backward", f"layer_{k}", "world", w, shape.layer_numel,
                                  shape.layer_numel * r))
        out.append(Collective("reduce_scatter", "backward", "root", "world", w, root, root * r))
        return tuple(out)
    if engine != "deepspeed-zero3":
        raise ValueError(f"engine={engine!r}: fsdp2 or deepspeed-zero3")
    layer, embed, head = deepspeed_gathered_numel(shape)  # the rest stays whole: never gathered
    if embed:
        out.append(Collective("all_gather", "forward", "embed", "world", w, embed, embed * p))
    for k in range(shape.layers if layer else 0):
        out.append(Collective("all_gather", "forward", f"layer_{k}", "world", w, layer, layer * p))
    if head:
        out.append(Collective("all_gather", "forward", "lm_head", "world", w, head, head * p))
    kept = deepspeed_kept_layers(shape)
    for k in reversed(range(shape.layers)):
        if layer and k < shape.layers - kept:  # released after its forward: gathered again
            out.append(Collective("all_gather", "backward", f"layer_{k}", "world", w, layer, layer * p))
        # every gradient goes through the bucket, the persistent parameters' included
        out.append(Collective("reduce_scatter", "backward", f"layer_{k}", "world", w, shape.layer_numel,
                              shape.layer_numel * r))
    rest = shape.total_numel - shape.layers * shape.layer_numel
    out.append(Collective("reduce_scatter", "backward", "embed+lm_head", "world", w, rest, rest * r))
    return tuple(out)


@dataclass(frozen=True)
class CommSummary:
    """Per kind: how many, their bytes as logged, the smallest and largest message, bytes sent."""

    kind: str
    count: int
    nbytes: int
    smallest: int
    largest: int
    sent: float


def summarize(collectives) -> tuple[CommSummary, ...]:
    out = []
    for kind in KINDS:
        cs = [c for c in collectives if c.kind == kind]
        if cs:
            out.append(CommSummary(kind, len(cs), sum(c.nbytes for c in cs), min(c.nbytes for c in cs),
                                   max(c.nbytes for c in cs), sum(c.sent for c in cs)))
    return tuple(out)


def cross_node_sent(collectives, ranks_per_node: int, world: int) -> float:
    """Of the bytes sent, those that leave the node, with ``ranks_per_node`` consecutive ranks per
    node: groups of consecutive ranks (world, shard, secondary, node) cross nodes when larger than
    a node; replica and cross-node groups always do (when there is more than one node)."""
    if world <= ranks_per_node:
        return 0.0
    total = 0.0
    for c in collectives:
        if c.group in ("replica", "cross_node") or c.group_size > ranks_per_node:
            total += c.sent
    return total


def step_seconds(shape: ModelShape, *, tokens: int, tflops: float, mfu: float, checkpoint_layers: int = 0) -> float:
    """Compute time of one step on one rank: ``6 * N * tokens`` flops, plus ``2 * (the checkpointed
    layers' parameters) * tokens`` for their recomputation, at ``tflops * mfu``."""
    recompute = 2 * min(checkpoint_layers, shape.layers) * shape.layer_numel * tokens
    return (6 * shape.total_numel * tokens + recompute) / (tflops * 1e12 * mfu)

