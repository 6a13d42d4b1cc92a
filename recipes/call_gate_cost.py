"""What the call gate (yashard/call_gate.py) costs, on 2 gloo ranks of this machine, tiny Llama:

* one gate passage alone;
* ``full_state_dict()`` with the gate and with it switched off;
* a training step (forward, backward, AdamW) with the watchdog thread running and without it.

Each figure is the best of ``--reps`` repetitions, the two variants alternating, so that load from
other processes hits both alike. Prints one table.

    python recipes/call_gate_cost.py [--reps 4] [--calls 200] [--steps 30]
"""

from __future__ import annotations

import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg)


def _rank(rank: int, port: int, args, out) -> None:
    import yashard
    import yashard.api
    import yashard.sharded_model as sharded_model
    from yashard.call_gate import enter

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    rows: dict[str, list[float]] = {}
    watch, gate = yashard.api.watch, sharded_model.enter
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(rank))
    for rep in range(args.reps):
        for on in ((True, False) if rep % 2 == 0 else (False, True)):
            yashard.api.watch = watch if on else (lambda comm: None)
            sharded_model.enter = gate if on else (lambda comm, call: None)
            sm = yashard.shard(_model())
            opt = torch.optim.AdamW(sm.parameters(), lr=1e-3)
            if on:
                t = time.perf_counter()
                for _ in range(args.calls):
                    enter(sm.runtime.comm, "cost")
                rows.setdefault("gate passage", []).append((time.perf_counter() - t) / args.calls)
            t = time.perf_counter()
            for _ in range(20):
                sm.full_state_dict()
            rows.setdefault(f"full_state_dict, gate {'on' if on else 'off'}", []).append((time.perf_counter() - t) / 20)
            times = []
            for _ in range(args.steps):
                t = time.perf_counter()
                sm(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad()
                times.append(time.perf_counter() - t)
            times = sorted(times[3:])
            rows.setdefault(f"training step (median), watchdog {'on' if on else 'off'}", []).append(
                times[len(times) // 2])
    if rank == 0:
        out.put({k: min(v) for k, v in rows.items()})
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, args, out)) for r in range(2)]
    for proc in procs:
        proc.start()
    rows = out.get(timeout=900)
    for proc in procs:
        proc.join()
    print(f"| what (2 gloo ranks, tiny Llama, best of {args.reps}) | ms |")
    print("|---|---|")
    for k, v in rows.items():
        print(f"| {k} | {v * 1e3:.3f} |")


if __name__ == "__main__":
    main()
