"""Every rank enters a collective API call together, or every rank ends.

``export_hf``, ``save_checkpoint``, ``load_checkpoint``, ``full_state_dict``, ``save_adapter``
and ``adapter_state_dict`` are collectives: every rank must call them. A rank that calls one alone
(``if trainer.is_world_process_zero(): trainer.save_model()``, a common DDP habit) would wait in
its first gather until the timeout, and a peer that went on to a barrier of its own would wait
there forever: gloo's barrier has no bound yashard sets, and a timed-out gather leaves the
process group's sequence broken for every later collective.

So each such call first passes a gate on the group's key-value store (:func:`enter`), before any
collective of the process group is issued: every rank adds itself to the call's counter and waits
(a blocking store wait, woken by the last rank to arrive) until every rank of the group arrived
(``collective_timeout`` at most). Each rank compares its call with the first rank's, so the
gate costs a few store round trips per rank and call, whatever the world size, once per export or save; the collectives of the
training step never pass it.

* Every rank arrived, the same call: the call goes on.
* Ranks arrived in different calls (rank 0 in ``export_hf``, rank 1 in ``save_checkpoint``):
  every rank raises :class:`~yashard.collectives.CollectiveError` naming both.
* A rank waited ``collective_timeout`` and its peers did not arrive: it raises ``CollectiveError``
  naming the call and the missing ranks, after it set the group's abort key and waited (that
  timeout at most) for each peer to acknowledge it. The process group is left clean (nothing of
  it was issued), so this rank can exit, and a peer still pending in a collective then fails at
  once ("Connection closed by peer").
* A peer that sees the abort key, on a watchdog thread started with the first :class:`Comm` of
  its group (a look at the store every 0.5 s, on its own connection: a small round trip),
  wherever its main thread waits, logs the same message and ends its process with exit
  code 1, after acknowledging it: it may be blocked in a collective nothing would ever complete
  (``dist.barrier``, a gather of the next step), which no Python code can interrupt.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
import threading
import time

from .collectives import CollectiveError, group_store

logger = logging.getLogger("yashard")

ABORT_KEY = "yashard/abort"
ACK_KEY = "yashard/abort/acks"   # how many peers ended, having logged why
_POLL = 0.005                         # seconds between looks at the peers' acknowledgements
_WATCH_EVERY = 0.5                    # seconds between the watchdog's looks at the abort key, at least
_WATCH_LOAD = 2000                    # ... every rank's watchdog together: at most this many looks a second
_watched: dict[int, threading.Thread] = {}   # id(store) -> its watchdog thread
_lock = threading.Lock()


class _Gate:
    """A group's gate state on this rank: the store, its key prefix and the count of calls."""

    __slots__ = ("store", "prefix", "seq")

    def __init__(self, store, prefix: str):
        self.store, self.prefix, self.seq = store, prefix, 0


def _gate(comm) -> _Gate | None:
    gate = getattr(comm, "_call_gate", None)
    if gate is None:
        store = group_store(comm.group)
        if store is None:  # (no store to meet at: a group made without one)
            return None
        # Comms of one group are created in the same order on its ranks: the count names each one's keys
        index = store.add(f"yashard/comms/r{comm.rank}", 1)
        gate = comm._call_gate = _Gate(store, f"yashard/gate/{index}")
    return gate


def watch(comm) -> None:
    """Name ``comm``'s gate (at ``shard()``, in the order every rank creates its Comms) and start the
    watchdog of its group on this process (once per store)."""
    store = group_store(comm.group)
    if store is None or comm.world == 1:
        return
    _gate(comm)
    with _lock:
        if id(store) in _watched and _watched[id(store)].is_alive():
            return
        try:
            own = store.clone()   # (its own connection: the main thread's store calls never wait for it)
        except Exception:  # noqa: BLE001 - a store that cannot be cloned gets no watchdog
            return
        t = threading.Thread(target=_watchdog, args=(own, comm.rank, max(_WATCH_EVERY, comm.world / _WATCH_LOAD)),
                             name="yashard-call-watchdog", daemon=True)
        _watched[id(store)] = t
        t.start()


def _watchdog(store, rank: int, every: float) -> None:
    """Look for the abort key every ``every`` seconds (0.5, or longer on a large world so the store
    sees at most ``_WATCH_LOAD`` looks a second), on this thread's own store connection
    (a check is one small round trip; a blocking wait instead would be cut off in C++ at
    interpreter exit, which aborts the process)."""
    while True:
        time.sleep(every)
        try:
            if not store.check([ABORT_KEY]):
                continue
            message = store.get(ABORT_KEY).decode()
        except Exception:  # noqa: BLE001 - the store went away: the job ended
            return
        if not message.startswith(f"rank {rank}:"):
            _end(message, rank, store)
        return


