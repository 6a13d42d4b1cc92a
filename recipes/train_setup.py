"""Setting a training run up: the process group, the tokenizer, the data, the model (built,
frozen, sharded) and the optimizer, a resumed run's checkpoint, and the run's header: :func:`setup`
makes the :class:`Session` that recipes/train_loop.py trains.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

import yashard
from data import build_datasets, data_digest, load_tokenizer
from train_config import (DTYPES, MODEL_SIZES, TrainConfig, _saved_config, check_folders, resume_problem, saved_extra,
                          tokenizer_path)

# --------------------------------------------------------------------------------------------
# Process group
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


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------


def preset_config(size: str, tok, seq_len: int):
    """The ``LlamaConfig`` of a ``MODEL_SIZES`` preset, with the tokenizer's vocabulary and ids."""
    from transformers import LlamaConfig

    if size not in MODEL_SIZES:
        raise ValueError(f"unknown model size {size!r}; choose one of {', '.join(MODEL_SIZES)}")
    return LlamaConfig(
        vocab_size=tok.vocab_size, max_position_embeddings=max(256, seq_len), tie_word_embeddings=False,
        bos_token_id=tok.bos_id, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id, **MODEL_SIZES[size],
    )


def load_hf_config(path: str):
    """An HF config from a config.json file or a folder holding one (``--config``)."""
    from transformers import AutoConfig

    p = Path(path)
    if not (p.is_file() or (p / "config.json").is_file()):
        raise FileNotFoundError(f"--config {path}: no such file, and no folder with a config.json; "
                                "pass an HF config.json or the folder that holds it")
    return AutoConfig.from_pretrained(path)


def _check_vocab(hf_config, tok, source: str) -> None:
    text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    if tok.vocab_size > text_config.vocab_size:
        raise ValueError(f"the tokenizer has {tok.vocab_size} ids but {source} has a vocabulary of "
                         f"{text_config.vocab_size}: pass the model's tokenizer with --tokenizer "
                         "(or a config with a larger vocab_size)")


