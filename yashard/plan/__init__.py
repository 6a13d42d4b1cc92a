"""``yashard.plan``: the memory plan ``shard()`` would hold, with no process group and no allocation.

The plan is the same pure formula the live runtime uses (:func:`yashard.memory.plan_memory`); this
module builds its inputs from the model's shapes alone: the partition of parameters into units,
their flat layouts over the shard group, the slots and what the default comm hook asks for. The
model is built on the meta device from an HF config, a ``config.json`` path or a folder; a model
object is only read.

    plan = yashard.plan("path/to/config.json", world_size=256,
                        config=yashard.ShardConfig(param_dtype=torch.bfloat16))
    print(plan)          # the rows memory_plan() shows, per rank

    python -m yashard.plan --config llama-3-70b --world 256 --param-dtype bf16 --gpu-memory 80GiB

The command line (``yashard/plan/__main__.py``) prints the same rows, each marked as fixed or
shrinking as 1/W, and the model state against a GPU's memory. Presets
(:mod:`yashard.plan.presets`) are the shapes of common models, as config dicts: nothing is
downloaded.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from .. import build, partition
from ..collectives import needs_reduce_scatter_scratch
from ..comm_hooks import reduce_scatter_hook
from ..config import ShardConfig, low_precision_dtype
from ..layout import shard_ranges_of
from ..memory import MemoryInputs, MemoryPlan, SlotSize, UnitSize, dtype_bytes, plan_memory
from ..patch.spec import resolve_spec
from ..topology import Topology

BACKENDS = ("nccl", "gloo")


def plan(model_or_config, *, world_size: int, config: ShardConfig | None = None, rank: int = 0,
         backend: str = "nccl") -> MemoryPlan:
    """The :class:`~yashard.memory.MemoryPlan` that ``yashard.shard`` would hold on rank ``rank`` of
    ``world_size`` ranks, with the default comm hook.

    ``model_or_config``: an ``nn.Module`` (on any device, the meta device included: only its
    parameters' shapes, dtypes and ``requires_grad`` are read), a transformers ``PretrainedConfig``,
    or the path of a ``config.json`` or of a folder holding one. ``config``: as ``shard()`` takes it;
    without one, a model whose parameters are all bf16 (fp16) computes in that dtype, as ``shard()``
    decides. ``backend``: the process group's, ``"nccl"`` or ``"gloo"`` (gloo's reduce-scatter over
    more than two ranks needs a receive buffer). ``rank`` matters only with partly frozen units,
    whose kept frozen values depend on which rows a rank holds.
    """
    if backend not in BACKENDS:
        raise ValueError(f"plan(backend={backend!r}): use one of {', '.join(map(repr, BACKENDS))}, the process "
                         "group's backend the run will use")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"plan(world_size={world_size!r}): the number of data-parallel ranks, an int >= 1")
    model = _model_of(model_or_config)
    config = _config_for(model, config)
    topo = Topology(world_size, rank, config.shard_group_size or world_size, config.secondary_group_size)
    return plan_memory(memory_inputs(model, config, topo, backend))


def grad_shard_bytes(plan: MemoryPlan) -> int:
    """The bytes of ``plan``'s fp32 gradient shards (``4 N/W``): what the optimizer step in backward
    removes (:func:`yashard.plan.activations.yashard_peak`'s ``step_in_backward_saves``)."""
    return sum(r.bytes for r in plan.rows if r.name == "fp32 grad shards")


def memory_inputs(model: nn.Module, config: ShardConfig, topo: Topology, backend: str) -> MemoryInputs:
    """What the plan is a formula of, from the model's shapes: the slots and units ``shard()`` would
    build on ``topo`` (no tensor is allocated), and the default comm hook's workspace."""
    model = partition.base_model_of(model)  # (a PEFT model: its HF model, as shard() takes it)
    spec = resolve_spec(model)
    partition.validate(model, spec, config)
    groups = partition.partition(model, spec)
    world = topo.shard_size
    shard_rank = topo.shard_rank
    layouts = build.layouts_of(groups, world, config)
    direct = build.direct_slots(world, config)
    slot_of, sizes, grad_sizes = build.slot_sizes(groups, layouts, config, direct)
    direct_grads = build.direct_grads(direct, topo.world, config)
    compact = build.compact_grads(config, world, direct)
    staging = world * build.staging_chunk(grad_sizes, world, config) if compact else 0
    shared = build.shares_outer(config, direct)
    packed = build.packed_slots(groups, slot_of)  # (4-bit layers: byte slots)
    slots = tuple(SlotSize(name, numel, 0 if direct_grads else grad_sizes[name], direct,
                           shared and name in ("layer_even", "layer_odd", "embed", "lm_head"), name in packed)
                  for name, numel in sizes.items() if numel > 0)
    units = []
    for key, members in groups.items():
        layout = layouts[key]
        trainable = [p.requires_grad for p, _, _ in members]
        frozen = 0
        if any(trainable) and not all(trainable):
            frozen = sum(hi - lo for lo, hi in shard_ranges_of(layout, shard_rank, [not t for t in trainable]))
        units.append(UnitSize(layout.shard_numel, any(trainable), frozen,
                              layout.padded if key.startswith("layer_") else None,
                              build.unit_master_dtype(config, members)))
    # What the default hook asks for on every trained unit's bucket (Reducer.plan_workspaces), kept
    # once per name at the largest request, as Reducer.workspace grows it.
    comm = _PlannedComm(world, needs_reduce_scatter_scratch(backend == "gloo", world))
    # (the chunked reduction of param_dtype gradient slots: what it asks for one chunk)
    largest: dict[str, tuple[int, torch.dtype]] = {}
    for key, u in zip(groups, units):
        if u.trains:
            numel = staging or layouts[key].padded
            for name, numel, dtype in reduce_scatter_hook.workspace_plan(None, comm, numel, config.wire_dtype):
                largest[name] = max(largest.get(name, (0, dtype)), (numel, dtype), key=lambda x: x[0])
    workspaces = tuple((name, numel, numel * dtype_bytes(dtype)) for name, (numel, dtype) in largest.items())
    return MemoryInputs(config=config, world=world, slots=slots, units=tuple(units), direct=direct,
                        direct_grads=direct_grads, reduce_out=world > 1, workspaces=workspaces,
                        hook_planned=True, staging_numel=staging)


class _PlannedComm:
    """What a comm hook's ``workspace_plan`` reads of a :class:`~yashard.collectives.Comm`, for a
    shard group that does not exist yet."""

    def __init__(self, shard_world: int, needs_scratch: bool):
        self.shard_world = shard_world
        self._needs_scratch = needs_scratch

    def reduce_scatter_needs_scratch(self, group=None) -> bool:
        return self._needs_scratch


def _model_of(model_or_config) -> nn.Module:
    """The model to read shapes from: the module itself, or one built on the meta device."""
    if isinstance(model_or_config, nn.Module):
        return model_or_config
    from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

    cfg = model_or_config
    if isinstance(cfg, (str, os.PathLike)):
        path = os.fspath(cfg)
        if not os.path.exists(path):
            raise FileNotFoundError(f"plan: {path} does not exist; pass an HF config, a config.json or a folder "
                                    "holding one")
        cfg = AutoConfig.from_pretrained(path)
    if not isinstance(cfg, PretrainedConfig):
        raise TypeError(f"plan expects an nn.Module, a transformers PretrainedConfig or the path of a config.json, "
                        f"got {type(model_or_config).__name__}")
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


def _config_for(model: nn.Module, config: ShardConfig | None) -> ShardConfig:
    """``config``, or what ``shard()`` picks without one: the model's dtype when every parameter is
    bf16 (fp16), else the defaults."""
    if config is not None:
        if not isinstance(config, ShardConfig):
            raise TypeError(f"config must be a yashard.ShardConfig, got {type(config).__name__}")
        return config
    low = low_precision_dtype(partition.float_param_dtypes(model))
    return ShardConfig() if low is None else ShardConfig(param_dtype=low)