def _end(message: str, rank: int, store) -> None:
    """End this process: a peer gave up on a collective call this rank never joined. The peer
    waits for this rank's acknowledgement (``collective_timeout`` at most) before it goes on: it
    may host the store, and its exit would cut this rank off before it said why it ends."""
    text = (f"yashard: ending rank {rank}: {message.split(':', 1)[1].strip()} This rank did not join that call "
            "and would wait forever in its next collective.")
    if logger.hasHandlers():
        logger.error("%s", text)
    else:  # (no logging set up: stderr, where the traceback of an error would go)
        print(text, file=sys.stderr, flush=True)
    for h in logging.getLogger().handlers + logger.handlers:
        h.flush()
    try:
        store.add(ACK_KEY, 1)
    finally:
        os._exit(1)


def enter(comm, call: str) -> None:
    """Pass the gate of collective API ``call`` with every rank of ``comm``'s group (module docstring)."""
    if comm.world == 1:
        return
    gate = _gate(comm)
    if gate is None:
        return
    store, n = gate.store, gate.seq
    gate.seq += 1
    key = f"{gate.prefix}/{n}"
    store.set(f"{key}/r{comm.rank}", call)   # (read only to name the missing ranks after a timeout)
    # the first rank's call, to compare with: O(1) store operations a rank, whatever the world size
    first_rank, first_call = store.compare_set(f"{key}/call", "", f"{comm.rank}:{call}").decode().split(":", 1)
    if first_call != call:  # (set before this rank is counted: every rank sees it once all have arrived)
        pair = sorted([(int(first_rank), first_call), (comm.rank, call)])
        store.compare_set(f"{key}/mismatch", "", ", ".join(f"rank {r}: {c}" for r, c in pair))
    if store.add(f"{key}/count", 1) == comm.world:   # the last to arrive lets the others through
        store.set(f"{key}/all", "1")
    else:
        timeout = comm.timeout
        while True:   # (an event-driven wait: it returns when the key is set, no polling)
            try:
                store.wait([f"{key}/all"], datetime.timedelta(seconds=timeout if timeout is not None else 300))
                break
            except Exception:  # noqa: BLE001 - DistStoreError: the wait timed out
                if store.check([f"{key}/all"]):
                    break
                if timeout is not None:
                    _give_up(comm, store, key, call, timeout)
    if store.check([f"{key}/mismatch"]):
        shown = store.get(f"{key}/mismatch").decode()
        raise CollectiveError(
            f"yashard: the ranks entered different collective calls ({shown}); every rank must make the same "
            "yashard calls in the same order (export_hf, save_checkpoint, load_checkpoint, full_state_dict, "
            "save_adapter are collectives)")
    if n > 0:   # every rank passed the previous gate: its keys are done with (each rank deletes its own)
        try:
            for name in (["count", "all", "call"] if comm.rank == 0 else []) + [f"r{comm.rank}"]:
                store.delete_key(f"{gate.prefix}/{n - 1}/{name}")
        except (RuntimeError, NotImplementedError):  # (a store that cannot delete keeps them: a few bytes a call)
            pass


def _give_up(comm, store, key: str, call: str, timeout: float) -> None:
    missing = [r for r in range(comm.world) if not store.check([f"{key}/r{r}"])]
    shown = ", ".join(map(str, missing))
    message = (f"rank {comm.rank}: {call} was called on rank {comm.rank} of {comm.world}, and rank(s) {shown} did not "
               f"call it within collective_timeout={timeout:g}s.")
    store.set(ABORT_KEY, message)   # (the peers' watchdogs end them: they may be blocked in a collective)
    deadline = time.monotonic() + timeout
    while store.add(ACK_KEY, 0) < comm.world - 1 and time.monotonic() < deadline:
        time.sleep(_POLL)
    raise CollectiveError(
        f"yashard: {call} is a collective: {message.split(':', 1)[1].strip()} Call it on every rank, not only on "
        f"rank 0 (not inside `if trainer.is_world_process_zero():` or `if rank == 0:`): rank 0 writes the files. "
        "The peer ranks are ended (exit code 1) so the job does not hang.")
