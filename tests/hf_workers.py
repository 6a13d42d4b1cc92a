"""Rank functions for tests/test_hf.py, test_hf_dpo.py and test_hf_errors.py: HF Trainer,
Accelerate and TRL on yashard and on DDP.

Every run builds the same tiny Llama (seed 0) and the same in-memory data, so a DDP run and a
yashard run see the same global batches; they return what the tests compare (Trainer's
log_history, the final weights, the compute dtype)."""

from __future__ import annotations

import os

import torch

import models

VOCAB = 96


def tokenizer():
    """A word-level tokenizer over the tiny model's vocabulary, built in memory (no download)."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<unk>")


def lm_data(n: int = 32, seq: int = 16, seed: int = 1) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": x, "labels": x} for x in torch.randint(3, VOCAB, (n, seq), generator=g)]


def _args(out, **overrides):
    from transformers import TrainingArguments

    base = dict(output_dir=out, per_device_train_batch_size=2, max_steps=4, logging_steps=1, learning_rate=1e-3,
                report_to=[], save_strategy="no", use_cpu=True, seed=0, dataloader_drop_last=True,
                disable_tqdm=True, weight_decay=0.1, max_grad_norm=0.5, lr_scheduler_type="cosine",
                warmup_steps=1, per_device_eval_batch_size=2)
    base.update(overrides)
    return TrainingArguments(**base)


def _steps(history: list[dict]) -> list[dict]:
    return [h for h in history if "loss" in h]


def lora_config(init=True):
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=init)


def trainer_run(rank, world, engine, out, overrides, resume=None, save_model=None, model_folder=False, lora=False):
    """Train with ``transformers.Trainer`` (``engine="ddp"``) or ``yashard.hf.Trainer``; returns
    the per-step logs, the eval logs, the compute dtype, and (rank 0) the final full weights."""
    import yashard
    import yashard.hf
    from transformers import Trainer

    model = models.build("llama", seed=0)
    if lora:
        from peft import get_peft_model

        torch.manual_seed(7)
        model = get_peft_model(model, lora_config())
    if model_folder:  # the model given as a folder: save it first (rank 0) and pass the path
        folder = os.path.join(out, "init_model")
        if rank == 0:
            model.save_pretrained(folder)
        torch.distributed.barrier()
        model = folder
    cls = Trainer if engine == "ddp" else yashard.hf.Trainer
    args = _args(out, **overrides)
    eval_data = lm_data(8, seed=5) if args.eval_strategy != "no" else None
    trainer = cls(model=model, args=args, train_dataset=lm_data(), eval_dataset=eval_data,
                  processing_class=tokenizer())
    trainer.train(resume_from_checkpoint=resume)
    import transformers.trainer

    result = {"steps": _steps(trainer.state.log_history),
              "evals": [h for h in trainer.state.log_history if "eval_loss" in h],
              "user_args_checkpointing": args.gradient_checkpointing,
              "n_trainable": (trainer.get_num_trainable_parameters(),
                              transformers.trainer.get_model_param_count(trainer.model, trainable_only=True))}
    if lora:
        result["trainable"] = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        full = None
    elif engine == "ddp":
        result["dtype"] = str(next(trainer.model.parameters()).dtype)
        full = {k: v.detach().float().clone() for k, v in trainer.model.state_dict().items()}
    else:
        result["dtype"] = str(trainer.model.runtime.config.param_dtype)
        result["checkpoint_layers"] = trainer.model.runtime.config.checkpoint_layers
        full = trainer.model.full_state_dict()
    if save_model is not None:
        trainer.save_model(save_model)
    result["full"] = full if rank == 0 else None
    return result


def accelerate_run(rank, world, engine, out, steps=4, accumulation=2, resume_at=None):
    """A plain Accelerate loop (prepare, accumulate, backward, clip_grad_norm_, save_state and
    load_state at ``resume_at``) with ``accelerate.Accelerator`` on DDP or ``yashard.hf.Accelerator``."""
    import accelerate
    from torch.utils.data import DataLoader

    import yashard.hf

    torch.manual_seed(0)
    cls = accelerate.Accelerator if engine == "ddp" else yashard.hf.Accelerator
    acc = cls(gradient_accumulation_steps=accumulation, cpu=True)
    model = models.build("llama", seed=0)
    loader = DataLoader([d["input_ids"] for d in lm_data()], batch_size=2, shuffle=False)
    if engine == "ddp":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        model, opt, loader = acc.prepare(model, opt, loader)
    else:
        model = acc.prepare(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        opt, loader = acc.prepare(opt, loader)
    sched = acc.prepare(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9))
    losses, norms = [], []
    step, at_save, lr_at_save = 0, None, None
    for batch in loader:
        with acc.accumulate(model):
            loss = model(input_ids=batch, labels=batch).loss
            acc.backward(loss)
            if acc.sync_gradients:
                norms.append(float(acc.clip_grad_norm_(model.parameters(), 0.5)))
                step += 1
            opt.step()
            sched.step()
            opt.zero_grad()
        losses.append(float(acc.gather(loss.detach()).mean()))
        if acc.sync_gradients and step == resume_at:
            acc.save_state(os.path.join(out, "state"))
            saved = [p.detach().clone() for p in model.parameters()]
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.5)  # spoil the weights: load_state must bring them back
            for group in opt.param_groups:
                group["lr"] = 123.0
            acc.load_state(os.path.join(out, "state"))
            assert all(torch.equal(a, b) for a, b in zip(saved, model.parameters()))
            assert opt.param_groups[0]["lr"] != 123.0
            at_save = model.full_state_dict() if engine != "ddp" else None
            lr_at_save = sched.get_last_lr()
        if step == steps:
            break
    return {"losses": losses, "norms": norms, "at_save": at_save if resume_at and rank == 0 else None,
            "lr_at_save": lr_at_save}


def accelerate_load(rank, world, state_dir):
    """A fresh yashard.hf.Accelerator at this world size loads what save_state wrote at another."""
    import yashard.hf

    acc = yashard.hf.Accelerator(cpu=True)
    model = acc.prepare(models.build("llama", seed=3))
    opt = acc.prepare(torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1))
    sched = acc.prepare(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9))
    acc.load_state(state_dir)
    return {"full": model.full_state_dict() if rank == 0 else None, "lr": sched.get_last_lr(),
            "moments": sum(float(st["exp_avg_sq"].sum()) for st in opt.state.values())}


def sft_run(rank, world, engine, out, overrides, peft=False, save_model=None):
    """TRL's SFTTrainer with its defaults except ``overrides``, on DDP or ``yashard.hf.SFTTrainer``."""
    import datasets
    from trl import SFTConfig, SFTTrainer

    import yashard.hf

    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(6, 16, (32,), generator=g)
    ids = [torch.randint(3, VOCAB, (int(n),), generator=g).tolist() for n in lengths]
    data = datasets.Dataset.from_dict({"input_ids": ids})
    config = SFTConfig(**{**dict(output_dir=out, per_device_train_batch_size=2, max_steps=4, logging_steps=1,
                                 report_to=[], save_strategy="no", use_cpu=True, seed=0, dataloader_drop_last=True,
                                 disable_tqdm=True), **overrides})
    cls = SFTTrainer if engine == "ddp" else yashard.hf.SFTTrainer
    torch.manual_seed(7)  # (the adapters' init)
    trainer = cls(model=models.build("llama", seed=0), args=config, train_dataset=data,
                  processing_class=tokenizer(),
                  # (OLoRA's init comes from the weights, not the RNG: TRL draws random numbers between its
                  # model init and its get_peft_model, yashard.hf applies get_peft_model before them)
                  peft_config=lora_config("olora") if peft else None)
    trainer.train()
    if save_model is not None:
        trainer.save_model(save_model)
    out = {"steps": _steps(trainer.state.log_history)}
    if engine != "ddp":
        out["dtype"] = str(trainer.model.runtime.config.param_dtype)
        out["checkpoint_layers"] = trainer.model.runtime.config.checkpoint_layers
    return out


