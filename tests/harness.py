"""A small multi-process harness: run a function on W gloo ranks and collect its return values.

Each rank is a fresh process started by a *forkserver* that imported torch, transformers and
yashard once (a rank then starts in well under a second instead of ~9 s of CPU re-importing them
with ``spawn``; the server is a clean interpreter, so no pytest threads or state are inherited).
A rank initialises a gloo process group on a free loopback port, calls ``fn(rank, world, *args)``,
sends the (picklable) result back, and exits through ``barrier(); destroy_process_group();
os._exit(0)`` so gloo never aborts at interpreter exit. An exception on any rank fails the call
with that rank's traceback; a rank that dies without reporting fails it with its exit code.
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


def _entry(fn, rank, world, port, args, queue, backend="gloo"):
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    ok = True
    try:
        if backend == "nccl":  # one GPU per rank
            torch.cuda.set_device(rank)
            dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
        else:
            dist.init_process_group(backend, rank=rank, world_size=world)
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


_PRELOAD = ["torch", "torch.distributed", "transformers", "transformers.models.llama.modeling_llama",
            "transformers.models.qwen2.modeling_qwen2", "safetensors.torch", "yashard", "models", "harness"]


def _context():
    """The preloaded forkserver context (spawn where forkserver does not exist)."""
    if "forkserver" not in mp.get_all_start_methods():  # pragma: no cover - Windows
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def start_ranks(fn, world: int, args: tuple, backend: str = "gloo"):
    """Start ``world`` rank processes running ``fn``; returns ``(processes, result queue)``."""
    ctx = _context()
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, args, queue, backend),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    return procs, queue


def run_distributed(fn, world: int, *args, timeout: float = 240.0, backend: str = "gloo") -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` ranks (gloo; ``backend="nccl"``: rank r on GPU r);
    return the results ordered by rank."""
    procs, queue = start_ranks(fn, world, args, backend)
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


def run_until_exit(fn, world: int, *args, timeout: float = 120.0, grace: float = 0.5,
                   wait_for: tuple[int, ...] | None = None) -> dict:
    """Like :func:`run_distributed`, but tolerates ranks that die: once one rank has exited, the
    others get ``grace`` seconds and are then killed (what a job scheduler does); once every rank
    in ``wait_for`` has reported, the rest are killed at once. Returns ``{rank: (exitcode,
    reported)}`` where ``reported`` is ``(ok, payload)`` if the rank sent a result, else None."""
    import torch

    procs, queue = start_ranks(fn, world, args)
    deadline = time.monotonic() + timeout
    first_exit = None
    reported: dict[int, tuple] = {}

    def take(wait: float) -> bool:
        try:
            rank, ok, payload = queue.get(timeout=wait)
        except queue_mod.Empty:
            return False
        reported[rank] = (ok, torch.load(io.BytesIO(payload), weights_only=False) if ok else payload)
        return True

    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        if wait_for is not None and all(r in reported for r in wait_for):
            break
        if first_exit is None and any(not p.is_alive() for p in procs):
            first_exit = time.monotonic()
        if first_exit is not None and time.monotonic() - first_exit > grace:
            break
        take(0.1)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(timeout=10)
    while take(0.2):
        pass
    return {r: (procs[r].exitcode, reported.get(r)) for r in range(world)}
