"""Every unit's fp32 master shard: from live weights, an HF folder, or the model's own init.

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

from . import hf_folder, init_replay, materialize
from .collectives import Comm
from .config import ShardConfig
from .layout import FlatLayout


def materialise(model: nn.Module, weights: str | None, comm: Comm, config: ShardConfig, groups: dict[str, list],
                layouts: dict[str, FlatLayout], device: torch.device) -> dict[str, torch.Tensor]:
    """Every unit's fp32 master shard, from live weights, an HF folder or the model's own init."""
    rank = comm.shard_rank
    masters = {k: torch.zeros(layouts[k].shard_numel, dtype=torch.float32, device=device) for k in groups}
    meta = materialize.is_meta_model(model)
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
                              (lambda flat, key: comm.broadcast(flat, 0, key)) if sync else None)
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