def ref_trainer_run(rank, world, out):
    """``sharded_trainer`` of a Trainer subclass that takes another model before ``args`` (as TRL's
    DPO and GRPO trainers do): its arguments arrive by name."""
    from transformers import Trainer

    import yashard.hf

    class RefTrainer(Trainer):
        def __init__(self, model, ref_model=None, args=None, **kwargs):
            super().__init__(model=model, args=args, **kwargs)
            self.ref_model = ref_model

    cls = yashard.hf.sharded_trainer(RefTrainer)
    assert cls.__name__ == "RefTrainer" and yashard.hf.sharded_trainer(RefTrainer) is cls
    trainer = cls(models.build("llama", seed=0), "a reference", _args(out, max_steps=2), train_dataset=lm_data())
    trainer.train()
    return {"ref_model": trainer.ref_model, "steps": _steps(trainer.state.log_history)}


def accelerate_auto(rank, world, out):
    """save_state / load_state with automatic checkpoint naming, next to a frozen teacher model."""
    from accelerate.utils import ProjectConfiguration

    import yashard.hf

    acc = yashard.hf.Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=out, automatic_checkpoint_naming=True, total_limit=2))
    teacher = models.build("llama", seed=1).requires_grad_(False)
    model, teacher = acc.prepare(models.build("llama", seed=0), teacher)
    opt = acc.prepare(torch.optim.AdamW(model.parameters(), lr=1e-3))
    batch = lm_data(2)[0]["input_ids"][None]
    for _ in range(3):
        acc.backward(model(input_ids=batch, labels=batch).loss)
        opt.step()
        opt.zero_grad()
        acc.save_state()
    last = model.full_state_dict()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    acc.load_state()
    loaded = model.full_state_dict()
    return {"folders": sorted(os.listdir(os.path.join(out, "checkpoints"))),
            "same": all(torch.equal(last[k], loaded[k]) for k in last)}