def build_model(cfg: TrainConfig, tok, note=None):
    """The HF model, identical on every rank (yashard also broadcasts rank 0's weights).

    The source is the first of these the config has and sets: ``model`` (a local HF checkpoint
    folder: the model is built on the meta device and :func:`setup` shards it straight from the
    folder's safetensors files, so no rank holds the full model), ``config`` (an HF config.json,
    random init) or ``model_size`` (a ``MODEL_SIZES`` preset, random init); with none, the "tiny"
    preset. The model's vocabulary must cover the tokenizer's ids (checked on the config, before
    any weights are made). A random-init model's special-token ids are the tokenizer's (a ``--config``
    naming others is changed, with a ``note``); ``note`` (print on rank 0) also says when a 16-bit
    ``--model`` folder is trained and exported in fp32.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(cfg.seed)
    if getattr(cfg, "model", None) is not None:
        check_folders(cfg, ("model",))
        hf_config = AutoConfig.from_pretrained(cfg.model)
        _check_vocab(hf_config, tok, f"--model {cfg.model}")
        stored = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        stored = getattr(torch, stored, None) if isinstance(stored, str) else stored
        if note and stored in (torch.bfloat16, torch.float16) and DTYPES[cfg.param_dtype] == torch.float32:
            note(f"note: --model {cfg.model} stores {stored} weights; this run computes in fp32 (--param-dtype fp32) "
                 f"and exports fp32 to final/ (twice the size): pass --param-dtype "
                 f"{'bf16' if stored == torch.bfloat16 else 'fp16'} to keep {stored}")
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    if getattr(cfg, "config", None) is not None:
        hf_config = load_hf_config(cfg.config)
        _check_vocab(hf_config, tok, f"--config {cfg.config}")
        positions = getattr(hf_config, "max_position_embeddings", None)
        if positions is not None and positions < cfg.seq_len:  # random init trains every position (as the presets)
            hf_config.max_position_embeddings = cfg.seq_len
        # the ids the data carries (BOS/EOS around each document, PAD): what the exported config must say
        changed = []
        for key, value in (("bos_token_id", tok.bos_id), ("eos_token_id", tok.eos_id), ("pad_token_id", tok.pad_id)):
            if getattr(hf_config, key, None) != value:
                changed.append(f"{key} {getattr(hf_config, key, None)} -> {value}")
                setattr(hf_config, key, value)
        if changed and note:
            note(f"note: --config {cfg.config}: {', '.join(changed)}, the tokenizer's, which the training data uses "
                 "(final/config.json says so)")
        return AutoModelForCausalLM.from_config(hf_config).float()
    size = getattr(cfg, "model_size", None) or "tiny"
    return AutoModelForCausalLM.from_config(preset_config(size, tok, cfg.seq_len)).float()


def position_warning(hf_config, seq_len: int) -> str | None:
    """The warning for sequences longer than the positions the model was built for, if they are."""
    positions = getattr(hf_config, "max_position_embeddings", None)
    if positions is None or seq_len <= positions:
        return None
    return (f"WARNING: --seq-len {seq_len} is longer than the model's max_position_embeddings {positions}: "
            "positions past it were never trained. Lower --seq-len, or extend the context in the model's config "
            "(rope_scaling) first")


def schedule_note(cfg: TrainConfig) -> str | None:
    """What a run too short for its warmup gets of the schedule (recipes/schedule.py), if not all."""
    if cfg.warmup_steps <= cfg.steps - 2:
        return None
    if cfg.warmup_steps > cfg.steps:
        return (f"note: --steps {cfg.steps} ends inside the --warmup-steps {cfg.warmup_steps} warmup: the learning "
                f"rate never reaches --lr {cfg.lr:g} (it ends at {cfg.lr * cfg.steps / cfg.warmup_steps:g}) and does "
                "not decay; lower --warmup-steps")
    return (f"note: --steps {cfg.steps} leaves no step after the --warmup-steps {cfg.warmup_steps} warmup to decay "
            f"in: the learning rate ends at --lr {cfg.lr:g}, not at --min-lr-ratio x --lr; lower --warmup-steps")


def describe_model(cfg: TrainConfig) -> str:
    if getattr(cfg, "model", None) is not None:
        return cfg.model
    if getattr(cfg, "config", None) is not None:
        return f"random init from {cfg.config}"
    return f"random {getattr(cfg, 'model_size', None) or 'tiny'} Llama"


# --------------------------------------------------------------------------------------------
# Freezing
# --------------------------------------------------------------------------------------------


def _freeze_patterns(patterns: str | None) -> list[str]:
    """The comma-separated --freeze ``patterns``, stripped, empty ones dropped."""
    return [p.strip() for p in (patterns or "").split(",") if p.strip()]


def frozen_names(model) -> list[str]:
    """The names of the model's frozen parameters (tied ones under each name), sorted."""
    return sorted(n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad)


def freeze_problem(cfg: TrainConfig, model, extra: dict | None, ckpt: Path) -> str | None:
    """Why the parameters --freeze froze in ``model`` are not those the checkpoint's run froze (its
    ``extra["frozen"]``; for a checkpoint saved before that was recorded, the names its run's --freeze
    patterns match, from ``extra`` or the run's config.json), with the fix; None if they are, or if
    the checkpoint does not say. Other patterns that freeze the same parameters are fine."""
    if extra is None:
        return None
    saved = extra.get("frozen")
    patterns = extra["freeze"] if "freeze" in extra else _saved_config(Path(cfg.out_dir)).get("freeze", ...)
    if saved is None:
        if patterns is ...:
            return None
        wanted = _freeze_patterns(patterns)
        saved = sorted(n for n, _ in model.named_parameters(remove_duplicate=False) if any(w in n for w in wanted))
    now = frozen_names(model)
    if saved == now:
        return None

    def some(names: list[str]) -> str:
        return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")

    newly, thawed = sorted(set(now) - set(saved)), sorted(set(saved) - set(now))
    differs = " and ".join(part for part in (
        f"freezes {some(newly)}, which that run trained" if newly else "",
        f"trains {some(thawed)}, which that run froze" if thawed else "") if part)
    keep = ("leave --freeze out" if not saved else f"pass --freeze {patterns}" if isinstance(patterns, str) and patterns
            else "pass --freeze patterns that freeze those")
    this_run = f"--freeze {cfg.freeze}" if cfg.freeze else "this run (no --freeze)"
    return (f"{this_run} does not freeze what the run that saved the checkpoint in {ckpt} froze: it {differs}. "
            "The optimizer's parameter groups and state are those of the parameters that run trained. "
            f"To continue it, {keep}; to train other parameters from its weights, start a new run from its export "
            "(--model <out-dir>/final, another --out-dir)")


