"""Fine-tune (or pre-train) a HuggingFace decoder with yashard.

    torchrun --nproc_per_node 2 recipes/finetune.py --steps 30 --lr 2e-3
    python recipes/finetune.py --param-dtype bf16            # one process, no torchrun
    torchrun --nproc_per_node 8 recipes/finetune.py --model PATH --tokenizer PATH --data sft.jsonl

With no --model/--tokenizer/--data it trains a tiny random-init Llama on Python standard library
sources with a byte-level tokenizer: no downloads, and done in well under two minutes on a
2-core CPU. Writes log.jsonl, loss.png (when matplotlib is installed) and an HF checkpoint folder
final/ under --out-dir.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import socket
import sys
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

import yashard
from data import build_datasets, load_tokenizer, micro_batches, rank_slice, EVAL_STREAM
from schedule import lr_at

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class FinetuneConfig:
    model: str | None = field(default=None, metadata={"help": "local HF checkpoint folder (default: tiny random Llama)"})
    tokenizer: str | None = field(default=None, metadata={"help": "local HF tokenizer folder (default: the model's, else byte-level)"})
    data: str | None = field(default=None, metadata={"help": ".txt (plain LM) or .jsonl {prompt, response} (SFT); default: Python stdlib sources"})
    max_bytes: int = field(default=4_000_000, metadata={"help": "cap on text bytes read for stdlib / .txt data"})
    eval_fraction: float = field(default=0.05, metadata={"help": "fraction of the data held out for eval"})
    steps: int = field(default=30, metadata={"help": "optimizer steps"})
    micro_batch: int = field(default=4, metadata={"help": "sequences per rank per forward/backward"})
    accum_steps: int = field(default=1, metadata={"help": "gradient accumulation micro-steps per optimizer step"})
    seq_len: int = field(default=128, metadata={"help": "tokens per sequence"})
    lr: float = field(default=2e-3, metadata={"help": "peak learning rate"})
    warmup_steps: int = field(default=5, metadata={"help": "linear warmup steps"})
    min_lr_ratio: float = field(default=0.1, metadata={"help": "cosine decays to min_lr_ratio * lr"})
    weight_decay: float = field(default=0.1, metadata={"help": "AdamW weight decay (matrices only)"})
    clip: float = field(default=1.0, metadata={"help": "global grad-norm clip (<= 0: no clipping)"})
    param_dtype: str = field(default="fp32", metadata={"help": "compute dtype", "choices": tuple(DTYPES)})
    checkpoint_layers: int = field(default=0, metadata={"help": "decoder layers with activation checkpointing"})
    eval_every: int = field(default=10, metadata={"help": "eval every N steps (<= 0: only at the end)"})
    eval_batches: int = field(default=4, metadata={"help": "held-out batches (micro_batch per rank) per eval"})
    seed: int = field(default=0, metadata={"help": "seed for model init and batch sampling"})
    out_dir: str = field(default="runs/finetune", metadata={"help": "where logs, plot and checkpoint go"})
    log_every: int = field(default=1, metadata={"help": "write a log line / refresh the bar every N steps"})


# --------------------------------------------------------------------------------------------
# Command line: one --flag per FinetuneConfig field
# --------------------------------------------------------------------------------------------


def _parse_bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {s!r}")


def parse_config(argv=None) -> FinetuneConfig:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    hints = typing.get_type_hints(FinetuneConfig)
    for f in dataclasses.fields(FinetuneConfig):
        tp = hints[f.name]
        args = [t for t in typing.get_args(tp) if t is not type(None)]
        if args:  # Optional[X] / X | None
            tp = args[0]
        kwargs = dict(default=f.default, help=f"{f.metadata.get('help', '')} (default: {f.default})")
        kwargs["type"] = _parse_bool if tp is bool else tp
        if "choices" in f.metadata:
            kwargs["choices"] = f.metadata["choices"]
        parser.add_argument(f"--{f.name.replace('_', '-')}", f"--{f.name}", dest=f.name, **kwargs)
    cfg = FinetuneConfig(**vars(parser.parse_args(argv)))
    if cfg.steps < 1 or cfg.micro_batch < 1 or cfg.accum_steps < 1 or cfg.seq_len < 2:
        parser.error("steps, micro_batch and accum_steps must be >= 1 and seq_len >= 2")
    return cfg


# --------------------------------------------------------------------------------------------
# Setup
# --------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed() -> tuple[int, int, torch.device]:
    """Join the torchrun group, or make a 1-process group when started with plain ``python``."""
    if "RANK" not in os.environ:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
                          WORLD_SIZE="1", RANK="0", LOCAL_RANK="0")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend=backend)
    return dist.get_rank(), dist.get_world_size(), device


def build_model(cfg: FinetuneConfig, tok):
    """The HF model, identical on every rank (yashard also broadcasts rank 0's weights)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(cfg.seed)
    if cfg.model is not None:
        # dtype= is the current name of from_pretrained's torch_dtype argument.
        model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32)
        if tok.vocab_size > model.get_input_embeddings().weight.shape[0]:
            raise ValueError(f"tokenizer has {tok.vocab_size} ids but the model's vocabulary is "
                             f"{model.get_input_embeddings().weight.shape[0]}; pass --tokenizer")
        return model
    hf_config = LlamaConfig(
        vocab_size=tok.vocab_size, hidden_size=128, intermediate_size=352, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max(256, cfg.seq_len),
        tie_word_embeddings=False, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id,
        pad_token_id=tok.pad_id,
    )
    return AutoModelForCausalLM.from_config(hf_config).float()