def refusals(rank, world, out):
    """Each way of misusing yashard.hf raises, naming the fix; returns the messages."""
    import pytest
    from transformers import TrainingArguments

    import yashard
    import yashard.hf

    got = {}
    with pytest.raises(ValueError) as e:
        yashard.hf.Trainer(model=models.build("llama"), args=_args(out, fp16=True, use_cpu=True))
    got["fp16"] = str(e.value)
    sharded = yashard.shard(models.build("llama"))
    with pytest.raises(ValueError) as e:
        yashard.hf.Trainer(model=sharded, args=_args(out, bf16=True))
    got["bf16_on_fp32"] = str(e.value)
    with pytest.raises(ValueError) as e:
        yashard.hf.Trainer(model=sharded, args=_args(out, gradient_checkpointing=True))
    got["checkpointing"] = str(e.value)
    with pytest.raises(ValueError) as e:
        yashard.hf.Trainer(model=models.build("llama"), args=None)
    got["no_args"] = str(e.value)
    acc = yashard.hf.Accelerator(cpu=True)
    model = models.build("llama")
    with pytest.raises(ValueError) as e:
        acc.prepare(model, torch.optim.AdamW(model.parameters()))
    got["optimizer_first"] = str(e.value)
    model = models.build("llama")
    with pytest.raises(ValueError) as e:
        yashard.hf.Trainer(model=model, args=_args(out), optimizers=(torch.optim.AdamW(model.parameters()), None))
    got["optimizers"] = str(e.value)
    with pytest.raises(ValueError) as e:
        yashard.hf.Trainer(model=models.build("llama"), args=TrainingArguments(out, use_cpu=True, fsdp="full_shard"))
    got["fsdp"] = str(e.value)
    with pytest.raises(ValueError) as e:
        yashard.hf.Trainer(args=_args(out), model_init=lambda: models.build("llama"))
    got["model_init"] = str(e.value)
    with pytest.raises(ValueError) as e:
        yashard.hf.Trainer(model=models.build("llama"), args=_args(
            out, gradient_checkpointing=True, gradient_checkpointing_kwargs={"every_n_layers": 2}))
    got["every_n_layers"] = str(e.value)
    from trl import SFTTrainer

    with pytest.raises(ValueError) as e:
        yashard.hf.sharded_trainer(SFTTrainer)(model=sharded, args=_args(out), peft_config=lora_config())
    got["peft_config_sharded"] = str(e.value)
    trainer = yashard.hf.Trainer(model=models.build("llama"), args=_args(out), train_dataset=lm_data())
    os.makedirs(os.path.join(out, "not-ours"), exist_ok=True)
    with pytest.raises(FileNotFoundError) as e:
        trainer.train(resume_from_checkpoint=os.path.join(out, "not-ours"))
    got["resume_other"] = str(e.value)
    acc = yashard.hf.Accelerator(cpu=True)
    acc.prepare(models.build("llama"))
    with pytest.raises(FileNotFoundError) as e:
        acc.load_state(os.path.join(out, "not-ours"))
    got["load_state_other"] = str(e.value)
    acc.prepare(models.build("llama", seed=1))  # (a second trained model: prepare shards it too)
    with pytest.raises(ValueError) as e:
        acc.save_state(os.path.join(out, "state"))
    got["two_models"] = str(e.value)
    return got


def preference_data(n: int = 16, seed: int = 4):
    """An in-memory preference dataset (prompt, chosen, rejected) of words of the tiny vocabulary."""
    import datasets

    g = torch.Generator().manual_seed(seed)

    def words(low, high):
        n = int(torch.randint(low, high, (1,), generator=g))
        return " ".join(f"w{int(i)}" for i in torch.randint(3, VOCAB, (n,), generator=g))

    return datasets.Dataset.from_list([{"prompt": words(3, 8), "chosen": words(2, 6) + " </s>",
                                        "rejected": words(2, 6) + " </s>"} for _ in range(n)])


def _dpo_config(out, **overrides):
    from trl import DPOConfig

    return DPOConfig(**{**dict(output_dir=out, per_device_train_batch_size=2, max_steps=2, logging_steps=1,
                               learning_rate=1e-2, report_to=[], save_strategy="no", use_cpu=True, seed=0,
                               dataloader_drop_last=True, disable_tqdm=True, bf16=False), **overrides})


