"""``ShardedGradScaler``: dynamic loss scaling for ``param_dtype=torch.float16`` on sharded gradients."""

from __future__ import annotations

import torch

from .checkpoint import _runtime


class ShardedGradScaler(torch.amp.GradScaler):
    """:class:`torch.amp.GradScaler` for a model sharded by yashard; use it the same way::

        scaler = yashard.ShardedGradScaler(model)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)              # optional: before model.clip_grad_norm_
        scaler.step(opt)
        scaler.update()

    Contract:
      * every rank holds other gradient shards, so an inf can land in one rank's shards only. Each
        time the scaler checks gradients (``unscale_``, or the check a fused optimizer makes
        inside ``step``) it all-reduces its found-inf flag (MAX) over the shard group, the group
        that holds one copy of every gradient. Every rank then skips the same steps and keeps the
        same scale; a plain ``GradScaler`` would let ranks step apart.
      * it owns non-finite gradients: while an enabled one of the model exists,
        ``ShardConfig.on_nonfinite`` is not applied at optimizer steps (a step the scaler lets
        through has finite gradients; one it skips has lowered the scale, as loss scaling
        intends). The step check all-gathers whether one exists, so every rank decides alike.
      * a copy (``copy.deepcopy``, unpickled) is detached from the model and refuses to unscale;
        move state with ``state_dict()`` / ``load_state_dict()``.
      * one collective per check, issued on every rank, so call ``unscale_`` / ``step`` on every
        rank, as with the rest of the training step. ``state_dict()`` holds plain numbers (it can
        go into ``save_checkpoint(extra=...)``).
    """

    def __init__(self, model, *, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True):
        rt = _runtime(model, "ShardedGradScaler")
        super().__init__(rt.device.type, init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval, enabled=enabled)
        self._comm = rt.comm
        self._device_of_model = rt.device
        if self.is_enabled():
            rt.grad_scalers.add(self)

    def __getstate__(self):
        # the process group cannot be pickled: a copy (deepcopy, torch.save) is not attached to a model
        state = super().__getstate__()
        state["_comm"] = None
        return state

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        if self._comm is None:
            raise RuntimeError(
                "this ShardedGradScaler is a copy (deepcopy / unpickled) and is not attached to a sharded model; "
                "create one with yashard.ShardedGradScaler(model) and load_state_dict() the copy's state_dict()"
            )
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        # the model's device always takes part (a rank whose optimizer saw no gradient still joins)
        if self._device_of_model not in per_device:
            per_device[self._device_of_model] = found_inf.to(self._device_of_model)
        for device in sorted(per_device, key=str):  # the same collectives, in the same order, on every rank
            self._comm.all_reduce(per_device[device], "ShardedGradScaler found_inf", op="max")
        return per_device
