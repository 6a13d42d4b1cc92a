"""``ShardedGradScaler``: dynamic loss scaling for ``param_dtype=torch.float16`` on sharded gradients."""

from __future__ import annotations

import torch

from .errors import NonFiniteError
from .guards import register_agreeing_scaler
from .sharded_model import runtime_of


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
      * it stops a run that cannot recover: when ``update()`` lowers the scale below ``min_scale``
        (default 1.0, as DeepSpeed's ``min_loss_scale``), it raises :class:`yashard.NonFiniteError`
        saying how many steps in a row were skipped (on CUDA at the next ``update()``: the flag is
        read one step late, so no step waits for the GPU). Gradients that are not finite at a scale
        under 1 are not an fp16 range problem loss scaling can fix: usually the forward itself
        overflows float16 (the loss is inf), and a plain ``GradScaler`` would skip every step from
        then on without a word. ``min_scale=None`` turns the check off. All ranks hold the same
        scale, so all raise at the same step.
      * one collective per check, issued on every rank, so call ``unscale_`` / ``step`` on every
        rank, as with the rest of the training step. ``state_dict()`` holds plain numbers (it can
        go into ``save_checkpoint(extra=...)``).
    """

    def __init__(self, model, *, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True,
                 min_scale: float | None = 1.0):
        rt = runtime_of(model, "ShardedGradScaler")
        if enabled:
            rt.refuse_in_step_in_backward(
                "ShardedGradScaler", "the scaler unscales the gradients and skips the step if any rank saw an inf, "
                "after the backward, but each unit already stepped in backward on its scaled gradients",
                "compute in bf16 (param_dtype=torch.bfloat16 needs no loss scaling), or use the ordinary step (drop "
                "step_in_backward) for fp16")
        if min_scale is not None and not 0 < min_scale <= init_scale:
            raise ValueError(f"ShardedGradScaler: min_scale={min_scale} must be > 0 and at most init_scale={init_scale} "
                             "(or None, for no lower bound)")
        super().__init__(rt.device.type, init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval, enabled=enabled)
        self._comm = rt.comm
        self._device_of_model = rt.device
        self.min_scale = min_scale
        self._streak = torch.zeros((), dtype=torch.int64)   # steps skipped in a row (on the scale's device)
        self._floor_check = None  # CUDA: (pinned host copy of the last update's flags, its event)
        if self.is_enabled():
            rt.grad_scalers.add(self)

    def __getstate__(self):
        # the process group cannot be pickled: a copy (deepcopy, torch.save) is not attached to a model
        state = super().__getstate__()
        state["_comm"] = None
        state["_floor_check"] = None
        return state

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        if not self.is_enabled() or new_scale is not None or self.min_scale is None:
            return super().update(new_scale)
        found = [v for state in self._per_optimizer_states.values() for v in state["found_inf_per_device"].values()]
        super().update()  # (raises if no step recorded an inf check)
        dev = self._scale.device
        skipped = torch.stack([v.to(dev) for v in found]).sum() > 0
        self._streak = torch.where(skipped, self._streak.to(dev) + 1, 0)
        # [below min_scale after a skip, steps skipped in a row, scale], computed on the device
        state = torch.stack([(skipped & (self._scale < self.min_scale)).double(), self._streak.double(),
                             self._scale.double().reshape(())])
        if dev.type != "cuda":
            return self._check_floor(state.tolist())
        # CUDA: read the previous step's flags (finished long ago) and queue this step's copy, so the
        # step never waits for the GPU here; a run that cannot recover stops one step later
        previous, self._floor_check = self._floor_check, None
        if previous is not None:
            host, event = previous
            event.synchronize()
            self._check_floor(host.tolist())
        host = torch.empty(3, dtype=torch.float64, pin_memory=True)
        host.copy_(state, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._floor_check = (host, event)

    def _check_floor(self, state: list) -> None:
        below, streak, scale = state
        if below:
            raise NonFiniteError(
                f"ShardedGradScaler: {int(streak)} optimizer step(s) in a row were skipped for non-finite "
                f"gradients and the loss scale fell to {scale:g}, below min_scale={self.min_scale:g}: the gradients "
                "are not finite at any scale, which loss scaling cannot fix. If the loss is inf or NaN, the forward "
                "overflows float16 (values past 65504): train with param_dtype=torch.bfloat16 or torch.float32; if the "
                "loss is finite, look at the learning rate and the data. Pass min_scale=None to keep skipping steps")

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


# A plain torch.amp.GradScaler on master shards is refused (yashard.guards); this one agrees.
register_agreeing_scaler(ShardedGradScaler)