def dpo_run(rank, world, engine, out, cases):
    """TRL's DPOTrainer (TRL's defaults but fp32, 2 steps) on DDP or through
    ``yashard.hf.sharded_trainer``, for each of ``cases``: ``"peft"`` (a LoRA ``peft_config``: the
    reference is the base model, its adapter disabled) or ``"folder"`` (no PEFT, the model given as a
    folder, from which TRL loads the reference model). Returns per case the step logs and the types
    of the model and the reference model."""
    from trl import DPOTrainer

    import yashard.hf

    cls = DPOTrainer if engine == "ddp" else yashard.hf.sharded_trainer(DPOTrainer)
    results = {}
    for case in cases:
        model = models.build("llama", seed=0)
        if case == "folder":
            folder = os.path.join(out, "init_model")
            if rank == 0:
                model.save_pretrained(folder)
            torch.distributed.barrier()
            model = folder
        # (OLoRA's init comes from the weights, not the RNG: see sft_run)
        trainer = cls(model=model, args=_dpo_config(os.path.join(out, case)), train_dataset=preference_data(),
                      processing_class=tokenizer(), peft_config=lora_config("olora") if case == "peft" else None)
        trainer.train()
        results[case] = {"steps": _steps(trainer.state.log_history), "model": type(trainer.model).__name__,
                         "ref_model": type(trainer.ref_model).__name__}
    return results


def _fused_head_with_chunk_size(add_fused_lm_head):
    """TRL's ``add_fused_lm_head`` as another TRL version might have it: its forward takes one keyword
    argument more (``chunk_size``), which yashard's answer would not honour."""
    import types

    def add(model, *args, **kwargs):
        add_fused_lm_head(model, *args, **kwargs)
        trl_forward = model.forward.__func__

        def _fused_forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None,
                           num_items_in_batch=None, chunk_size=None, **kwargs):
            return trl_forward(self, *args, fused_lm_head=fused_lm_head, labels=labels, shift_labels=shift_labels,
                               num_items_in_batch=num_items_in_batch, **kwargs)

        model.forward = types.MethodType(_fused_forward, model)

    return add


def trainer_refusals(rank, world, out):
    """What yashard.hf's trainers refuse, on one rank (TrainingArguments set up Accelerate's state:
    not in the test process): Accelerate's FSDP variable, an unknown TRL fused LM head, DPO's
    reference model of a PEFT model given as such, sync_ref_model, precompute_ref_log_probs.
    Returns the messages."""
    import datasets
    import pytest
    import trl.trainer.sft_trainer
    from peft import get_peft_model
    from trl import DPOTrainer

    import yashard.hf

    got = {}
    data = datasets.Dataset.from_dict({"input_ids": [list(range(3, 12))] * 4})
    own = trl.trainer.sft_trainer.add_fused_lm_head
    trl.trainer.sft_trainer.add_fused_lm_head = _fused_head_with_chunk_size(own)
    try:
        with pytest.raises(NotImplementedError) as e:
            yashard.hf.SFTTrainer(model=models.build("llama"), args=_sft_config(out), train_dataset=data,
                                  processing_class=tokenizer())
        got["fused_head"] = str(e.value)
    finally:
        trl.trainer.sft_trainer.add_fused_lm_head = own
    with pytest.raises(ValueError) as e:
        yashard.hf.sharded_trainer(DPOTrainer)(model=get_peft_model(models.build("llama"), lora_config()),
                                               args=_dpo_config(out), train_dataset=preference_data(),
                                               processing_class=tokenizer())
    got["dpo_peft_model"] = str(e.value)
    for name in ("sync_ref_model", "precompute_ref_log_probs"):
        with pytest.raises(ValueError) as e:
            yashard.hf.sharded_trainer(DPOTrainer)(model=models.build("llama"), args=_dpo_config(out, **{name: True}),
                                                   train_dataset=preference_data(), processing_class=tokenizer())
        got[name] = str(e.value)
    os.environ["ACCELERATE_USE_FSDP"] = "true"  # (as `accelerate launch --use_fsdp` sets it)
    try:
        with pytest.raises(ValueError) as e:
            yashard.hf.Trainer(model=models.build("llama"), args=_args(out), train_dataset=lm_data())
        got["fsdp_env"] = str(e.value)
    finally:
        del os.environ["ACCELERATE_USE_FSDP"]
    return got


def _sft_config(out, **overrides):
    from trl import SFTConfig

    return SFTConfig(**{**dict(output_dir=out, per_device_train_batch_size=2, max_steps=1, report_to=[],
                               save_strategy="no", use_cpu=True, bf16=False, disable_tqdm=True), **overrides})