def _has_tokenizer_files(path: str) -> bool:
    return any((Path(path) / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


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


@torch.no_grad()
def evaluate(model, held_out, cfg, rank, world_size, device) -> float:
    """Mean loss over cfg.eval_batches fixed held-out batches, averaged over all ranks."""
    model.eval()
    total = torch.zeros((), device=device)
    for i in range(cfg.eval_batches):
        # The same batches at every eval (the step index is the batch number of a separate stream).
        batch = held_out.global_batch(cfg.seed, i, cfg.micro_batch * world_size, stream=EVAL_STREAM)
        out = model(**_to(rank_slice(batch, rank, world_size), device), use_cache=False)
        total += out.loss.float()
    dist.all_reduce(total)
    model.train()
    return total.item() / (cfg.eval_batches * world_size)


# --------------------------------------------------------------------------------------------
# Outputs
# --------------------------------------------------------------------------------------------


def save_plot(history: list[dict], path: Path) -> bool:
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


def _output_embedding_key(hf_model) -> str:
    out = hf_model.get_output_embeddings()
    for name, module in hf_model.named_modules():
        if module is out:
            return f"{name}.weight"
    return "lm_head.weight"


def save_checkpoint(full: dict, hf_model, tokenizer, path: Path) -> None:
    """An HF folder that ``AutoModelForCausalLM.from_pretrained(path)`` loads."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    text_config = hf_model.config.get_text_config() if hasattr(hf_model.config, "get_text_config") else hf_model.config
    if getattr(text_config, "tie_word_embeddings", False):
        # Tied: the input embedding alone is stored; from_pretrained re-ties the output to it.
        full = {k: v for k, v in full.items() if k != _output_embedding_key(hf_model)}
    # Own, contiguous CPU copies: safetensors refuses tensors that share memory.
    tensors = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in full.items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    hf_model.config.save_pretrained(path)
    if hasattr(tokenizer, "tok"):  # an HF tokenizer: keep the folder self-contained
        tokenizer.tok.save_pretrained(path)


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


def main(argv=None) -> dict:
    cfg = parse_config(argv)
    rank, world_size, device = init_distributed()
    is_main = rank == 0
    out_dir = Path(cfg.out_dir)
    if not is_main:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()  # one copy of HF warnings, from rank 0

    tok_path = cfg.tokenizer
    if tok_path is None and cfg.model is not None and _has_tokenizer_files(cfg.model):
        tok_path = cfg.model
    tok = load_tokenizer(tok_path)
    train_data, held_out, data_desc = build_datasets(cfg.data, tok, cfg.seq_len, cfg.eval_fraction, cfg.max_bytes)

    hf_model = build_model(cfg, tok)
    n_params = sum(p.numel() for p in hf_model.parameters())
    model = yashard.shard(hf_model, config=yashard.ShardConfig(
        param_dtype=DTYPES[cfg.param_dtype], reduce_dtype=torch.float32,
        checkpoint_layers=cfg.checkpoint_layers))
    opt = torch.optim.AdamW(model.param_groups(weight_decay=cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.95))

    # Each optimizer step consumes one global batch of micro_batch * accum_steps * world_size
    # sequences; this rank takes micro_batch * accum_steps of them, in accum_steps micro-batches.
    # Tokens per step = global batch * seq_len (input positions, padding included for SFT).
    global_batch = cfg.micro_batch * cfg.accum_steps * world_size
    tokens_per_step = global_batch * cfg.seq_len

    if is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text(json.dumps({**dataclasses.asdict(cfg), "world_size": world_size}, indent=2))
        print(f"model: {cfg.model or 'tiny random Llama'} ({n_params / 1e6:.2f}M params), "
              f"tokenizer: {tok_path or 'byte-level'}, data: {data_desc}")
        print(f"world size {world_size} on {device}, param dtype {cfg.param_dtype}, global batch "
              f"{global_batch} x {cfg.seq_len} = {tokens_per_step:,} tokens/step")
        print(model.memory_plan())
        log_file = open(out_dir / "log.jsonl", "w")

    history: list[dict] = []
    eval_loss = None
    max_norm = cfg.clip if cfg.clip > 0 else math.inf
    model.train()
    bar = tqdm(range(cfg.steps), disable=not is_main, dynamic_ncols=True, desc="train")
    train_time = 0.0  # seconds spent in training steps (evaluation excluded)
    for step in bar:
        lr = lr_at(step, lr=cfg.lr, warmup_steps=cfg.warmup_steps, total_steps=cfg.steps, min_lr_ratio=cfg.min_lr_ratio)
        for group in opt.param_groups:
            group["lr"] = lr

        t0 = time.perf_counter()
        batch = rank_slice(train_data.global_batch(cfg.seed, step, global_batch), rank, world_size)
        loss_sum = torch.zeros((), device=device)
        for micro in micro_batches(batch, cfg.accum_steps):
            out = model(**_to(micro, device), use_cache=False)
            (out.loss / cfg.accum_steps).backward()
            loss_sum += out.loss.detach().float()
        grad_norm = model.clip_grad_norm_(max_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        # Mean loss over all ranks' micro-batches (SUM then divide: gloo has no AVG).
        dist.all_reduce(loss_sum)
        loss = loss_sum.item() / (cfg.accum_steps * world_size)  # .item() also waits for the step
        dt = time.perf_counter() - t0
        train_time += dt

        record = {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": float(grad_norm),
                  "tokens_per_s": tokens_per_step / dt, "elapsed": train_time}
        last = step + 1 == cfg.steps
        if last or (cfg.eval_every > 0 and (step + 1) % cfg.eval_every == 0):
            eval_loss = evaluate(model, held_out, cfg, rank, world_size, device)
            record["eval_loss"] = eval_loss
            if is_main:
                bar.write(f"step {step + 1}: eval loss {eval_loss:.4f}")
        history.append(record)
        if is_main and (last or "eval_loss" in record or (step + 1) % max(1, cfg.log_every) == 0):
            log_file.write(json.dumps(record) + "\n")
            log_file.flush()
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{record['tokens_per_s']:.0f}",
                            mem=f"{memory_mb(device):.0f}MB")
    bar.close()

    # Every rank takes part in the gather; only rank 0 writes.
    full = model.full_state_dict()
    summary = {}
    if is_main:
        log_file.close()
        final_dir = out_dir / "final"
        save_checkpoint(full, hf_model, tok, final_dir)
        plotted = save_plot(history, out_dir / "loss.png")
        steady = history[1:] or history  # step 1 includes one-off warm-up costs
        summary = {
            "first_loss": history[0]["loss"], "last_loss": history[-1]["loss"], "eval_loss": eval_loss,
            "tokens_per_s": sum(h["tokens_per_s"] for h in steady) / len(steady),
            "memory_mb": memory_mb(device), "train_seconds": train_time,
        }
        written = [out_dir / "log.jsonl", final_dir] + ([out_dir / "loss.png"] if plotted else [])
        print(f"loss {summary['first_loss']:.4f} -> {summary['last_loss']:.4f}, held-out loss {eval_loss:.4f}, "
              f"{summary['tokens_per_s']:,.0f} tokens/s, {summary['memory_mb']:.0f} MB (rank 0), "
              f"{train_time:.1f}s training")
        print("wrote " + ", ".join(str(p) for p in written))
    del full
    dist.barrier()
    dist.destroy_process_group()
    return summary


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: gloo can abort at exit after the group is destroyed.
    os._exit(0)
