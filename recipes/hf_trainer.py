"""Fine-tune through HF Trainer on yashard: the embedded default, or your folder and tokenizer.

    torchrun --nproc_per_node 2 recipes/hf_trainer.py
    torchrun --nproc_per_node 2 recipes/hf_trainer.py --bf16 --accum-steps 2 --steps 40
    torchrun --nproc_per_node 2 recipes/hf_trainer.py --resume          # from the newest checkpoint-N
    torchrun --nproc_per_node 8 recipes/hf_trainer.py --model PATH --tokenizer PATH --text corpus.txt

The Trainer code is what you would write for DDP; only the class is ``yashard.hf.Trainer``.
With no --model it trains the tiny random-init Llama of recipes/finetune.py on Python
standard-library sources with a byte-level tokenizer: no downloads. Checkpoints (sharded, plus
Trainer's own files) go to --out-dir/checkpoint-N, the final HF folder to --out-dir/final.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import data  # noqa: E402  (recipes/data.py: tokenizers and the embedded corpus)
from train_setup import preset_config  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="local HF checkpoint folder (default: the tiny random Llama)")
    p.add_argument("--tokenizer", help="local HF tokenizer folder (default: byte-level)")
    p.add_argument("--text", help="a text file to train on (default: Python standard-library sources)")
    p.add_argument("--max-bytes", type=int, default=1_000_000, help="bytes of the default corpus to read")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per rank per micro-batch")
    p.add_argument("--accum-steps", type=int, default=1, help="gradient accumulation steps")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (cosine, 5 warmup steps)")
    p.add_argument("--bf16", action="store_true", help="compute in bf16 (fp32 master weights)")
    p.add_argument("--save-steps", type=int, default=10, help="checkpoint every N steps (the last 2 are kept)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint-N in --out-dir")
    p.add_argument("--out-dir", default="runs/hf_trainer", help="checkpoints, logs and the final HF folder")
    args = p.parse_args(argv)
    if min(args.steps, args.micro_batch, args.accum_steps, args.save_steps) < 1 or args.seq_len < 2:
        p.error("--steps, --micro-batch, --accum-steps and --save-steps must be >= 1, --seq-len >= 2")
    return args


def sequences(tok, text: str | None, seq_len: int, max_bytes: int) -> tuple[list[dict], list[dict]]:
    """Train and eval examples: the token stream cut into ``seq_len`` pieces; 5% held out, at most 64."""
    docs = data.text_file_documents(text) if text else data.stdlib_documents(max_bytes)
    ids = data.tokenize_documents(docs, tok)
    rows = ids[: len(ids) // seq_len * seq_len].view(-1, seq_len)
    examples = [{"input_ids": r, "labels": r} for r in rows]
    held = max(1, min(64, len(examples) // 20))
    return examples[held:], examples[:held]


def main(argv=None) -> dict:
    args = parse_args(argv)
    from transformers import AutoModelForCausalLM, TrainingArguments

    import yashard.hf

    tok = data.load_tokenizer(args.tokenizer)
    train, held_out = sequences(tok, args.text, args.seq_len, args.max_bytes)
    training_args = TrainingArguments(
        output_dir=args.out_dir, max_steps=args.steps, per_device_train_batch_size=args.micro_batch,
        per_device_eval_batch_size=args.micro_batch, gradient_accumulation_steps=args.accum_steps,
        learning_rate=args.lr, lr_scheduler_type="cosine", warmup_steps=5, weight_decay=0.1, max_grad_norm=1.0,
        bf16=args.bf16, logging_steps=1, eval_strategy="steps", eval_steps=max(1, args.steps // 3),
        save_strategy="steps", save_steps=args.save_steps, save_total_limit=2, report_to=[], seed=0,
        dataloader_drop_last=True, use_cpu=not torch.cuda.is_available(),
    )
    if args.model:
        model = args.model  # (a folder: each rank reads only its shards)
    else:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(preset_config("tiny", tok, args.seq_len))
    trainer = yashard.hf.Trainer(model=model, args=training_args, train_dataset=train, eval_dataset=held_out,
                                 processing_class=getattr(tok, "tok", None))
    if trainer.args.process_index == 0:
        print(trainer.model.memory_plan())
    result = trainer.train(resume_from_checkpoint=True if args.resume else None)
    metrics = trainer.evaluate()
    trainer.save_model(os.path.join(args.out_dir, "final"))
    if trainer.args.process_index == 0:
        print(f"train loss {result.training_loss:.4f}, held-out loss {metrics['eval_loss']:.4f}; "
              f"HF folder: {os.path.join(args.out_dir, 'final')}")
    return {"train_loss": result.training_loss, "eval_loss": metrics["eval_loss"]}


if __name__ == "__main__":
    main()
