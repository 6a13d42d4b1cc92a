"""The training recipes' configuration: :class:`TrainConfig`, the checks on its values, and the
command line (:func:`parse_config`).

The checks here need no process group and build nothing: option values (:func:`_value_problem`),
``--checkpoint-layers`` against the chosen model's config, a ``--resume`` against the checkpoint's
index (:func:`resume_problem`), and ``--model`` / ``--tokenizer`` against their folders
(:func:`check_folders`, :func:`tokenizer_path`). recipes/train_setup.py builds the run from a
config, recipes/train_loop.py trains it; recipes/train.py is the entry point the recipes import.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path

import torch

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


def _saved_config(out_dir: Path) -> dict:
    """The run configuration last written to ``out_dir/config.json`` ({} if none can be read)."""
    try:
        saved = json.loads((out_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return saved if isinstance(saved, dict) else {}


# --------------------------------------------------------------------------------------------
# --model and --tokenizer folders
# --------------------------------------------------------------------------------------------


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
        if tp is bool:  # (a bare --flag is true)
            kwargs.update(nargs="?", const=True)
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
