"""The training loop the recipes share: setup, loop, outputs (the recipes' entry point).

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

The code lives in three modules, each importing the one before: recipes/train_config.py
(:class:`TrainConfig`, its checks, the command line), recipes/train_setup.py (:func:`setup` and the
:class:`Session`) and recipes/train_loop.py (:func:`train_loop`, :func:`write_outputs`, :func:`run`).
This module re-exports what the recipes and the tests use, and ends the process
(:func:`main_or_usage_error`, :func:`exit_now`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch.distributed as dist

from train_config import (BYTE_LEVEL, BYTE_TOKENIZER_FILE, DTYPES, MODEL_SIZES, TrainConfig, check_folders,
                          checkpoint_run, parse_config, resume_problem, saved_extra, tokenizer_path)
from train_loop import (_strict_json, evaluate, loss_sum, memory_mb, run, save_plot, scored_tokens, shutdown,
                        throughput, train_loop, write_outputs, write_tokenizer)
from train_setup import (SETUP_ERRORS, Session, build_model, describe_model, freeze, freeze_problem, frozen_names,
                         init_distributed, load_hf_config, position_warning, preset_config, read_log, schedule_note,
                         setup)

__all__ = [  # (re-exported: `import train` / `from train import ...` keep working)
    "BYTE_LEVEL", "BYTE_TOKENIZER_FILE", "DTYPES", "MODEL_SIZES", "TrainConfig", "check_folders", "checkpoint_run",
    "parse_config", "resume_problem", "saved_extra", "tokenizer_path",
    "SETUP_ERRORS", "Session", "build_model", "describe_model", "freeze", "freeze_problem", "frozen_names",
    "init_distributed", "load_hf_config", "position_warning", "preset_config", "read_log", "schedule_note", "setup",
    "_strict_json", "evaluate", "loss_sum", "memory_mb", "run", "save_plot", "scored_tokens", "shutdown", "throughput",
    "train_loop", "write_outputs", "write_tokenizer",
    "main_or_usage_error", "exit_now",
]


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
