"""The training loop the recipes share: setup, loop, outputs.

recipes/finetune.py, recipes/pretrain.py and recipes/profiling.py are each a config dataclass
(a subclass of :class:`TrainConfig`), command-line overrides (:func:`parse_config`) and a call
into this module:

    session = setup(cfg)            # process group, tokenizer, data, model, yashard.shard, AdamW
    history = train_loop(session)   # steps session.start_step .. cfg.steps-1, eval, log.jsonl
    write_outputs(session, history) # final/ (HF checkpoint folder), loss.png, summary line
    shutdown()

Every batch is a pure function of (seed, step) (recipes/data.py) and so is the learning rate
(recipes/schedule.py): a run that starts at step k trains exactly as an uninterrupted run does
from step k on, given the same weights and optimizer state.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import socket
import sys
import time
import typing
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import record_function
from tqdm import tqdm

import yashard
from data import EVAL_STREAM, IGNORE_INDEX, build_datasets, data_digest, load_tokenizer, micro_batches, rank_slice
from schedule import lr_at

BYTE_LEVEL = "byte-level"  # --tokenizer byte-level: recipes/data.py's ByteTokenizer
# What a byte-level run writes into its final/ folder, so that --model <that folder> trains on bytes again
BYTE_TOKENIZER_FILE = "byte_tokenizer.json"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # fp16: with loss scaling

# Llama shapes for random-init models (--model-size). Parameter counts with the 259-id byte
# tokenizer; a real tokenizer adds 2 * vocab * hidden (untied embedding and lm_head).
MODEL_SIZES = {
    "tiny": dict(hidden_size=128, intermediate_size=352, num_hidden_layers=4,  # 0.8M: CPU
                 num_attention_heads=4, num_key_value_heads=2),
    "small": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=8,  # 6M: CPU, slow
                  num_attention_heads=8, num_key_value_heads=4),
    "base": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,  # 76M: GPU
                 num_attention_heads=12, num_key_value_heads=4),
}


@dataclass
class TrainConfig:
    """Options every recipe shares; each recipe subclasses it to add its model source and defaults."""

    tokenizer: str | None = field(default=None, metadata={"help": "local HF tokenizer folder, or byte-level (default: the model folder's, else byte-level)"})
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
    param_dtype: str = field(default="fp32", metadata={"help": "compute dtype (fp16: with dynamic loss scaling)", "choices": tuple(DTYPES)})
    checkpoint_layers: int = field(default=0, metadata={"help": "decoder layers with activation checkpointing"})
    compile: bool = field(default=False, metadata={"help": "torch.compile each decoder layer (inductor; on CPU it needs a C++ compiler); yashard's hooks run eagerly between the compiled layers"})
    freeze: str | None = field(default=None, metadata={"help": "freeze the parameters whose names contain one of these "
                                                           "comma-separated strings, before sharding (e.g. embed_tokens,layers.0.)"})
    reshard_after_forward: bool = field(default=True, metadata={"help": "false: every unit keeps its own buffers (the model's size per rank), gathered once per step; accumulation reduces once per step (no_sync)"})
    eval_every: int = field(default=10, metadata={"help": "eval every N steps (<= 0: only at the end)"})
    eval_batches: int = field(default=4, metadata={"help": "held-out batches per eval, each of a training step's global batch of "
                                                         "sequences"})
    seed: int = field(default=0, metadata={"help": "seed for model init and batch sampling"})
    out_dir: str = field(default="runs/train", metadata={"help": "where logs, plot and checkpoint go"})
    log_every: int = field(default=1, metadata={"help": "write a log line / refresh the bar every N steps (>= 1)"})
    save_every: int = field(default=10, metadata={"help": "sharded checkpoint (for --resume) every N steps and at the end (<= 0: only at --stop-at)"})
    resume: bool = field(default=False, metadata={"help": "continue from the sharded checkpoint in out_dir/checkpoint, at any world size"})
    stop_at: int | None = field(default=None, metadata={"help": "stop after this step (saving a checkpoint), e.g. to split a run over job allocations; --resume continues"})

    def validate(self) -> None:
        """Raise ValueError naming the bad option(s) and the fix."""
        if self.steps < 1 or self.micro_batch < 1 or self.accum_steps < 1 or self.seq_len < 2:
            raise ValueError("steps, micro_batch and accum_steps must be >= 1 and seq_len >= 2")
        chosen = [f"--{name.replace('_', '-')} {getattr(self, name)}"
                  for name in ("model", "config", "model_size") if getattr(self, name, None) is not None]
        if len(chosen) > 1:
            raise ValueError(f"{' and '.join(chosen)} each choose the model: pass only one of them")
        if Path(self.out_dir).exists() and not Path(self.out_dir).is_dir():
            raise ValueError(f"--out-dir {self.out_dir} is a file: pass a directory (created if missing) for the "
                             "logs, plot, checkpoint and final model")
        if self.stop_at is not None and not 1 <= self.stop_at <= self.steps:
            raise ValueError(f"--stop-at {self.stop_at} must be between 1 and --steps {self.steps}")
        problem = _value_problem(self) or _checkpoint_layers_problem(self)
        if problem:
            raise ValueError(problem)
        if self.data is not None:
            if os.path.isdir(self.data):
                raise ValueError(f"--data {self.data} is a folder: pass one .txt file (plain language modelling) or "
                                 "one .jsonl file of {\"prompt\", \"response\"} lines (SFT)")
            if not self.data.endswith((".txt", ".jsonl")):
                raise ValueError(f"--data {self.data}: unsupported file type; pass a .txt file (plain language "
                                 "modelling) or a .jsonl file of {\"prompt\", \"response\"} lines (SFT)")
            if not os.path.isfile(self.data):
                raise ValueError(f"--data {self.data}: no such file")
        if self.resume:  # the checkpoint's step, read from its index (load_checkpoint checks it all later)
            ckpt = Path(self.out_dir) / "checkpoint"
            problem = resume_problem(self, saved_extra(ckpt), ckpt)
            if problem:
                raise ValueError(problem)


def _value_problem(cfg: TrainConfig) -> str | None:
    """What is wrong with a numeric option's value, with the fix; None if every one is in range."""
    def bad(x: float, ok: bool) -> bool:
        return not (math.isfinite(x) and ok)

    if bad(cfg.lr, cfg.lr > 0):
        return f"--lr {cfg.lr} must be a number > 0: the peak learning rate (e.g. 2e-3)"
    if cfg.warmup_steps < 0:
        return f"--warmup-steps {cfg.warmup_steps} must be >= 0 (0: no warmup)"
    if bad(cfg.min_lr_ratio, 0 <= cfg.min_lr_ratio <= 1):
        return (f"--min-lr-ratio {cfg.min_lr_ratio} must be between 0 and 1: the cosine schedule decays the learning "
                "rate from --lr to --min-lr-ratio x --lr (0: down to zero, 1: constant after warmup)")
    if bad(cfg.clip, True):
        return f"--clip {cfg.clip} must be a finite number: the global gradient norm to clip to (<= 0: no clipping)"
    if bad(cfg.weight_decay, cfg.weight_decay >= 0):
        return f"--weight-decay {cfg.weight_decay} must be a number >= 0 (0: no weight decay)"
    if cfg.log_every < 1:
        return f"--log-every {cfg.log_every} must be >= 1: a log line (and progress-bar refresh) every N steps"
    if cfg.eval_batches < 1:
        return (f"--eval-batches {cfg.eval_batches} must be >= 1: every run ends with an evaluation on that many "
                "held-out batches (--eval-every <= 0 leaves out only the evaluations before the end)")
    if cfg.max_bytes < 1:
        return (f"--max-bytes {cfg.max_bytes} must be >= 1: the number of bytes of text read from --data (.txt) or "
                "the standard library sources; leave it out for the default (4,000,000)")
    if bad(cfg.eval_fraction, 0 < cfg.eval_fraction < 1):
        return (f"--eval-fraction {cfg.eval_fraction} must be between 0 and 1 (both excluded): the fraction of the "
                "data held out for evaluation, e.g. 0.05")
    return None


