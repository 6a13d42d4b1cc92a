"""The memory plan: every byte the runtime holds, with the formula, known before step one.

A pure formula over plain inputs (:class:`MemoryInputs`: the config, the shard world, the slot and
unit sizes), not a reader of a live runtime: the runtime builds its inputs from what it allocated,
and anything else that knows the sizes gets the same plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .config import ShardConfig
from .layout import outer_arena
from .quant import qwz_workspace_nbytes


def dtype_bytes(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return torch.empty((), dtype=dtype).element_size()


_SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16"}  # (the 16-bit param_dtypes, as rows name them)


@dataclass(frozen=True)
class MemoryRow:
    name: str
    numel: int
    bytes: int
    formula: str


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes held per rank by yashard, by buffer; ``total_bytes`` is everything yashard allocates.

    Optimizer state is held by the optimizer, not by yashard; ``adamw_bytes`` states what
    ``torch.optim.AdamW`` will add: ``8 * T/W``, two fp32 moments per element of every master with a
    gradient buffer (units whose parameters were all frozen at ``shard()`` have no state). With PEFT
    adapters the decoder layers are frozen units, and ``T/W`` is the adapter group's shard, plus the
    norm group's when a 1-D parameter trains. ``adamw_formula`` states it with the numbers.

    Masters are fp32, 4 bytes per element, except those of frozen units under a 16-bit
    ``param_dtype``: ``Z/W`` elements kept in ``param_dtype`` (the row ``bf16 frozen shards``).
    """

    rows: tuple[MemoryRow, ...]
    world: int
    adamw_bytes: int
    formula: str = field(default="")
    adamw_formula: str = field(default="")

    @property
    def total_bytes(self) -> int:
        return sum(r.bytes for r in self.rows)

    def __str__(self) -> str:
        w = max(len(r.name) for r in self.rows)
        lines = [f"yashard memory plan (per rank, world size {self.world})"]
        lines += [f"  {r.name:<{w}}  {r.bytes / 2**20:10.3f} MiB  {r.formula}" for r in self.rows]
        lines.append(f"  {'total':<{w}}  {self.total_bytes / 2**20:10.3f} MiB  {self.formula}")
        lines.append(f"  (+ AdamW state {self.adamw_bytes / 2**20:.3f} MiB, held by the optimizer: {self.adamw_formula})")
        return "\n".join(lines)


@dataclass(frozen=True)
class SlotSize:
    """One slot: its weight elements, its gradient elements (0 when only frozen units use it), and
    whether it is direct (shows the units' own shards: no weight buffer)."""

    name: str
    numel: int
    grad_numel: int
    direct: bool
    shared: bool = False  # a view of the buffer the layer slots and the outer units' slots share
    packed: bool = False  # its weights are bytes (4-bit weights with their quantisation state): 1 byte each


@dataclass(frozen=True)
class UnitSize:
    """One unit: its shard's elements, whether it trains (has gradient storage), the elements of
    its frozen values kept over a step (partly frozen units), for a decoder layer its padded size,
    and the dtype its master shard is kept in (:func:`yashard.build.master_dtype`: a frozen unit's
    is ``param_dtype`` when that is 16-bit)."""

    shard_numel: int
    trains: bool
    frozen_numel: int = 0
    layer_padded: int | None = None
    master_dtype: torch.dtype = torch.float32


@dataclass(frozen=True)
class MemoryInputs:
    """Everything the plan depends on."""

    config: ShardConfig
    world: int                      # ranks a unit is sharded over
    slots: tuple[SlotSize, ...]
    units: tuple[UnitSize, ...]
    direct: bool                    # slots show the units' own shards (shard world 1)
    direct_grads: bool              # gradients are added to the grad shards in place (no slot buffers)
    reduce_out: bool                # the reduce-scatter output is allocated (one rank: once a hook asks)
    workspaces: tuple[tuple[str, int, int], ...] = ()  # comm hook scratch: (name, numel, bytes)
    hook_planned: bool = False      # the workspaces come from the hook's workspace_plan
    # The slots' gradient buffers are in param_dtype and reduced through one staging buffer of
    # staging_numel reduce_dtype elements, a chunk at a time (build.compact_grads); 0: they are in
    # reduce_dtype and reduced whole.
    staging_numel: int = 0


