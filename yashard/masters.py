"""Every unit's master shard: from live weights, an HF folder, or the model's own init; and one
gathered whole.

A master is fp32, except a frozen unit's under a 16-bit ``param_dtype``, which is kept in
``param_dtype`` (:func:`yashard.build.master_dtype`). The readers hand every value in fp32, so
such a master holds the fp32 value rounded once, the bits a gather of an fp32 master would give.

The weights come from ``weights=<HF folder>`` (each rank reads only its rows), from a model built on
the meta device (its initialisation replayed one module at a time, from rank 0's RNG state with
``sync_module_states``), or from the live model (rank 0's broadcast, one unit at a time). The
readers are in :mod:`yashard.materialize` (live weights), :mod:`yashard.hf_folder` and
:mod:`yashard.init_replay`.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from . import build, hf_folder, init_replay, materialize
from .collectives import Comm
from .config import ShardConfig
from .layout import FlatLayout


def materialise(model: nn.Module, weights: str | None, comm: Comm, config: ShardConfig, groups: dict[str, list],
                layouts: dict[str, FlatLayout], device: torch.device) -> dict[str, torch.Tensor]:
    """Every unit's master shard (in :func:`yashard.build.master_dtype`), from live weights, an HF
    folder or the model's own init."""
    rank = comm.shard_rank
    masters = {k: torch.zeros(layouts[k].shard_numel, device=device,
                              dtype=build.unit_master_dtype(config, members))
                for k, members in groups.items()}
    meta = materialize.is_meta_model(model)
    packed = [k for k, members in groups.items() if build.is_packed(members)]
    if packed and (meta or weights is not None):
        raise ValueError(
            "a 4-bit base is sharded from its live quantised weights: load it with transformers' from_pretrained("
            "..., quantization_config=BitsAndBytesConfig(load_in_4bit=True)), not on the meta device or with weights=")
    if meta and weights is None:
        live = [n for n, p in model.named_parameters() if not p.is_meta]
        if live:
            on_meta = next(n for n, p in model.named_parameters() if p.is_meta)
            raise ValueError(
                f"parameter {on_meta} is on the meta device but {live[0]} is not; build the whole model on "
                "the meta device (yashard initialises it) or none of it, or pass weights=<HF folder>"
            )
    if weights is not None:
        folder = hf_folder.HFFolder(weights)
        hf_folder.check_folder_config(folder, model, warn=rank == 0)
        hf_folder.align_base_prefix(folder, model)
        used = hf_folder.from_folder(folder, model, groups, layouts, masters, rank)
        used |= hf_folder.load_buffers_from_folder(model, folder)
        if rank == 0:
            hf_folder.warn_unused(folder, model, used)
        init_replay.init_meta_buffers(model)
    elif meta:
        index = {id(p): (key, i) for key, members in groups.items() for i, (p, _, _) in enumerate(members)}
        with rank0_rng(comm, config, device):
            init_replay.from_init(model, groups, layouts, masters, rank, index)
    else:
        sync = config.sync_module_states and comm.world > 1
        materialize.from_live(groups, layouts, masters, rank,
                              (lambda flat, key: comm.broadcast(flat, 0, key)) if sync else None, set(packed))
    return masters


@contextlib.contextmanager
def rank0_rng(comm: Comm, config: ShardConfig, device: torch.device):
    """With ``sync_module_states``, initialise every rank from rank 0's CPU RNG state; the other
    ranks get their own state back afterwards (rank 0's advances, as building the model would)."""
    if not (config.sync_module_states and comm.world > 1):
        yield
        return
    own = torch.get_rng_state()
    state = own.clone().to(device)
    comm.broadcast(state, 0, "rng_state")
    torch.set_rng_state(state.cpu())
    try:
        yield
    finally:
        if comm.rank != 0:
            torch.set_rng_state(own)


def gather_whole(comm: Comm, unit, shard: torch.Tensor, what: str) -> torch.Tensor:
    """``shard`` (this rank's part of ``unit``: its master, or its gradient) all-gathered over the
    shard group into the unit's whole flat vector, padding included, in fp32. Collective: every
    rank of the shard group, the same unit. A 16-bit frozen master is gathered in its own dtype and
    widened after, which is exact. A byte unit's (4-bit weights) stays bytes. ``what`` names the caller
    in a timeout's message."""
    flat = torch.empty(unit.layout.padded, dtype=shard.dtype, device=shard.device)
    comm.wait(comm.all_gather(flat, shard.detach().contiguous(), unit.name), f"all_gather of {unit.name} ({what})",
              host=True)
    return flat if flat.dtype == torch.uint8 else flat.float()