def _layer_count(cfg: TrainConfig) -> tuple[int, str] | None:
    """The chosen model's number of decoder layers and where it comes from, read from its
    config.json or preset before anything is built; None when that cannot be told here (the
    loaders say what is wrong with a folder)."""
    for flag in ("model", "config"):
        path = getattr(cfg, flag, None)
        if path is None:
            continue
        p = Path(path)
        file = p if p.is_file() else p / "config.json"
        try:
            layers = json.loads(file.read_text(encoding="utf-8")).get("num_hidden_layers")
        except (OSError, ValueError, AttributeError):
            return None
        return (layers, f"--{flag} {path}") if isinstance(layers, int) else None
    size = getattr(cfg, "model_size", None) or "tiny"
    if size not in MODEL_SIZES:
        return None
    return MODEL_SIZES[size]["num_hidden_layers"], f"the {size} preset"


def _checkpoint_layers_problem(cfg: TrainConfig) -> str | None:
    """Why ``--checkpoint-layers`` cannot apply to the chosen model, with the fix; None if it can."""
    n = cfg.checkpoint_layers
    if n < 0:
        return f"--checkpoint-layers {n} must be >= 0: the number of decoder layers, from the first, to recompute"
    found = _layer_count(cfg) if n else None
    if found is not None and n > found[0]:
        layers, source = found
        return (f"--checkpoint-layers {n} but {source} has {layers} decoder layers: pass at most {layers} "
                f"(--checkpoint-layers {layers} recomputes every layer)")
    return None


