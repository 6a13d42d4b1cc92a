"""Profile a few training steps of the shared loop with torch.profiler.

    torchrun --nproc_per_node 2 recipes/profiling.py                  # tiny Llama, CPU/gloo
    torchrun --nproc_per_node 8 recipes/profiling.py --model-size base --param-dtype bf16 --active 5
    torchrun --nproc_per_node 8 recipes/profiling.py --model PATH --tokenizer PATH --seq-len 2048

Runs wait + warmup + active steps of recipes/train_loop.py's loop under ``torch.profiler`` with that
schedule, then writes under --out-dir, per rank r:

  trace_rank{r}.json   Chrome trace of the active steps: open it in https://ui.perfetto.dev or
                       chrome://tracing. Every stage of a step is a labelled range: the loop's
                       yashard::data, forward, backward, clip_grad_norm, optimizer_step,
                       loss_all_reduce, and the runtime's, which name the unit by its HF
                       path as FSDP2's do: yashard::all_gather (model.layers.3),
                       reduce_scatter (lm_head), post_divide (model.embed_tokens), "(norm group)"
                       for the 1-D parameters; then wait_collective (the host waits for a
                       collective) and drain.

and on rank 0 profile_summary.txt (also printed) and profile_summary.json: per rank and step,
time in compute, in communication, exposed communication (communication the compute side is not
overlapping), memory peak, and host time in each labelled range (a runtime label summed over the
units). Definitions:

  wall      the active steps: ProfilerStep# ranges on the training thread.
  CUDA      comm = union of NCCL kernels; compute = union of all other kernels, memcpys and
            memsets (any stream); exposed = comm time with no compute kernel running.
  CPU/gloo  comm = union of the gloo:* ranges on any thread: collectives on gloo's worker threads,
            and the point-to-point sends and receives yashard's all-gathers are made of, on the
            training thread (time a transfer is in flight, waiting for peers included); compute =
            the training thread's operators minus its time issuing collectives (c10d::*,
            yashard::all_gather (UNIT), yashard::reduce_scatter (UNIT)) and waiting for them
            (yashard::wait_collective, with the post_divide inside a wait counted as compute);
            exposed = comm time during which the training thread runs no compute operator.
  peak      largest "Total Allocated" in the trace's [memory] events for the device (CPU: counted
            from the profiler's start, so memory allocated before it, the model's shards and
            buffers and the optimizer state included, is not in it; CUDA: the allocator's total).

recipes/trace_stats.py computes these from the exported trace files, so the table is what the
traces show. Model and data options are those of recipes/pretrain.py plus --model (an HF
checkpoint folder).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity

import trace_stats
import train
from train import MODEL_SIZES, TrainConfig


@dataclass
class ProfileConfig(TrainConfig):
    model: str | None = field(default=None, metadata={"help": "local HF checkpoint folder (default: tiny random Llama)"})
    model_size: str | None = field(default=None, metadata={
        "help": "random-init Llama preset (default: tiny)", "choices": tuple(MODEL_SIZES)})
    config: str | None = field(default=None, metadata={"help": "HF config.json (or its folder) to initialise at random"})
    wait: int = field(default=1, metadata={"help": "steps run before the profiler starts"})
    warmup: int = field(default=2, metadata={"help": "steps profiled but discarded (profiler warm-up)"})
    active: int = field(default=3, metadata={"help": "steps recorded in the traces"})
    save_every: int = field(default=0, metadata={"help": "0 (the only value: a save would land in a profiled step)"})
    profile_memory: bool = field(default=True, metadata={"help": "record allocations (memory peak, Perfetto memory counters)"})
    record_shapes: bool = field(default=False, metadata={"help": "record operator input shapes"})
    with_stack: bool = field(default=False, metadata={"help": "record Python stacks (large traces)"})
    steps: int | None = field(default=None, metadata={"help": "optimizer steps (default and only value: wait + warmup + active)"})
    eval_every: int = field(default=0, metadata={"help": "0 (the only value: the evaluation runs at the end, after profiling)"})
    out_dir: str = field(default="runs/profile", metadata={"help": "where traces, summary and log go"})

    def __post_init__(self) -> None:
        if self.steps is None:
            self.steps = self.wait + self.warmup + self.active

    def validate(self) -> None:
        if self.wait < 0 or self.warmup < 0 or self.active < 1:
            raise ValueError(f"--wait {self.wait} --warmup {self.warmup} --active {self.active}: "
                             "wait and warmup must be >= 0 and active >= 1")
        for flag, value, why in (
                ("--save-every", self.save_every, "a checkpoint save"), ("--eval-every", self.eval_every, "an evaluation"),
                ("--stop-at", self.stop_at, "stopping early"), ("--resume", self.resume, "resuming")):
            if value not in (0, None, False):
                raise ValueError(f"{flag} {value}: {why} would fall inside the profiled steps or cut them short "
                                 "(a ProfilerStep range holds everything up to the next step); profile a fresh run "
                                 f"without {flag}")
        if self.steps != self.wait + self.warmup + self.active:
            raise ValueError(f"--steps {self.steps} does not match --wait {self.wait} + --warmup {self.warmup} "
                             f"+ --active {self.active} = {self.wait + self.warmup + self.active}: "
                             "leave --steps out (it follows the schedule)")
        super().validate()


def parse_config(argv: list[str] | None = None) -> ProfileConfig:
    """ProfileConfig from the command line (one --flag per field)."""
    return train.parse_config(ProfileConfig, argv, __doc__)


def main(argv: list[str] | None = None) -> list[dict]:
    """Profile, export trace_rank{r}.json, and return every rank's summary (on rank 0; [] elsewhere)."""
    cfg = parse_config(argv)
    session = train.setup(cfg)
    trace_path = session.out_dir / f"trace_rank{session.rank}.json"

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if session.device.type == "cuda" else [])
    with torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(wait=cfg.wait, warmup=cfg.warmup, active=cfg.active, repeat=1),
        on_trace_ready=lambda prof: prof.export_chrome_trace(str(trace_path)),
        profile_memory=cfg.profile_memory, record_shapes=cfg.record_shapes, with_stack=cfg.with_stack,
    ) as prof:
        history = train.train_loop(session, profiler=prof)
    train.write_outputs(session, history, save_final=False, plot=False)

    summary = trace_stats.summarize_trace_file(trace_path)
    summaries: list[dict] = [None] * session.world_size  # type: ignore[list-item]
    dist.all_gather_object(summaries, summary)
    if session.is_main:
        table = trace_stats.format_table(summaries)
        print(table)
        (session.out_dir / "profile_summary.txt").write_text(table + "\n")
        (session.out_dir / "profile_summary.json").write_text(json.dumps(summaries, indent=2) + "\n")
        print(f"wrote {', '.join(str(session.out_dir / f'trace_rank{r}.json') for r in range(session.world_size))}, "
              f"{session.out_dir / 'profile_summary.txt'}")
    train.shutdown()
    return summaries if session.is_main else []


if __name__ == "__main__":
    train.main_or_usage_error(main)
