"""What a save of a sharded model holds besides the master shards' parameters: the model's
persistent buffers and, per optimizer param group, the units whose master shards it steps. Both
of yashard's own checkpoints (:mod:`yashard.checkpoint`) and the ``torch.distributed.checkpoint``
views (:mod:`yashard.dcp`) store exactly these."""

from __future__ import annotations

import torch


def persistent_buffers(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of every buffer ``model.state_dict()`` holds (persistent, not None), each
    tensor once (under its first name), less the model's ``_keys_to_ignore_on_save``: what
    ``save_pretrained`` stores besides parameters."""
    ignore = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    out, seen = [], set()
    for mod_name, module in model.named_modules():
        for name, buf in module._buffers.items():
            fqn = f"{mod_name}.{name}" if mod_name else name
            if buf is None or name in module._non_persistent_buffers_set or fqn in ignore or id(buf) in seen:
                continue
            seen.add(id(buf))
            out.append((fqn, buf))
    return out


def optimizer_units(rt, optimizer) -> list[list]:
    """Per param group of ``optimizer``, the units of the runtime ``rt`` whose master shards it holds
    (refusing anything else)."""
    unit_of = {id(u.master): u for u in rt.units}
    groups = []
    for gi, g in enumerate(optimizer.param_groups):
        units = []
        for p in g["params"]:
            u = unit_of.get(id(p))
            if u is None:
                raise ValueError(
                    f"optimizer param group {gi} holds a tensor of shape {tuple(p.shape)} that is not a master "
                    "shard of this model; build the optimizer from model.parameters() or model.param_groups(...)"
                )
            units.append(u)
        groups.append(units)
    return groups