def saved_extra(ckpt: Path) -> dict | None:
    """What the run saved with the checkpoint in ``ckpt`` (its step, global batch, --freeze), from its
    index; None when there is none (or it cannot be read: :func:`yashard.load_checkpoint` then says
    what is wrong with it)."""
    if not (ckpt / "LATEST").exists():
        return None
    try:
        from yashard.checkpoint import read_index, resolve_checkpoint

        save = resolve_checkpoint(ckpt)
        index = read_index(save)
        extra = index["extra"]
        int(extra["step"])
        return {**extra, "run": checkpoint_run(extra, index.get("save") or save.name)}
    except Exception:  # noqa: BLE001 - checked again, with load_checkpoint's errors, when the run loads it
        return None


def checkpoint_run(extra: dict, save_name: str) -> str:
    """The id of the run that saved a checkpoint: its ``extra["run"]``, or for one saved before runs
    had ids, one derived from its save's name (a resumed run keeps it, so its next resume matches)."""
    return extra.get("run") or f"legacy-{save_name}"


def resume_problem(cfg: TrainConfig, extra: dict | None, ckpt: Path) -> str | None:
    """Why ``cfg`` cannot resume from the checkpoint whose ``extra`` (see :func:`saved_extra`) is
    given, with the fix; None if it can. (What --freeze froze is compared once the model is built:
    :func:`freeze_problem`.)"""
    if extra is None:
        return None
    step = int(extra["step"])
    logged = _saved_config(Path(cfg.out_dir)).get("run")  # (None: written before runs had ids)
    if logged is not None and extra.get("run") != logged:
        return (f"the checkpoint in {ckpt} (step {step}) belongs to an earlier run than the log.jsonl and config.json "
                f"in {cfg.out_dir}: a later run started over at step 0 there without --resume and saved no checkpoint, "
                "so resuming would continue the earlier run's weights under the later run's log. Leave out --resume "
                "true to start a new run (its first save replaces that checkpoint), or pass another --out-dir")
    if cfg.steps < step:
        before = _saved_steps(Path(cfg.out_dir))
        return (f"--steps {cfg.steps} is below step {step}, where the checkpoint in {ckpt} was saved, so --resume true "
                f"has nothing to train: pass --steps {before if before and before >= step else f'>= {step}'} to "
                f"continue the run (the --steps it was started with keeps its learning-rate schedule), or leave out "
                "--resume true (or pass another --out-dir) to start a new run")
    if cfg.stop_at is not None and cfg.stop_at <= step:
        more = (f"pass a --stop-at between {step + 1} and --steps {cfg.steps}, or leave --stop-at out to train to "
                f"--steps {cfg.steps}" if step < cfg.steps else "leave --stop-at out: the run is complete")
        return (f"--stop-at {cfg.stop_at} is at or before step {step}, where the checkpoint in {ckpt} was saved: a "
                f"resumed run starts after step {step}; {more}")
    return None


def _saved_steps(out_dir: Path) -> int | None:
    """--steps of the run that last wrote ``out_dir/config.json``, if it says."""
    steps = _saved_config(out_dir).get("steps")
    return steps if isinstance(steps, int) else None


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