def freeze(model, patterns: str | None) -> int:
    """Freeze (``requires_grad_(False)``) every parameter whose name contains one of the
    comma-separated ``patterns`` (``--freeze``); returns how many elements that froze. A pattern
    that matches nothing, or patterns that leave nothing to train, raise ValueError."""
    if not patterns:
        return 0
    wanted = _freeze_patterns(patterns)
    named = list(model.named_parameters(remove_duplicate=False))  # (a tied lm_head.weight under its name too)
    for pattern in wanted:
        if not any(pattern in name for name, _ in named):
            raise ValueError(f"--freeze {patterns}: {pattern!r} is in no parameter name of the model (they look like "
                             f"{named[0][0]}, {named[-1][0]}); pass parts of those names, comma-separated")
    frozen = {}
    for name, p in named:
        if any(pattern in name for pattern in wanted):
            p.requires_grad_(False)
            frozen[id(p)] = p.numel()
    if all(not p.requires_grad for _, p in named):
        raise ValueError(f"--freeze {patterns} freezes every parameter of the model: nothing would train")
    return sum(frozen.values())


# --------------------------------------------------------------------------------------------
# A resumed run's log
# --------------------------------------------------------------------------------------------


def read_log(path: Path) -> list[dict]:
    """The records of a log.jsonl file, in order."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _truncate_log(path: Path, step: int) -> None:
    """Drop log records after ``step`` (a run that died after its last checkpoint logged more)."""
    if path.exists():
        kept = [r for r in read_log(path) if r["step"] <= step]
        path.write_text("".join(json.dumps(r) + "\n" for r in kept))


# --------------------------------------------------------------------------------------------
# Session
# --------------------------------------------------------------------------------------------


@dataclass
class Session:
    """Everything the loop needs, made once by :func:`setup`."""

    cfg: TrainConfig
    rank: int
    world_size: int
    device: torch.device
    tok: object
    train_data: object
    held_out: object
    hf_model: torch.nn.Module
    model: yashard.ShardedModel
    opt: torch.optim.Optimizer
    scaler: yashard.ShardedGradScaler   # enabled with --param-dtype fp16, else a no-op
    out_dir: Path
    global_batch: int
    tokens_per_step: int
    start_step: int = 0
    frozen: list[str] = field(default_factory=list)  # names of the parameters --freeze froze (saved with checkpoints)
    run_id: str | None = None  # this run's id (config.json, checkpoints): see setup
    data_digest: str | None = None  # of the training and held-out data (checkpoints: a resume compares it)
    first_loss: float | None = None  # a resumed run's: its step-1 loss (for the summary), and
    elapsed: float = 0.0             # the training seconds until its checkpoint (from the checkpoint)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


# What setup raises for what a run was given (folders, data, a checkpoint): a usage error
SETUP_ERRORS = (ValueError, FileNotFoundError, yashard.CheckpointError)


def setup(cfg: TrainConfig) -> Session:
    """Process group, tokenizer, data, model, sharding and optimizer; prints the run's header.
    Its ``SETUP_ERRORS`` are marked ``before_training`` (:func:`main_or_usage_error`)."""
    try:
        return _setup(cfg)
    except SETUP_ERRORS as e:
        e.before_training = True
        raise


def qlora_model(cfg: TrainConfig, hf_model, model_path: str | None, device: torch.device, is_main: bool):
    """``--qlora``: the model loaded as a bitsandbytes NF4 base (double quantisation, computing in
    ``--param-dtype``), its other weights in fp32 (peft's ``prepare_model_for_kbit_training``), and
    LoRA r=16 on every linear layer. The embedded default model is saved to ``out_dir/base`` first
    and loaded from there."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    folder = model_path
    if folder is None:
        folder = str(Path(cfg.out_dir) / "base")
        if is_main:
            hf_model.save_pretrained(folder)
        dist.barrier()
    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=DTYPES[cfg.param_dtype])
    base = AutoModelForCausalLM.from_pretrained(folder, quantization_config=bnb, dtype=torch.float32,
                                                device_map={"": device})
    base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)  # (--checkpoint-layers does)
    for m in base.modules():  # bitsandbytes 0.50 repacks a CPU layer's weights for no-grad evaluation, which
        if hasattr(m, "support_avx512bf16_for_cpu"):  # needs rows of whole 64-blocks: the tiny preset's 352 is not
            m.support_avx512bf16_for_cpu = False
    torch.manual_seed(cfg.seed)
    return get_peft_model(base, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear"))


def _setup(cfg: TrainConfig) -> Session:
    rank, world_size, device = init_distributed()
    is_main = rank == 0
    if not is_main:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()  # one copy of HF warnings, from rank 0

    check_folders(cfg)  # before the tokenizer, the data and the model are made
    model_path = getattr(cfg, "model", None)
    tok_path = tokenizer_path(cfg.tokenizer, model_path)
    tok = load_tokenizer(tok_path)
    train_data, held_out, data_desc = build_datasets(cfg.data, tok, cfg.seq_len, cfg.eval_fraction, cfg.max_bytes)
    # every rank must draw its rows from the same text (the default one is the interpreter's own
    # standard library, which differs between Python releases and builds, i.e. between machines)
    digest = data_digest(train_data, held_out)
    digests = [None] * world_size
    dist.all_gather_object(digests, digest)
    if any(d != digests[0] for d in digests):
        other = next(r for r, d in enumerate(digests) if d != digests[0])
        raise ValueError(f"rank {other} read other training data than rank 0 (data digest {digests[other]} against "
                         f"{digests[0]}; {data_desc} on rank {rank}): every rank takes its rows of one global batch, so "
                         "they must read the same text. Give every machine the same --data file (the default text, "
                         "the Python standard library, differs between Python releases and builds)")

    hf_model = build_model(cfg, tok, note=print if is_main else None)
    if getattr(cfg, "qlora", False):  # (finetune.py --qlora)
        hf_model = qlora_model(cfg, hf_model, model_path, device, is_main)
        model_path = None  # (loaded, quantised: shard() reads the live 4-bit weights)
    n_params = sum(p.numel() for p in hf_model.parameters())
    n_frozen = freeze(hf_model, cfg.freeze)
    frozen_params = frozen_names(hf_model)  # (before sharding: the names the checkpoint records)
    if cfg.resume:  # the parameters the checkpoint's run trained, before anything is sharded
        problem = freeze_problem(cfg, hf_model, saved_extra(Path(cfg.out_dir) / "checkpoint"),
                                 Path(cfg.out_dir) / "checkpoint")
        if problem:
            raise ValueError(problem)
    warning = position_warning(hf_model.config, cfg.seq_len)   # --model: its weights never saw those positions
    if is_main and warning:
        print(warning)
    if is_main and getattr(cfg, "config", None) is not None and model_path is None:
        given = getattr(load_hf_config(cfg.config), "max_position_embeddings", None)
        if given is not None and given < cfg.seq_len:
            print(f"note: max_position_embeddings raised from {given} (--config) to --seq-len {cfg.seq_len}, "
                  "the positions this random-init run trains (the exported config says so)")
    model = yashard.shard(hf_model, weights=model_path, config=yashard.ShardConfig(
        param_dtype=DTYPES[cfg.param_dtype], reduce_dtype=torch.float32,
        checkpoint_layers=cfg.checkpoint_layers, reshard_after_forward=cfg.reshard_after_forward))
    if cfg.compile:
        for layer in model.model.layers:  # (compiled on first use; every layer shares the graphs)
            layer.compile()
    # fused: one kernel per flat shard and no temporaries (single-tensor AdamW, torch's default on
    # CPU, makes two shard-sized ones and ran 6-9x slower on a 60 MiB shard; docs/benchmarks.md)
    opt = torch.optim.AdamW(model.param_groups(weight_decay=cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.95),
                            fused=True)
    # fp16 gradients underflow without loss scaling; the sharded scaler skips a step on every rank alike
    scaler = yashard.ShardedGradScaler(model, enabled=cfg.param_dtype == "fp16")

    # Each optimizer step consumes one global batch of micro_batch * accum_steps * world_size
    # sequences; this rank takes micro_batch * accum_steps of them, in accum_steps micro-batches.
    # Tokens per step = global batch * seq_len (input positions, padding included for SFT).
    global_batch = cfg.micro_batch * cfg.accum_steps * world_size
    tokens_per_step = global_batch * cfg.seq_len

    # Resume: the sharded checkpoint holds the master shards, the optimizer state and the step it
    # was saved after (at any world size). Nothing else is needed: the loop starts at start_step,
    # batches and learning rates are pure functions of (seed, step).
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)  # every rank: profiling writes one trace per rank
    start_step = 0
    first_loss, elapsed = None, 0.0  # (of a resumed run: what its checkpoint recorded)
    ckpt = out_dir / "checkpoint"
    # The run's id, in config.json and in every checkpoint it saves: a resume refuses a checkpoint
    # left by an earlier run in the same --out-dir (resume_problem). A resumed run keeps its id.
    run_id = [uuid.uuid4().hex if is_main else None]
    dist.broadcast_object_list(run_id, src=0)
    run_id = run_id[0]
    if cfg.resume and (ckpt / "LATEST").exists():
        wanted = [group["weight_decay"] for group in opt.param_groups]  # --weight-decay (no-decay group: 0)
        extra = yashard.load_checkpoint(ckpt, model, opt)  # also restores the saved param-group hyperparameters
        start_step = extra["step"]
        run_id = saved_extra(ckpt)["run"]
        first_loss, elapsed = extra.get("first_loss"), float(extra.get("elapsed", 0.0))
        if is_main and extra.get("data") not in (None, digest):
            print(f"WARNING: the checkpoint's run trained on other data (digest {extra['data']}; this run's "
                  f"{digest}: {data_desc}): the resumed run's batches are not the ones the uninterrupted run "
                  "would have drawn (the default text, the Python standard library, differs between Python "
                  "releases and builds)")
        # (validate checked the index already; a checkpoint saved before runs had ids: its derived id)
        problem = resume_problem(cfg, {**extra, "run": run_id}, ckpt)
        if problem:
            raise ValueError(problem)
        # The command line's weight decay applies from here on (lr is set every step by the schedule).
        saved_wd = [group["weight_decay"] for group in opt.param_groups]
        for group, wd in zip(opt.param_groups, wanted):
            group["weight_decay"] = wd
        if scaler.is_enabled() and "grad_scaler" in extra:
            scaler.load_state_dict(extra["grad_scaler"])
        if is_main:
            print(f"resumed from {ckpt} after step {start_step}")
            if saved_wd != wanted:
                print(f"note: --weight-decay {cfg.weight_decay} applies from step {start_step + 1} on; the checkpoint "
                      f"was trained with {saved_wd[0]} (norms and biases: no decay)")
            _truncate_log(out_dir / "log.jsonl", start_step)
            saved = extra.get("global_batch")
            if saved is not None and saved != global_batch:
                print(f"WARNING: the checkpoint was trained with a global batch of {saved} sequences, this run uses "
                      f"{global_batch} (--micro-batch {cfg.micro_batch} per rank x --accum-steps {cfg.accum_steps} x "
                      f"world size {world_size}): the batches, the held-out batches (eval_loss) and the loss curve differ "
                      "from the uninterrupted run. "
                      + (f"Choose --micro-batch and --accum-steps so that their product times the world size is {saved} "
                         "to keep it" if saved % world_size == 0 else
                         f"A world size that divides {saved} keeps it (at {world_size}, none does)"))
    elif cfg.resume and is_main:
        print(f"--resume: no checkpoint in {ckpt} yet, starting at step 0")
    elif is_main and (ckpt / "LATEST").exists():
        saves = cfg.save_every > 0 or cfg.stop_at is not None
        print(f"WARNING: {ckpt} holds a checkpoint and this run starts at step 0 without --resume true: its log.jsonl "
              "is rewritten now and its checkpoint " + ("replaced at the first save" if saves else
                                                        "kept, though this run saves none (--save-every 0), and no "
                                                        "longer resumable (it belongs to the earlier run)")
              + ". Pass --resume true to continue it, or another --out-dir")
    if is_main:
        (out_dir / "config.json").write_text(json.dumps({**dataclasses.asdict(cfg), "world_size": world_size,
                                                         "run": run_id}, indent=2))
        schedule = schedule_note(cfg)
        if schedule:
            print(schedule)
        frozen = f", {n_frozen / 1e6:.2f}M of them frozen" if n_frozen else ""
        print(f"model: {describe_model(cfg)} ({n_params / 1e6:.2f}M params{frozen}), "
              f"tokenizer: {tok_path or 'byte-level'}, data: {data_desc}")
        print(f"world size {world_size} on {device}, param dtype {cfg.param_dtype}, global batch "
              f"{global_batch} x {cfg.seq_len} = {tokens_per_step:,} tokens/step")
        print(model.memory_plan())
    return Session(cfg, rank, world_size, device, tok, train_data, held_out, hf_model, model, opt, scaler,
                   out_dir, global_batch, tokens_per_step, start_step, frozen_params, run_id, digest, first_loss,
                   elapsed)
