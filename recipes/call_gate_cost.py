"""What the call gate (yashard/call_gate.py) costs, on 2 gloo ranks of this machine, tiny Llama:

* one gate passage alone;
* ``full_state_dict()`` with the gate and with it switched off.

The training step's collectives never pass the gate; the watchdog thread sleeps between looks
at the store (one small round trip every 0.5 s), so it is not measured here.

Each figure is the best of ``--reps`` repetitions, the two variants alternating, so that load from
other processes hits both alike. Prints one table.

    python recipes/call_gate_cost.py [--reps 4] [--calls 200]
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
    import yashard.sharded_model as sharded_model
    from yashard.call_gate import enter

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    rows: dict[str, list[float]] = {}
    gate = sharded_model.enter
    sm = yashard.shard(_model())
    for rep in range(args.reps):
        for on in ((True, False) if rep % 2 == 0 else (False, True)):
            sharded_model.enter = gate if on else (lambda comm, call: None)
            t = time.perf_counter()
            for _ in range(args.calls // 4):
                sm.full_state_dict()
            rows.setdefault(f"full_state_dict, gate {'on' if on else 'off'}", []).append(
                (time.perf_counter() - t) / (args.calls // 4))
        t = time.perf_counter()
        for _ in range(args.calls):
            enter(sm.runtime.comm, "cost")
        rows.setdefault("gate passage", []).append((time.perf_counter() - t) / args.calls)
    sharded_model.enter = gate
    if rank == 0:
        out.put({k: min(v) for k, v in rows.items()})
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--calls", type=int, default=200)
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
