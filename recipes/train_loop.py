"""The training loop and the run's outputs: evaluation, the loss, the optimizer steps
(:func:`train_loop`), log.jsonl, checkpoints, final/, loss.png and the summary line
(:func:`write_outputs`); :func:`run` is the whole of a recipe (setup, loop, outputs, shutdown).
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import record_function
from tqdm import tqdm

import yashard
from data import EVAL_STREAM, IGNORE_INDEX, micro_batches, rank_slice
from schedule import lr_at
from train_config import BYTE_LEVEL, BYTE_TOKENIZER_FILE, TrainConfig
from train_setup import Session, read_log, setup

# --------------------------------------------------------------------------------------------
# Loop
# --------------------------------------------------------------------------------------------


def memory_mb(device: torch.device) -> float:
    """Peak CUDA allocation on GPU; on CPU the process's resident set size (VmRSS)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024  # kB -> MB
    except OSError:
        pass
    import resource  # no /proc (macOS): peak RSS instead, in bytes there

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _to(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def scored_tokens(batch: dict) -> int:
    """The tokens a batch's loss is taken over: labels are shifted by one (position t predicts
    labels[t + 1]), and -100 scores nothing (prompts and padding of SFT examples)."""
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


def loss_sum(model, micro: dict, device: torch.device) -> torch.Tensor:
    """The forward of one micro-batch and the SUM of its tokens' cross-entropy (fp32), as HF's
    causal-LM loss computes it before dividing. Every step divides the sum by the tokens of the
    whole global batch, so every token counts once, whatever the world size and accumulation
    (a mean per micro-batch would weight the tokens of examples with short responses more, and
    differently for each way of splitting the batch)."""
    inputs = _to(micro, device)
    labels = inputs.pop("labels")
    logits = model(**inputs, use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                             ignore_index=IGNORE_INDEX, reduction="sum")


@torch.no_grad()
def evaluate(s: Session) -> float:
    """Loss per scored token over cfg.eval_batches fixed held-out global batches, each the size of a
    training step's (so the held-out set is the same however that batch is split over ranks and
    micro-batches); each rank scores its rows in micro-batches of the training micro-batch's size."""
    cfg = s.cfg
    s.model.eval()
    total = torch.zeros((), device=s.device)
    tokens = 0
    for i in range(cfg.eval_batches):
        # The same batches at every eval (the step index is the batch number of a separate stream).
        batch = s.held_out.global_batch(cfg.seed, i, s.global_batch, stream=EVAL_STREAM)
        tokens += scored_tokens(batch)
        for micro in micro_batches(rank_slice(batch, s.rank, s.world_size), cfg.accum_steps):
            total += loss_sum(s.model, micro, s.device)
    dist.all_reduce(total)
    s.model.train()
    return total.item() / max(tokens, 1)


def _strict_json(record: dict) -> dict:
    """``record`` with every NaN/inf number as None: JSON has no such numbers (``json.dumps`` would write
    ``NaN``, which strict parsers refuse)."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}


def train_loop(s: Session, profiler=None) -> list[dict]:
    """Optimizer steps ``s.start_step .. cfg.steps - 1``; returns one record per step.

    Each stage of a step runs under a ``record_function`` label (``yashard::data``, ``forward``,
    ``backward``, ``clip_grad_norm``, ``optimizer_step``, ``loss_all_reduce``); ``profiler.step()``
    is called right after the step's work, so a ProfilerStep range holds one training step and
    whatever runs before the next one: evaluations and checkpoint saves, which recipes/profiling.py
    therefore refuses. Rank 0 appends each logged record to ``out_dir/log.jsonl``.
    """
    cfg, device = s.cfg, s.device
    max_norm = cfg.clip if cfg.clip > 0 else math.inf
    log_file = open(s.out_dir / "log.jsonl", "a" if s.start_step else "w") if s.is_main else None
    history: list[dict] = []
    s.model.train()
    bar = tqdm(initial=s.start_step, total=cfg.steps, disable=not s.is_main, dynamic_ncols=True, desc="train")
    train_time = s.elapsed  # seconds in training steps (evaluation excluded), a resumed run's counted on
    for step in range(s.start_step, cfg.steps):
        lr = lr_at(step, lr=cfg.lr, warmup_steps=cfg.warmup_steps, total_steps=cfg.steps, min_lr_ratio=cfg.min_lr_ratio)
        for group in s.opt.param_groups:
            group["lr"] = lr

        # Random draws in the step (dropout) from (seed, step, rank), as the data is drawn: a resumed
        # run draws what the uninterrupted one drew (the generator's state is in no checkpoint).
        torch.manual_seed((cfg.seed * 1_000_003 + step) * 1_009 + s.rank)
        t0 = time.perf_counter()
        with record_function("yashard::data"):
            whole = s.train_data.global_batch(cfg.seed, step, s.global_batch)
            # (the gradients are reduced as a SUM over ranks and divided by the world size)
            per_token = s.world_size / max(scored_tokens(whole), 1)
            batch = rank_slice(whole, s.rank, s.world_size)
        total = torch.zeros((), device=device)
        for i, micro in enumerate(micro_batches(batch, cfg.accum_steps)):
            # without resharding, every micro-batch but the last accumulates unreduced (as DDP's no_sync)
            hold = not cfg.reshard_after_forward and i < cfg.accum_steps - 1
            with s.model.no_sync() if hold else contextlib.nullcontext():
                with record_function("yashard::forward"):
                    micro_sum = loss_sum(s.model, micro, device)
                with record_function("yashard::backward"):
                    s.scaler.scale(micro_sum * per_token).backward()
            total += micro_sum.detach()
        with record_function("yashard::clip_grad_norm"):
            s.scaler.unscale_(s.opt)  # (a no-op unless fp16)
            grad_norm = s.model.clip_grad_norm_(max_norm)
        with record_function("yashard::optimizer_step"):
            try:
                s.scaler.step(s.opt)      # fp16: skipped on every rank if a gradient is not finite
            except yashard.NonFiniteError as e:
                raise yashard.NonFiniteError(f"step {step + 1}: {e}. In the recipes: lower --lr (now {cfg.lr:g}) or "
                                             f"raise --warmup-steps (now {cfg.warmup_steps})") from None
            s.scaler.update()
            s.opt.zero_grad(set_to_none=True)
        with record_function("yashard::loss_all_reduce"):
            # Loss per scored token of the global batch (SUM then divide: gloo has no AVG).
            dist.all_reduce(total)
            loss = total.item() * per_token / s.world_size  # .item() also waits for the step
        dt = time.perf_counter() - t0
        train_time += dt
        if profiler is not None:
            profiler.step()
        stop = step + 1 == (cfg.stop_at or cfg.steps)

        record = {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": float(grad_norm),  # inf: an fp16 step skipped
                  "tokens_per_s": s.tokens_per_step / dt, "elapsed": train_time}
        last = step + 1 == cfg.steps  # a --stop-at run logs exactly what the full run logs
        if last or (cfg.eval_every > 0 and (step + 1) % cfg.eval_every == 0):
            record["eval_loss"] = evaluate(s)
            if s.is_main:
                bar.write(f"step {step + 1}: eval loss {record['eval_loss']:.4f}")
        history.append(record)
        if s.is_main and (last or "eval_loss" in record or (step + 1) % max(1, cfg.log_every) == 0):
            log_file.write(json.dumps(_strict_json(record)) + "\n")
            log_file.flush()
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{record['tokens_per_s']:.0f}",
                            mem=f"{memory_mb(device):.0f}MB", refresh=False)
        # The checkpoint comes after the step's evaluation and log record: a run killed in between
        # resumes from the previous checkpoint and logs the step again (the log is cut back to it).
        # --stop-at always saves (a stopped run is continued with --resume), even with --save-every 0.
        if (stop and cfg.stop_at is not None) or (cfg.save_every > 0 and ((step + 1) % cfg.save_every == 0 or stop)):
            with record_function("yashard::save_checkpoint"):
                seconds = torch.tensor([train_time], dtype=torch.float64, device=device)
                dist.broadcast(seconds, 0)  # (extra is stored once: every rank passes rank 0's clock)
                extra = {"step": step + 1, "global_batch": s.global_batch, "freeze": s.cfg.freeze,
                         "frozen": s.frozen, "run": s.run_id, "data": s.data_digest, "elapsed": seconds.item(),
                         "first_loss": s.first_loss if s.first_loss is not None else history[0]["loss"]}
                if s.scaler.is_enabled():
                    extra["grad_scaler"] = s.scaler.state_dict()
                yashard.save_checkpoint(s.out_dir / "checkpoint", s.model, s.opt, extra=extra)
        bar.update(1)  # counted here, so a run that stops (--stop-at, last step) shows its last step
        if stop:
            break
    bar.close()
    if log_file is not None:
        log_file.close()
    return history


# --------------------------------------------------------------------------------------------
# Outputs
# --------------------------------------------------------------------------------------------


def save_plot(history: list[dict], path: Path) -> bool:
    """loss.png: train and held-out loss, and tokens/s, against the step. False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping loss.png (pip install matplotlib)")
        return False
    steps = [h["step"] for h in history]
    fig, (ax_loss, ax_tps) = plt.subplots(1, 2, figsize=(11, 4))
    ax_loss.plot(steps, [h["loss"] for h in history], label="train")
    evals = [(h["step"], h["eval_loss"]) for h in history if "eval_loss" in h]
    if evals:
        ax_loss.plot(*zip(*evals), "o-", label="held-out")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss")
    ax_loss.legend()
    ax_tps.plot(steps, [h["tokens_per_s"] for h in history])
    ax_tps.set_xlabel("step")
    ax_tps.set_ylabel("tokens/s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def throughput(history: list[dict]) -> float:
    """Tokens per second over the run's steps but the first (one-off warm-up costs): all tokens over
    all seconds, i.e. the harmonic mean of the per-step rates (every step has as many tokens)."""
    steady = history[1:] or history
    return len(steady) / sum(1 / h["tokens_per_s"] for h in steady)


def write_outputs(s: Session, history: list[dict], *, save_final: bool = True, plot: bool = True) -> dict:
    """final/ (collective: the HF export gathers one unit at a time), loss.png, the summary line.

    Returns the run summary on rank 0 and ``{}`` elsewhere. The plot is drawn from log.jsonl, so
    it covers every logged step of the run, resumed segments included.
    """
    if save_final:
        if getattr(s.cfg, "qlora", False):  # (a 4-bit base has no float HF folder to export: the adapter)
            yashard.save_adapter(s.model, s.out_dir / "final")
        else:
            yashard.export_hf(s.model, s.out_dir / "final")
        if s.is_main:
            write_tokenizer(s.tok, s.out_dir / "final")
    if not s.is_main or not history:
        return {}
    written = [s.out_dir / "log.jsonl"] + ([s.out_dir / "final"] if save_final else [])
    if s.cfg.save_every > 0 or s.cfg.stop_at is not None:
        written.append(s.out_dir / "checkpoint")
    if plot and save_plot(read_log(s.out_dir / "log.jsonl"), s.out_dir / "loss.png"):
        written.append(s.out_dir / "loss.png")
    first = s.first_loss if s.first_loss is not None else history[0]["loss"]  # (the whole run's)
    summary = {
        "first_loss": first, "last_loss": history[-1]["loss"],
        "eval_loss": history[-1].get("eval_loss"),
        "tokens_per_s": throughput(history),
        "memory_mb": memory_mb(s.device), "train_seconds": history[-1]["elapsed"],
    }
    print(f"loss {summary['first_loss']:.4f} -> {summary['last_loss']:.4f}, held-out loss "
          f"{summary['eval_loss']:.4f}, {summary['tokens_per_s']:,.0f} tokens/s, "
          f"{summary['memory_mb']:.0f} MB (rank 0), {summary['train_seconds']:.1f}s training")
    print("wrote " + ", ".join(str(p) for p in written))
    return summary


# What HF tokenizers save (save_pretrained) across their kinds, and the byte-level marker: a final/
# folder holds its own run's tokenizer only (export_hf keeps the files a folder had before)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                    "added_tokens.json", "vocab.json", "merges.txt", "vocab.txt", "spiece.model", "chat_template.jinja",
                    "chat_template.json", BYTE_TOKENIZER_FILE)


def write_tokenizer(tok, folder: Path) -> None:
    """Make ``folder`` (an HF export) hold this run's tokenizer and no other: an HF tokenizer's
    ``save_pretrained`` files, or for the byte-level one the marker that ``--model`` reads back
    (:func:`tokenizer_path`); another tokenizer's files left by an earlier run go first."""
    for name in _TOKENIZER_FILES:
        (folder / name).unlink(missing_ok=True)
    if hasattr(tok, "tok"):  # an HF tokenizer: keep the folder self-contained
        tok.tok.save_pretrained(folder)
    else:
        (folder / BYTE_TOKENIZER_FILE).write_text(json.dumps({
            "tokenizer": BYTE_LEVEL, "vocab_size": tok.vocab_size, "pad_token_id": tok.pad_id,
            "bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id,
            "about": "the yashard recipes' byte-level tokenizer (recipes/data.py ByteTokenizer): ids 0-255 are the "
                     "UTF-8 bytes; --model <this folder> trains on it again"}, indent=2) + "\n")


def shutdown() -> None:
    """Wait for every rank, then leave the process group."""
    dist.barrier()
    dist.destroy_process_group()


def run(cfg: TrainConfig) -> dict:
    """setup, train_loop, write_outputs, shutdown: the whole of a fine-tune or pretrain recipe.
    A run stopped early (``--stop-at``) writes its checkpoint and log but no final/ folder."""
    session = setup(cfg)
    history = train_loop(session)
    done = session.start_step + len(history)
    if done == cfg.steps:
        if session.is_main and not history:
            print(f"nothing to train: the checkpoint is at step {done} = --steps; exporting {session.out_dir / 'final'}")
        summary = write_outputs(session, history)
    else:
        summary = {}
        if session.is_main:
            print(f"stopped after step {done} of {cfg.steps}: checkpoint in "
                  f"{session.out_dir / 'checkpoint'}; continue with the same command and --resume true")
    shutdown()
    return summary
