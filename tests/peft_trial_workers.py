"""Rank functions of tests/test_peft_export.py, test_adapter_save.py and test_one_rank_calls.py:
PEFT models trained through yashard.hf.Trainer, exported and saved; collective calls made on one
rank only. Tiny Qwen3 (tied embeddings) and Mistral models, families test_peft.py does not use."""

from __future__ import annotations

import logging
import os
import time

import torch
import torch.distributed as dist

import models
from hf_workers import _args, lm_data, tokenizer

IDS = torch.tensor([[5, 17, 3, 40, 88, 9, 61, 23]])


def peft_model(family: str, seed: int = 0, *, tie: bool = False, **lora):
    """A tiny ``family`` model with LoRA (random lora_B: the adapters change the logits from step one)."""
    from peft import LoraConfig, get_peft_model

    model = models.build(family, seed=seed, tie_word_embeddings=tie)
    torch.manual_seed(seed + 100)
    cfg = dict(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, target_modules=["q_proj", "v_proj"])
    return get_peft_model(model, LoraConfig(**{**cfg, **lora}))


def _train(rank, world, model, out, **overrides):
    """Two steps of yashard.hf.Trainer on ``model``; returns the trainer."""
    import yashard.hf

    args = _args(out, max_steps=2, learning_rate=2e-2, **overrides)
    trainer = yashard.hf.Trainer(model=model, args=args, train_dataset=lm_data(), processing_class=tokenizer())
    trainer.train()
    return trainer


def _logits(sm) -> torch.Tensor:
    with torch.no_grad():
        return sm(input_ids=IDS).logits.detach().clone()


def _error(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test matches the message
        return f"{type(e).__name__}: {e}"
    return "no error"


def export_cases(rank, world, out):
    """Exports of trained PEFT models: LoRA on a tied lm_head, modules_to_save on a tied lm_head,
    the adapters disabled; unload() and merge_and_unload() after shard refused."""
    import yashard

    res = {}
    # LoRA on q_proj and on the lm_head tied to the embedding (Qwen3, tie_word_embeddings=True)
    tr = _train(rank, world, peft_model("qwen3", tie=True, target_modules=["q_proj", "lm_head"]),
                os.path.join(out, "run_tied"))
    yashard.export_hf(tr.model, os.path.join(out, "tied"))
    res["tied"] = _logits(tr.model)
    with tr.model.module.disable_adapter():
        res["disabled"] = _logits(tr.model)
        yashard.export_hf(tr.model, os.path.join(out, "disabled"))
    res["base"] = models.build("qwen3", seed=0, tie_word_embeddings=True)(input_ids=IDS).logits.detach()
    # modules_to_save on the tied lm_head (a trained copy: the tie cannot hold in the folder)
    tr = _train(rank, world, peft_model("qwen3", seed=1, tie=True, target_modules=["q_proj"],
                                        modules_to_save=["lm_head"]), os.path.join(out, "run_mts"))
    yashard.export_hf(tr.model, os.path.join(out, "mts"))
    res["mts"] = _logits(tr.model)
    # unload() / merge_and_unload() after shard(): refused, on every rank, before anything is written
    for how in ("unload", "merge_and_unload"):
        sm = yashard.shard(peft_model("qwen3", tie=True))
        res[how] = _error(getattr(sm.module, how))
        res[f"{how} export"] = _error(lambda: yashard.export_hf(sm, os.path.join(out, how)))
        res[f"{how} logits"] = _logits(sm) if how == "merge_and_unload" else None
    return res


def adapter_cases(rank, world, out):
    """Adapter saves: modules_to_save through yashard.hf.Trainer (checkpoints and save_model), and a
    second, inactive adapter under a bf16 param_dtype."""
    import yashard

    res = {}
    model = peft_model("mistral", target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"])
    tr = _train(rank, world, model, os.path.join(out, "run"), save_strategy="steps", save_steps=1)
    tr.save_model(os.path.join(out, "adapter"))
    res["mts"] = _logits(tr.model)
    res["checkpoints"] = sorted(d for d in os.listdir(os.path.join(out, "run")) if d.startswith("checkpoint-"))
    # bf16 compute, two adapters: the second one never trains
    from peft import LoraConfig

    pm = peft_model("mistral", seed=2)
    torch.manual_seed(9)
    pm.add_adapter("second", LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                                        target_modules=["q_proj", "v_proj"]))
    if rank == 0:
        pm.save_pretrained(os.path.join(out, "peft_bf16"))  # what peft saves of the untrained adapters
    sm = yashard.shard(pm, config=yashard.ShardConfig(param_dtype=torch.bfloat16))
    opt = torch.optim.AdamW(sm.parameters(), lr=1e-2)
    ids = lm_data(4, seq=8)[rank]["input_ids"][None]
    sm(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    yashard.save_adapter(sm, os.path.join(out, "bf16"))
    res["bf16 full"] = {k: v for k, v in sm.full_state_dict().items() if ".lora_" in k}
    return res


# ---- one-rank collective calls -------------------------------------------------------------------


def _log_to(path: str) -> None:
    handler = logging.FileHandler(path)
    handler.setLevel(logging.ERROR)
    logging.getLogger("yashard").addHandler(handler)


def alone(rank, world, out, case: str, timeout: float):
    """Rank 0 makes a collective call alone (``case``); rank 1 goes on (a barrier, a later call).
    Each rank logs to ``out/rank<r>.log``. A call made alone raises out of the rank, as in a user's
    script (its seconds in ``out/rank0.seconds``); ranks in different calls return (error, seconds)."""
    import yashard
    import yashard.hf

    _log_to(os.path.join(out, f"rank{rank}.log"))
    cfg = yashard.ShardConfig(collective_timeout=timeout)
    if case == "trainer":
        trainer = yashard.hf.Trainer(model=models.build("mistral", seed=0), args=_args(os.path.join(out, "run"),
                                     max_steps=1), train_dataset=lm_data(), shard_config=cfg)
        trainer.train()
        start = time.monotonic()
        try:
            if trainer.is_world_process_zero():  # the DDP habit
                trainer.save_model(os.path.join(out, "model"))
            else:
                dist.barrier()
        finally:
            _seconds(out, rank, start)
        return "no error", time.monotonic() - start
    sm = yashard.shard(models.build("qwen3", seed=0, tie_word_embeddings=True), config=cfg)
    sm.full_state_dict()  # (every rank: passes)
    start = time.monotonic()
    if case == "export":
        try:
            if rank == 0:
                yashard.export_hf(sm, os.path.join(out, "model"))
            else:
                dist.barrier()
        finally:
            _seconds(out, rank, start)
        return "no error", time.monotonic() - start
    try:
        if case == "mismatch":
            if rank == 0:
                yashard.save_checkpoint(os.path.join(out, "ckpt"), sm)
            else:
                sm.full_state_dict()
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}", time.monotonic() - start
    return "no error", time.monotonic() - start


def _seconds(out, rank, start) -> None:
    with open(os.path.join(out, f"rank{rank}.seconds"), "w") as f:
        f.write(str(time.monotonic() - start))


def gate_cost(rank, world, calls: int) -> float:
    """Seconds per passage of the call gate (no collective behind it), over ``calls`` passages."""
    from yashard.call_gate import enter

    import yashard

    sm = yashard.shard(models.build("llama", seed=0))
    enter(sm.runtime.comm, "warm-up")
    start = time.perf_counter()
    for _ in range(calls):
        enter(sm.runtime.comm, "cost")
    return (time.perf_counter() - start) / calls
