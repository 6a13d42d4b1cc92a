"""Soak test: one long pretraining run, cut into segments at changing world sizes, against the same
run done in one go.

    python recipes/soak.py                                  # 200 steps, segments at W = 2, 3, 1, 4, 2
    python recipes/soak.py --steps 40 --worlds 2,1,3 --out-dir runs/soak

Every segment is a real ``torchrun`` of recipes/pretrain.py that resumes from the previous
segment's sharded checkpoint (``--resume true``) and stops at its boundary (``--stop-at``); the
global batch (``--global-batch``, divisible by every world size) is the same for all, so each step
trains on the same sequences whatever the world size. Segments at the reference's world size
reproduce it bitwise; after a world-size change the sums are taken in another order, so losses and
weights match to fp32 tolerance. Prints a table per segment and exits non-zero if any step or the
final weights differ by more than ``--rtol``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TINY = {  # a small Llama for the byte tokenizer (259 ids)
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 259, "hidden_size": 64,
    "intermediate_size": 176, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 256, "tie_word_embeddings": False,
    "bos_token_id": 257, "eos_token_id": 258, "pad_token_id": 256,
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(world: int, args: list[str]) -> float:
    """Run recipes/pretrain.py on ``world`` processes; returns its wall time; raises on failure."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world),
           "--master_port", str(_free_port()), str(HERE / "pretrain.py"), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return time.perf_counter() - t0


def read_log(path: Path) -> dict[int, dict]:
    return {r["step"]: r for r in (json.loads(line) for line in path.read_text().splitlines() if line.strip())}


def read_weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--worlds", default="2,3,1,4,2", help="world size of each segment (equal lengths)")
    p.add_argument("--reference-world", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=12, help="sequences per step (divisible by every world)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--rtol", type=float, default=2e-3, help="allowed relative difference (loss per step, weights)")
    p.add_argument("--out-dir", default="runs/soak")
    args = p.parse_args(argv)
    worlds = [int(w) for w in args.worlds.split(",")]
    for w in worlds + [args.reference_world]:
        if w < 1:
            p.error(f"world size {w} in --worlds {args.worlds} / --reference-world {args.reference_world}: every "
                    "world size must be >= 1")
        if args.global_batch % w:
            p.error(f"--global-batch {args.global_batch} is not divisible by world size {w}")
    if args.steps < len(worlds):
        p.error(f"--steps {args.steps} is fewer than the {len(worlds)} segments")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(TINY))
    common = ["--config", str(out / "config.json"), "--steps", str(args.steps), "--seq-len", str(args.seq_len),
              "--max-bytes", "400000", "--eval-every", "0", "--lr", "3e-3"]

    def run(world: int, where: Path, extra: list[str]) -> float:
        return torchrun(world, common + ["--micro-batch", str(args.global_batch // world),
                                         "--out-dir", str(where), "--save-every", "0", *extra])

    ref_dir, seg_dir = out / "reference", out / "segmented"
    for d in (ref_dir, seg_dir):
        if d.exists():
            import shutil

            shutil.rmtree(d)
    t_ref = run(args.reference_world, ref_dir, [])
    bounds = [round(args.steps * (i + 1) / len(worlds)) for i in range(len(worlds))]
    rows, start = [], 0
    for world, stop in zip(worlds, bounds):
        t = run(world, seg_dir, ["--resume", "true", "--stop-at", str(stop), "--save-every", str(stop)])
        rows.append((world, start, stop, t))
        start = stop
    ref, seg = read_log(ref_dir / "log.jsonl"), read_log(seg_dir / "log.jsonl")
    ok = sorted(seg) == sorted(ref) == list(range(1, args.steps + 1))
    print(f"reference: {args.steps} steps at world {args.reference_world} in {t_ref:.1f}s; "
          f"segments resume from each other's sharded checkpoints")
    print("| segment | world | steps | seconds | max rel. loss diff | bitwise |")
    print("|---:|---:|---|---:|---:|---|")
    for i, (world, a, b, t) in enumerate(rows):
        diffs = [abs(seg[s]["loss"] - ref[s]["loss"]) / abs(ref[s]["loss"]) for s in range(a + 1, b + 1)]
        bitwise = all(seg[s]["loss"] == ref[s]["loss"] for s in range(a + 1, b + 1))
        ok &= max(diffs) <= args.rtol
        print(f"| {i + 1} | {world} | {a + 1}-{b} | {t:.1f} | {max(diffs):.2e} | {'yes' if bitwise else 'no'} |")
    wa, wb = read_weights(seg_dir / "final"), read_weights(ref_dir / "final")
    num = math.sqrt(sum(float((wa[k].double() - wb[k].double()).pow(2).sum()) for k in wb))
    den = math.sqrt(sum(float(wb[k].double().pow(2).sum()) for k in wb))
    ok &= wa.keys() == wb.keys() and num / den <= args.rtol
    print(f"final weights: relative difference {num / den:.2e} (rtol {args.rtol:g}); "
          f"final loss {seg[args.steps]['loss']:.4f} vs {ref[args.steps]['loss']:.4f}")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