def _saved_config(out_dir: Path) -> dict:
    """The run configuration last written to ``out_dir/config.json`` ({} if none can be read)."""
    try:
        saved = json.loads((out_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return saved if isinstance(saved, dict) else {}


# --------------------------------------------------------------------------------------------
# Command line: one --flag per config field
# --------------------------------------------------------------------------------------------


def _parse_bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {s!r}")


def parse_config(cls: type, argv: list[str] | None = None, description: str | None = None):
    """An instance of the config dataclass ``cls`` from the command line.

    Every field becomes ``--field-name`` (``--field_name`` also works) with the field's default,
    type (``X | None`` parses as X) and ``metadata["help"]`` / ``metadata["choices"]``; the
    recipe's own fields are listed first. Invalid combinations (``cls.validate``) exit with a
    usage error, as argparse does.
    """
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    hints = typing.get_type_hints(cls)
    shared = {f.name for f in dataclasses.fields(TrainConfig)}
    fields = dataclasses.fields(cls)
    for f in [f for f in fields if f.name not in shared] + [f for f in fields if f.name in shared]:
        tp = hints[f.name]
        args = [t for t in typing.get_args(tp) if t is not type(None)]
        if args:  # Optional[X] / X | None
            tp = args[0]
        text = f.metadata.get("help", "")
        if "default" not in text:
            text += f" (default: {f.default})"
        kwargs = dict(default=f.default, help=text, type=_parse_bool if tp is bool else tp)
        if "choices" in f.metadata:
            kwargs["choices"] = f.metadata["choices"]
        names = dict.fromkeys([f"--{f.name.replace('_', '-')}", f"--{f.name}"])  # one name if no "_"
        parser.add_argument(*names, dest=f.name, **kwargs)
    cfg = cls(**vars(parser.parse_args(argv)))
    try:
        cfg.validate()
    except ValueError as e:
        parser.error(str(e))
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


def check_folders(cfg: TrainConfig, which: tuple[str, ...] = ("model", "tokenizer")) -> None:
    """Raise FileNotFoundError / ValueError, naming the option and the fix, if ``--model`` or
    ``--tokenizer`` is not a local folder, or ``--model`` is a folder that is not an HF model folder (a
    run's --out-dir or its sharded checkpoint: the message says to use --resume). Reads no weights."""
    for what in which:
        flag, path = f"--{what}", getattr(cfg, what, None)
        if path is None or (what == "tokenizer" and path == BYTE_LEVEL):
            continue
        problem = _folder_problem(flag, path, what)
        if problem and not Path(path).exists():
            raise FileNotFoundError(problem)
        if problem:
            raise ValueError(problem)


def _folder_problem(flag: str, path: str, what: str) -> str | None:
    """Why ``path`` is not a local HF ``what`` ("model" or "tokenizer") folder, with the fix; None if it
    may be one (the loaders say what else is wrong)."""
    p = Path(path)
    expected = ("a local HF checkpoint folder (config.json and *.safetensors weights, e.g. a recipe run's "
                "final/ folder)" if what == "model" else
                "a local HF tokenizer folder (tokenizer.json or tokenizer_config.json, e.g. the model's folder)")
    if not p.exists():
        return (f"{flag} {path}: no such folder. {flag} takes {expected}; nothing is downloaded from the HF Hub "
                f"by name: download the {what} into a folder first and pass that folder")
    if not p.is_dir():
        return f"{flag} {path} is a file: pass {expected}"
    if what == "tokenizer":
        if _has_tokenizer_files(path) or (p / BYTE_TOKENIZER_FILE).is_file():
            return None
        return (f"{flag} {path} holds no tokenizer (no tokenizer.json, tokenizer_config.json or tokenizer.model): "
                f"pass {expected}, or leave {flag} out for the model folder's tokenizer or the byte-level default")
    hint = ""
    run_dir = _recipe_run_dir(p)
    if run_dir is not None:  # a run's --out-dir, its checkpoint/ or one save-* folder in it
        final = run_dir / "final"
        hint = (f" It {'holds' if run_dir == p else 'is'} the yashard training checkpoint of the run with --out-dir "
                f"{run_dir}: to continue that run, pass --out-dir {run_dir} --resume true (with the rest of its command "
                f"line); to start a new run from its weights, pass --model {final}"
                + ("" if (final / "config.json").is_file() else " (the HF folder that run writes when it ends)"))
    config = p / "config.json"
    if not config.is_file():
        return f"{flag} {path} has no config.json, so it is not an HF model folder: pass {expected}.{hint}"
    try:
        keys = json.loads(config.read_text(encoding="utf-8"))
        keys = set(keys) if isinstance(keys, dict) else set()
    except (OSError, ValueError):
        return None  # AutoConfig says what is wrong with it
    if "model_type" not in keys and (run_dir is not None or {"out_dir", "world_size", "steps"} <= keys):
        final = p / "final"
        if not hint and (final / "config.json").is_file():
            hint = f" It is a recipe's --out-dir: its HF export is {final}."
        return (f"{flag} {path} is not an HF model folder: its config.json is a recipe's run configuration, not an "
                f"HF model config (it has no model_type). Pass {expected}.{hint}")
    return None


def _recipe_run_dir(p: Path) -> Path | None:
    """The --out-dir of the recipe run whose checkpoint ``p`` is (or is in), or None."""
    for run_dir, ckpt in ((p, p / "checkpoint"), (p.parent, p), (p.parent.parent, p.parent)):
        if (ckpt / "LATEST").is_file() or (ckpt == p.parent and (p / "index.json").is_file()):
            return run_dir
    if (p / "log.jsonl").is_file() and (p / "config.json").is_file() and (p / "checkpoint").is_dir():
        return p
    return None


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


def _strict_json(record: dict) -> dict:
    """``record`` with every NaN/inf number as None: JSON has no such numbers (``json.dumps`` would write
    ``NaN``, which strict parsers refuse)."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}


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


def _has_tokenizer_files(path: str) -> bool:
    return any((Path(path) / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def tokenizer_path(tokenizer: str | None, model: str | None) -> str | None:
    """The tokenizer a run uses (None: byte-level): ``--tokenizer``; else the ``--model`` folder's own
    (HF tokenizer files, or the byte-level marker a byte-level recipe run writes into its final/);
    else, without ``--model``, byte-level. A ``--model`` folder with neither is refused: its ids mean
    some tokenizer's tokens, and training it on bytes would be silently wrong."""
    if tokenizer is not None:
        return None if tokenizer == BYTE_LEVEL or (Path(tokenizer) / BYTE_TOKENIZER_FILE).is_file() else tokenizer
    if model is None or (Path(model) / BYTE_TOKENIZER_FILE).is_file():
        return None
    if _has_tokenizer_files(model):
        return model
    raise ValueError(f"--model {model} holds no tokenizer (no tokenizer.json, tokenizer_config.json or tokenizer.model): "
                     "its token ids belong to the tokenizer it was trained with. Pass that tokenizer's folder with "
                     f"--tokenizer, or --tokenizer {BYTE_LEVEL} if the model was trained on the recipes' byte-level "
                     "tokenizer (the final/ folder of a byte-level recipe run says so itself from this version on)")


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


def read_log(path: Path) -> list[dict]:
    """The records of a log.jsonl file, in order."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


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


def _truncate_log(path: Path, step: int) -> None:
    """Drop log records after ``step`` (a run that died after its last checkpoint logged more)."""
    if path.exists():
        kept = [r for r in read_log(path) if r["step"] <= step]
        path.write_text("".join(json.dumps(r) + "\n" for r in kept))


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


def main_or_usage_error(main) -> None:
    """Run a recipe's ``main``; an error in what the run was given (a folder, a data file, a
    checkpoint to resume: ``ValueError``, ``FileNotFoundError``, ``yashard.CheckpointError``, raised
    before training starts) ends the process with a usage error (its message on stderr, exit code
    2) instead of a traceback. Every rank that fails prints it (others' prefixed "[rank N]"): a rank
    that left it to rank 0 would exit first, and torchrun stops the others, rank 0 included, before
    it printed. Then :func:`exit_now`."""
    try:
        main()
    except SETUP_ERRORS as e:
        if getattr(e, "before_training", False):
            rank = dist.get_rank() if dist.is_initialized() else 0
            print(f"{f'[rank {rank}] ' if rank else ''}{Path(sys.argv[0]).name}: error: {e}", file=sys.stderr)
            exit_now(2)
        raise
    exit_now()


def exit_now(code: int = 0) -> None:
    """End the process without interpreter teardown (gloo can abort at exit after destroy)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    print(f"{Path(sys.argv[0]).name} is the training loop the recipes share, not a recipe: run recipes/finetune.py "
          "or recipes/pretrain.py (--help lists their options)", file=sys.stderr)
    sys.exit(2)
