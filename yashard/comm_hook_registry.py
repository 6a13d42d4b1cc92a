"""The comm hook registry: which hook reduces the gradients, and the hook state a checkpoint carries.

``register_comm_hook`` replaces the default reduce-scatter once, before the first forward, on
every rank alike (contract in :mod:`yashard.comm_hooks`). A stateful hook's state (``QgzState``'s
rounding position) is saved with a checkpoint and given back to the hook at a load, in either
order of ``load_checkpoint`` and ``register_comm_hook``; a state nothing can take is warned about.
"""

from __future__ import annotations

import logging

import torch

from .buffers import Slot
from .collectives import Comm
from .comm_hooks import fp16_compress_hook
from .config import ShardConfig
from .events import Streams
from .pass_state import PassState
from .reduction import Reducer
from .unit import Unit

logger = logging.getLogger("yashard")


class CommHookRegistry:
    """Registers the comm hook on a :class:`~yashard.reduction.Reducer` and resumes its state."""

    def __init__(self, reducer: Reducer, comm: Comm, config: ShardConfig, state: PassState, streams: Streams,
                 units: list[Unit], slots: dict[str, Slot], grad_sizes: dict[str, int], device: torch.device):
        self.reducer = reducer
        self.comm = comm
        self.config = config
        self.state = state
        self.streams = streams
        self.units = units
        self.slots = slots
        self.grad_sizes = grad_sizes  # (what the slots' gradient buffers hold when they have one)
        self.device = device
        self.registered = False  # register_comm_hook was called (once only)
        self.loaded_state: dict | None = None  # a checkpoint's comm hook state, for a hook registered later

    def register(self, state, hook) -> None:
        """Replace how each unit's gradients are reduced (contract in :mod:`yashard.comm_hooks`)."""
        if not callable(hook):
            raise TypeError(f"register_comm_hook needs a callable hook(state, bucket), got {type(hook).__name__}")
        if self.registered:
            current = self.reducer.comm_hook
            raise RuntimeError(
                f"a comm hook ({getattr(current, '__name__', current)}) is already registered; "
                "register one hook, once, before the first forward"
            )
        if self.state.grad_fwd_id > 0:
            raise RuntimeError(
                "register_comm_hook must be called before the first forward (gradients of earlier steps "
                "were reduced by the default hook)"
            )
        self._check_same_hook(state, hook)
        r = self.reducer
        if self.loaded_state is not None:  # load_checkpoint came first: resume this hook's state now
            self._load_hook_state(state, self.loaded_state)  # (raises before anything is registered)
            self.loaded_state = None
        bf16 = [f"{k}=bfloat16" for k, d in (("param_dtype", self.config.param_dtype),
                                             ("reduce_dtype", self.config.wire_dtype)) if d == torch.bfloat16]
        if hook is fp16_compress_hook and bf16 and self.comm.rank == 0:
            logger.warning(
                "yashard: fp16_compress_hook with %s: the gradients go over the wire in float16, whose range "
                "(largest 65504, smallest normal 6.1e-05) is far narrower than bfloat16's, and a bf16 run has no "
                "loss scaling to keep them inside it, so large gradients overflow to inf and small ones flush "
                "toward zero: use bf16_compress_hook (16 bits on the wire too, with bfloat16's range)", " and ".join(bf16))
        if self.state.direct_grads or r.staging is not None:  # a hook reduces the gradient slots whole, in
            r.drop_staging()                                   # reduce_dtype: give them those buffers
            self._allocate_grad_slots()
        r.comm_hook, r.comm_hook_state = hook, state
        name = getattr(hook, "__name__", "comm hook")
        r.op_name = f"gradient reduction ({name})"
        if not (getattr(hook, "__module__", None) or "").startswith("yashard."):  # the user's own hook
            r.hint = (
                f"The comm hook {name} (register_comm_hook) raised this, or returned a future that did: look "
                "there first. If it came from a collective the hook issued, a peer rank died, stalled, or issued "
                "a different sequence of collectives: look for the first error on the other ranks"
            )
        self.registered = True
        r.workspaces.clear()  # the default hook's buffers; the new hook asks for its own
        r.plan_workspaces(self.units)

    def state_dict(self) -> dict | None:
        """The comm hook's state to save (``QgzState``'s rounding position), where it has one; a
        loaded one still waiting for its hook travels on."""
        if self.loaded_state is not None:
            return self.loaded_state
        get = getattr(self.reducer.comm_hook_state, "state_dict", None)
        return get() if callable(get) else None

    def restore_state(self, state_dict: dict | None) -> None:
        """Give a checkpoint's comm hook state (``state.state_dict()`` at the save; None: it had none)
        to the registered hook's state, or keep it for a hook registered later (before the first
        forward): the order of ``load_checkpoint`` and ``register_comm_hook`` does not matter. A
        state that nothing can take is warned about, never silently dropped."""
        if not self.registered:
            self.loaded_state = state_dict  # (a later load replaces an earlier one's, None included)
            if state_dict is not None and self.state.grad_fwd_id > 0:  # too late to register a hook for it
                self.drop_loaded_state(late=True)
        elif state_dict is not None:
            self._load_hook_state(self.reducer.comm_hook_state, state_dict)

    def _load_hook_state(self, state, state_dict: dict) -> None:
        load = getattr(state, "load_state_dict", None)
        if not callable(load):
            if self.comm.rank == 0:
                logger.warning(
                    "yashard: the checkpoint carries comm hook state %s, but the registered hook's state (%s) has no "
                    "load_state_dict, so it starts afresh: register the hook and state the run was saved with "
                    "(for example comm_hooks.QgzState with qgz_hook) to resume it", brief(state_dict),
                    type(state).__name__)
            return
        try:
            load(state_dict)
        except Exception as e:  # noqa: BLE001 - re-raised with both sides named
            raise ValueError(
                f"the checkpoint's comm hook state {brief(state_dict)} does not load into the hook state "
                f"{type(state).__name__} ({type(e).__name__}: {e}): register the hook and state the run was saved "
                "with, or one whose load_state_dict takes this") from e

    def drop_loaded_state(self, late: bool = False) -> None:
        """A forward ran without a hook to take a checkpoint's comm hook state: say so."""
        state_dict, self.loaded_state = self.loaded_state, None
        if self.comm.rank == 0:
            fix = ("load the checkpoint into a freshly sharded model and call register_comm_hook with the run's hook "
                   "before its first forward" if late else
                   "call register_comm_hook with the run's hook before the first forward")
            logger.warning(
                "yashard: the checkpoint was saved with a stateful comm hook (state %s), but no hook was registered "
                "before the first forward, so gradients are reduced by the default hook: to resume it, %s",
                brief(state_dict), fix)

    def _allocate_grad_slots(self) -> None:
        """Leave the in-place gradient path (:func:`yashard.build.direct_grads`) or the ``param_dtype``
        gradient slots (:func:`yashard.build.compact_grads`): before the first forward, the slots get
        the ``reduce_dtype`` gradient buffers a comm hook reads."""
        self.state.direct_grads = False
        shared = next((s.shared for s in self.slots.values() if s.shared is not None), None)  # (one, or none)
        if shared is not None:
            shared.grads = torch.zeros(shared.grad_arena.numel, dtype=self.config.wire_dtype, device=self.device)
            self.streams.share_with_comm([shared.grads])
        for name, slot in self.slots.items():
            slot.grad_numel = self.grad_sizes[name]
            if slot.shared is not None:  # (a view of the buffer the slots share, as at shard())
                slot.grads = slot.shared.grad_view(name)
            else:
                slot.grads = torch.zeros(slot.grad_numel, dtype=self.config.wire_dtype, device=self.device)
        for u in self.units:
            u.forget_grad_views()
        self.streams.share_with_comm([s.grads for s in self.slots.values() if s.shared is None])

    def _check_same_hook(self, state, hook) -> None:
        """Every rank must reduce with the same hook and state settings, or their collectives
        differ in size (a crash inside the backend, blamed on a peer): compare them, as ``shard()``
        compares the ``ShardConfig``."""
        settings = getattr(state, "settings", None)
        mine = (getattr(hook, "__module__", "?") + "." + getattr(hook, "__name__", type(hook).__name__),
                type(state).__qualname__, repr(settings() if callable(settings) else None))
        every = self.comm.all_gather_object(mine, "register_comm_hook (same hook on every rank)")
        for r, theirs in enumerate(every):
            if theirs != mine:
                raise ValueError(
                    f"register_comm_hook: this rank (rank {self.comm.rank}) registers hook {mine[0]} with state "
                    f"{mine[1]} {mine[2]}, rank {r} hook {theirs[0]} with state {theirs[1]} {theirs[2]}; every rank "
                    "must register the same hook with the same settings"
                )


def brief(state_dict: dict, limit: int = 120) -> str:
    text = repr(state_dict)
    return text if len(text) <= limit else text[:limit - 3] + "..."
