"""Pretrain a decoder from random init with yashard: plain language modelling on text.

    torchrun --nproc_per_node 2 recipes/pretrain.py                      # tiny Llama, stdlib sources
    torchrun --nproc_per_node 2 recipes/pretrain.py --model-size small --steps 200
    torchrun --nproc_per_node 8 recipes/pretrain.py --config my_llama/config.json \\
        --tokenizer TOKENIZER_PATH --data corpus.txt --param-dtype bf16

The model is a ``--model-size`` preset (tiny, small, base: Llama shapes in recipes/train_config.py) or
any HF decoder config.json (``--config``), initialised at random with ``--seed``. The text is
Python standard library sources by default, or a .txt file (``--data``), cut into random windows
of ``--seq-len`` tokens. Writes log.jsonl, loss.png (when matplotlib is installed) and an HF
checkpoint folder final/ under --out-dir. The loop lives in recipes/train_loop.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import train
from train import MODEL_SIZES, TrainConfig


@dataclass
class PretrainConfig(TrainConfig):
    model_size: str | None = field(default=None, metadata={
        "help": "random-init Llama preset (default: tiny unless --config is given)", "choices": tuple(MODEL_SIZES)})
    config: str | None = field(default=None, metadata={"help": "HF config.json (or its folder) to initialise at random"})
    steps: int = field(default=100, metadata={"help": "optimizer steps"})
    eval_every: int = field(default=25, metadata={"help": "eval every N steps (<= 0: only at the end)"})
    out_dir: str = field(default="runs/pretrain", metadata={"help": "where logs, plot and checkpoint go"})

    def validate(self) -> None:
        if self.data is not None and self.data.endswith(".jsonl"):
            raise ValueError(f"--data {self.data} is SFT prompt/response data; pretraining takes plain "
                             "text (.txt) - use recipes/finetune.py for .jsonl")
        super().validate()


def parse_config(argv: list[str] | None = None) -> PretrainConfig:
    """PretrainConfig from the command line (one --flag per field)."""
    return train.parse_config(PretrainConfig, argv, __doc__)


def main(argv: list[str] | None = None) -> dict:
    return train.run(parse_config(argv))


if __name__ == "__main__":
    train.main_or_usage_error(main)
