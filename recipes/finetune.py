"""Fine-tune a HuggingFace decoder with yashard.

    torchrun --nproc_per_node 2 recipes/finetune.py --steps 30 --lr 2e-3
    python recipes/finetune.py --param-dtype bf16            # one process, no torchrun
    python recipes/finetune.py --qlora                       # LoRA on a 4-bit NF4 base; final/ is the adapter
    torchrun --nproc_per_node 8 recipes/finetune.py --model PATH --tokenizer PATH --data sft.jsonl

With no --model/--tokenizer/--data it trains a tiny random-init Llama on Python standard library
sources with a byte-level tokenizer: no downloads, and done in well under two minutes on a
2-core CPU. A .jsonl --data file of {"prompt", "response"} lines is supervised fine-tuning: the
loss is taken on the response only. Writes log.jsonl, loss.png (when matplotlib is installed) and
an HF checkpoint folder final/ under --out-dir. The loop lives in recipes/train_loop.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import train
from train import TrainConfig


@dataclass
class FinetuneConfig(TrainConfig):
    model: str | None = field(default=None, metadata={"help": "local HF checkpoint folder (default: tiny random Llama)"})
    out_dir: str = field(default="runs/finetune", metadata={"help": "where logs, plot and checkpoint go"})
    qlora: bool = field(default=False, metadata={"help": "QLoRA: LoRA r=16 on every linear layer of the model loaded "
                                                         "as a bitsandbytes NF4 base (double quantisation); final/ is "
                                                         "the adapter"})

    def validate(self) -> None:
        super().validate()
        if self.qlora and self.freeze:
            raise ValueError(f"--qlora trains LoRA adapters on a frozen 4-bit base: --freeze {self.freeze} has nothing "
                             "to freeze; leave it out")


def parse_config(argv: list[str] | None = None) -> FinetuneConfig:
    """FinetuneConfig from the command line (one --flag per field)."""
    return train.parse_config(FinetuneConfig, argv, __doc__)


def main(argv: list[str] | None = None) -> dict:
    return train.run(parse_config(argv))


if __name__ == "__main__":
    train.main_or_usage_error(main)
