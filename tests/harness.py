"""A small multi-process harness: run a function on W gloo ranks and collect its return values.

Each rank runs in a fresh ``spawn`` process, initialises a gloo process group on a free loopback
port, calls ``fn(rank, world, *args)``, sends the (picklable) result back, and exits through
``barrier(); destroy_process_group(); os._exit(0)`` so gloo never aborts at interpreter exit.
An exception on any rank fails the call with that rank's traceback.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue as queue_mod
import socket
import time
import traceback


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world, port, args, queue):
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    ok = True
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result = fn(rank, world, *args)
        buf = io.BytesIO()
        torch.save(result, buf)  # plain bytes: tensors would otherwise travel as shared-memory handles
        queue.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        ok = False
        queue.put((rank, False, traceback.format_exc()))
    try:
        queue.close()
        queue.join_thread()  # flush the result before os._exit skips the feeder thread
        if ok and dist.is_initialized():
            dist.barrier()
        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        os._exit(0 if ok else 1)


def run_distributed(fn, world: int, *args, timeout: float = 240.0) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return the results ordered by rank."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, args, queue), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors: list[str] = []
    try:
        deadline = time.monotonic() + timeout
        while len(results) < world and not errors:
            try:
                rank, ok, payload = queue.get(timeout=0.5)
            except queue_mod.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
                if dead:
                    time.sleep(1.0)  # its report may still be in flight
                    if queue.empty():
                        raise RuntimeError(
                            "distributed run failed: " + ", ".join(f"rank {r} exited with code {c}" for r, c in dead)
                            + " without reporting (killed, or crashed before the harness could catch it)"
                        ) from None
                    continue
                if time.monotonic() > deadline:
                    raise TimeoutError(f"a rank did not report within {timeout}s ({len(results)} of {world} did)") from None
                continue
            if ok:
                import torch

                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors.append(f"--- rank {rank} ---\n{payload}")
    finally:
        for p in procs:
            p.join(timeout=30 if not errors else 2)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("distributed run failed:\n" + "\n".join(errors))
    return [results[r] for r in range(world)]