def _shared_outer_row(outer: list[SlotSize], layers: list[SlotSize], p: int, gs_bytes: int) -> MemoryRow:
    """``ShardConfig.share_outer_slot``: the embedding's and the lm_head's slots lie in the layer
    slots' buffer, which grows only by what the larger of them exceeds both layer slots by."""
    s = max(o.numel for o in outer)
    # (the buffer as build lays it out: aligned slots, so a few elements may pad it)
    e = outer_arena({x.name: x.numel for x in layers + outer}, 0).numel - sum(x.numel for x in layers)
    ge = outer_arena({x.name: x.grad_numel for x in layers + outer}, 0).numel - sum(x.grad_numel for x in layers)
    names = " and ".join(o.name for o in outer)
    grads = f"E*({p}+{gs_bytes})" if ge == e else f"E*{p} + E'*{gs_bytes} (E'={ge}: gradients)"
    return MemoryRow("slot " + "+".join(o.name for o in outer), e, e * p + ge * gs_bytes,
                     f"S={s}, in the layer slots' buffer ({names}: share_outer_slot), E={e} beyond it: {grads}")


def plan_memory(inp: MemoryInputs) -> MemoryPlan:
    """Derive the plan from the layouts and dtypes alone (no tensor is inspected).

    Comm hook scratch (``GradBucket.workspace``) is listed as allocated: a hook with a
    ``workspace_plan`` (every built-in) has it from ``register_comm_hook`` on; one without, from
    its first call.
    """
    cfg = inp.config
    w = inp.world
    p, g = dtype_bytes(cfg.param_dtype), dtype_bytes(cfg.wire_dtype)
    compact = inp.staging_numel > 0
    gs_bytes = p if compact else g  # bytes of a slot's gradient element
    rows = []
    frozen_slots = any(slot.grad_numel != slot.numel for slot in inp.slots)
    outer = [slot for slot in inp.slots if slot.shared and not slot.name.startswith("layer_")]
    for slot in [] if inp.direct_grads else inp.slots:  # (one rank: no slot holds anything)
        if slot in outer:
            if slot is outer[0]:
                rows.append(_shared_outer_row(outer, [s for s in inp.slots if s.shared and s not in outer], p, gs_bytes))
            continue
        s, gs = slot.numel, slot.grad_numel
        if slot.packed:  # 4-bit weights and their quantisation state, S bytes: frozen, no gradients
            rows.append(MemoryRow(f"slot {slot.name}", s, (0 if slot.direct else s) + gs * gs_bytes,
                                  "weights: the unit's own shard" if slot.direct else
                                  f"S={s} bytes: 4-bit weights and their quantisation state"))
            continue
        if gs != s:  # units whose parameters are all frozen use it: grads sized by the others (G)
            weights = "weights: the unit's own shard" if slot.direct else f"S*{p} weights"
            rows.append(MemoryRow(f"slot {slot.name}", s, (0 if slot.direct else s * p) + gs * gs_bytes,
                                  f"S={s}, G={gs}: {weights} + G*{gs_bytes} grads (G: its units with a trainable "
                                  "parameter)"))
        elif slot.direct:  # shard world 1: the views read the units' own shards
            rows.append(MemoryRow(f"slot {slot.name}", s, s * g, f"S={s}: S*{g} grads (weights: the unit's own shard)"))
        else:
            rows.append(MemoryRow(f"slot {slot.name}", s, s * (p + gs_bytes), f"S={s}: S*({p}+{gs_bytes}) weights+grads"))
    if cfg.quantized_weights:
        b = max(qwz_workspace_nbytes(s.numel // w, w, bits=cfg.quantized_weights, block=cfg.quant_block)
                for s in inp.slots if s.name != "small")
        rows.append(MemoryRow("qwZ codes", b, b, f"W * (max S/W * {cfg.quantized_weights}/8 + 4 per "
                                                 f"{cfg.quant_block}-block, 16-aligned), shared by the slots"))
    m = max(slot.grad_numel for slot in inp.slots) // w
    # ShardConfig.step_in_backward: each unit's optimizer step reads the reduce-scatter output (over
    # a one-rank shard group, its slot's gradient buffer): that is the bounded gradient workspace
    step_bwd = cfg.step_in_backward
    out = w > 1 or inp.reduce_out  # (one rank: only once a comm hook asked for it)
    big = "G" if frozen_slots else "S"
    if out:
        rows.append(MemoryRow("reduce-scatter out", m, m * g, f"max {big}/W={m} * {g}, shared by the slots"
                              + ("; the optimizer steps from it (step_in_backward)" if step_bwd else "")))
    if compact:
        c = inp.staging_numel
        rows.append(MemoryRow("reduce-scatter staging", c, c * g,
                              f"W*C={c} * {g}: one chunk of a slot's {p}-byte gradients widened to {g} bytes, "
                              "shared by the slots"))
    n = sum(u.shard_numel for u in inp.units)
    nt = sum(u.shard_numel for u in inp.units if u.trains)
    nf = sum(u.frozen_numel for u in inp.units)
    # frozen units' shards kept in the 16-bit param_dtype (Z/W; every other master is fp32)
    nz = sum(u.shard_numel for u in inp.units if u.master_dtype not in (torch.float32, torch.uint8))
    nq = sum(u.shard_numel for u in inp.units if u.master_dtype == torch.uint8)  # 4-bit byte units' shards
    if nq:
        n -= nq
        rows.append(MemoryRow("4-bit shards", nq, nq, f"Q/W={nq} bytes: packed 4-bit weights and their quantisation "
                                                      "state (absmax, nested absmax and code), as bitsandbytes holds them"))
    if nz:
        rows.append(MemoryRow("fp32 master shards", n - nz, 4 * (n - nz),
                              f"(N-Z)/W={n - nz} * 4 (units with a trainable parameter)"))
        rows.append(MemoryRow(f"{_SHORT[cfg.param_dtype]} frozen shards", nz, p * nz,
                              f"Z/W={nz} * {p} (units whose parameters are all frozen, kept in param_dtype)"))
    else:
        rows.append(MemoryRow("fp32 master shards", n, 4 * n, f"N/W={n} * 4"))
    if step_bwd:  # (no gradient shards: the workspace the step reads is in the rows above)
        pass
    elif nt == n:
        rows.append(MemoryRow("fp32 grad shards", n, 4 * n, f"N/W={n} * 4"))
    else:  # units whose parameters were all frozen at shard() have none
        rows.append(MemoryRow("fp32 grad shards", nt, 4 * nt, f"T/W={nt} * 4 (units with a trainable parameter)"))
    if nf:
        rows.append(MemoryRow("frozen values", nf, 4 * nf, f"F={nf} * 4 (frozen parameters of partly frozen units, "
                                                          "kept over the optimizer step)"))
    # (else a gather casts into the slot; a 16-bit frozen master is read as it is)
    cast_copies = cfg.param_dtype != torch.float32 and inp.direct and n > nz
    if cast_copies:
        rows.append(MemoryRow(f"{cfg.param_dtype} gather sources", n - nz, p * (n - nz),
                              f"(N-Z)/W={n - nz} * {p}" if nz else f"N/W={n} * {p}"))
    extra = ""
    if cfg.secondary_group_size is not None:
        h = cfg.secondary_group_size
        m = sum(u.layer_padded // h for u in inp.units if u.layer_padded is not None)
        rows.append(MemoryRow("hpZ secondary shards", m, p * m, f"layers' padded size / {h} * {p}"))
        extra = f" + layers/{h}*{p}"
    for name, numel, nbytes in inp.workspaces:
        rows.append(MemoryRow(f"comm hook {name}", numel, nbytes,
                              "the comm hook's workspace_plan" if inp.hook_planned else
                              "asked for by the comm hook at its first call (it has no workspace_plan)"))
    cast = f"+{p}" if cast_copies else ""
    masters = f"N/W*(4{cast})" if cast else "N/W*4"
    if nz:
        masters = (f"(N-Z)/W*(4{cast})" if cast else "(N-Z)/W*4") + f" + Z/W*{p}"
    if step_bwd:  # (no gradient shards: the step reads the reduce-scatter output)
        shards = masters + (" + F*4" if nf else "")
    else:
        shards = f"N/W*(8{cast})" if nt == n else f"{masters} + T/W*4" + (" + F*4" if nf else "")
    if nq:
        shards += " + Q/W"
    if inp.direct_grads:
        slots = "no slot buffers (one rank: the views read the shards, gradients are added to the grad shards)"
    elif frozen_slots:
        slots = f"sum over slots {'' if inp.direct else f'S*{p} + '}G*{gs_bytes}"
    else:
        slots = f"sum over slots S*({g if inp.direct else f'{p}+{gs_bytes}'})"
    formula = (
        ("step in backward: " if step_bwd else "")
        + slots + f"{f' + max {big}/W*{g}' if out else ''}{f' + W*C*{g}' if compact else ''} + {shards}"
        + extra + (" + qwZ codes" if cfg.quantized_weights else "") + (" + comm hook scratch" if inp.workspaces else "")
    )
    adamw = (f"8 * T/W = 8 * {nt}, two fp32 moments per element of the trained shards" if nt != n else
             f"8 * N/W = 8 * {n}, two fp32 moments per master element")
    return MemoryPlan(tuple(rows), w, adamw_bytes=8 * nt, formula=formula, adamw_formula=adamw)
