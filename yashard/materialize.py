"""Filling the master shards: from live weights, from a HuggingFace folder, or by initialisation.

:func:`yashard.shard` accepts three kinds of models, and no rank ever holds more of the full model
than one parameter (meta model) or one unit (live model) at a time:

* **live** weights (the model was built on the CPU or loaded): each unit is flattened, rank 0's
  copy is broadcast (``sync_module_states``) and every rank keeps its shard;
* a model on the **meta** device plus ``weights=<HF folder>``: every rank reads just the rows that
  cover its shard from the safetensors files (:mod:`yashard.safetensors_io`); nothing is pickled;
* a model on the **meta** device alone: the model's own initialisation is replayed parameter by
  parameter, in the same order and with the same random draws as building it on the CPU, so the
  weights are identical to ``torch.manual_seed(s); AutoModelForCausalLM.from_config(cfg)`` with the
  same RNG state (see :func:`replay_initialisation`).

Buffers the model built on the meta device (rotary tables) are computed by the model's own
initialisation code; one left unset is an error, never garbage.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from . import bnb4
from .layout import FlatLayout, shard_pieces

# (unit key, entry index) of every parameter, by id(param)
ParamIndex = dict[int, tuple[str, int]]


def is_meta_model(model: nn.Module) -> bool:
    """True when any parameter of ``model`` lives on the meta device."""
    return any(p.is_meta for p in model.parameters())


def copy_pieces(master: torch.Tensor, layout: FlatLayout, rank: int, index: int, full: torch.Tensor) -> None:
    """Copy this rank's pieces of entry ``index`` from the full flattened tensor ``full``."""
    for piece in shard_pieces(layout, rank):
        if piece.entry == index:
            master[piece.shard_start : piece.shard_start + piece.numel].copy_(full[piece.entry_start : piece.entry_end])


# ------------------------------------------------------------------------------------------ live
def from_live(groups, layouts, masters, rank: int, broadcast: Callable[[torch.Tensor, str], None] | None,
              packed: set[str] = frozenset()) -> None:
    """Masters from materialised parameters; ``broadcast(flat, unit)`` syncs rank 0's copy. A byte
    unit (``packed``: 4-bit weights) holds each weight's record of bytes (:func:`yashard.bnb4.pack`)."""
    for key, members in groups.items():
        layout = layouts[key]
        flat = torch.zeros(layout.padded, dtype=torch.uint8 if key in packed else torch.float32,
                           device=masters[key].device)
        for entry, (p, _, _) in zip(layout.entries, members):
            if key in packed:
                bnb4.pack(p, bnb4.record_of(p), flat[entry.offset : entry.end])
            else:
                flat[entry.offset : entry.end].copy_(p.detach().reshape(-1))
        if broadcast is not None:
            broadcast(flat, key)
        lo, hi = layout.shard_range(rank)
        masters[key].copy_(flat[lo:hi])
        del flat
