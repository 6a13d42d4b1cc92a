"""Rank functions for tests/test_hf_seeding.py, test_hf_resume_step.py and test_hf_compile.py: what
yashard.hf's trainers do around building the model (the seed, PEFT's adapters, a model folder and
its dtype, torch.compile) and a resume, each on DDP (plain TRL / Trainer) and on yashard.

The seeding runs use a tiny 2-layer Gemma2 (tied embeddings, softcapping) with PEFT's default LoRA init:
lora_A drawn from the RNG (kaiming), so an unseeded adapter shows in the gradient norms."""

from __future__ import annotations

import logging
import os
import shutil

import torch

import hf_workers
import models


def _sft_data():
    import datasets

    g = torch.Generator().manual_seed(11)
    lengths = torch.randint(6, 16, (32,), generator=g)
    ids = [torch.randint(3, hf_workers.VOCAB, (int(n),), generator=g).tolist() for n in lengths]
    return datasets.Dataset.from_dict({"input_ids": ids})


def _sft_config(out, **overrides):
    from trl import SFTConfig

    return SFTConfig(**{**dict(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                               max_steps=2, logging_steps=1, learning_rate=1e-3,
                               gradient_checkpointing=False, report_to=[], save_strategy="no",
                               use_cpu=True, seed=42, dataloader_drop_last=True, disable_tqdm=True, bf16=False),
                        **overrides})


def _lora():
    from peft import LoraConfig

    return LoraConfig(r=8, target_modules="all-linear", lora_dropout=0.0)  # (PEFT's default init: lora_A random)


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _gemma2_folder(rank, out) -> str:
    folder = os.path.join(out, "gemma2")
    if rank == 0:
        models.build("gemma2", seed=0, num_hidden_layers=2).save_pretrained(folder)
    torch.distributed.barrier()
    return folder


def sft_cases(rank, world, engine, out, cases):
    """TRL's SFTTrainer (``engine="ddp"``) or ``yashard.hf.SFTTrainer`` for each case, each after the
    RNG was left in another state (as a script leaves it):

    * ``"object"``: a Gemma2 model object with a LoRA ``peft_config``;
    * ``"folder"``: the same model given as a folder, with ``peft_config``;
    * ``"folder-bf16"``: the folder with ``model_init_kwargs={"dtype": "bfloat16"}``, no PEFT.

    Returns per case the step logs, the compute dtype and the yashard warnings."""
    from trl import SFTTrainer

    import yashard.hf

    cls = SFTTrainer if engine == "ddp" else yashard.hf.SFTTrainer
    folder = _gemma2_folder(rank, out)
    warnings = _Warnings()
    logging.getLogger("yashard").addHandler(warnings)
    results = []
    for i, case in enumerate(cases):
        kwargs = {}
        if case == "object":
            model = models.build("gemma2", seed=0, num_hidden_layers=2)
        else:
            model = folder
        if case == "folder-bf16":
            kwargs["model_init_kwargs"] = {"dtype": "bfloat16"}
        torch.manual_seed(1000 + i)  # (whatever the script drew before: the trainer's seed must decide)
        trainer = cls(model=model, args=_sft_config(os.path.join(out, f"{case}-{i}"), **kwargs),
                      train_dataset=_sft_data(), processing_class=hf_workers.tokenizer(),
                      peft_config=None if case == "folder-bf16" else _lora())
        del warnings.messages[:]
        trainer.train()
        dtype = (trainer.model.runtime.config.param_dtype if engine != "ddp"
                 else next(trainer.model.parameters()).dtype)
        results.append({"case": case, "steps": hf_workers._steps(trainer.state.log_history), "dtype": str(dtype),
                        "warnings": list(warnings.messages)})
    logging.getLogger("yashard").removeHandler(warnings)
    return results


def resume_mixed(rank, world, out):
    """yashard.hf.Trainer (tiny Qwen2, accumulation 2) saving at steps 2 and 4; then checkpoint-4's
    ``yashard/`` replaced by checkpoint-2's, and a resume from each checkpoint: checkpoint-2 as
    written resumes, the mixed checkpoint-4 is refused. Returns the resumed logs and the message."""
    import pytest

    import yashard.hf

    def trainer(max_steps):
        args = hf_workers._args(out, max_steps=max_steps, gradient_accumulation_steps=2, save_strategy="steps",
                                save_steps=2)
        return yashard.hf.Trainer(model=models.build("qwen2", seed=0), args=args, train_dataset=hf_workers.lm_data())

    trainer(4).train()
    resumed = trainer(3)
    resumed.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2"))
    if rank == 0:
        mixed = os.path.join(out, "checkpoint-4", "yashard")
        shutil.rmtree(mixed)
        shutil.copytree(os.path.join(out, "checkpoint-2", "yashard"), mixed)
    torch.distributed.barrier()
    with pytest.raises(ValueError) as e:
        trainer(6).train(resume_from_checkpoint=os.path.join(out, "checkpoint-4"))
    return {"resumed": hf_workers._steps(resumed.state.log_history), "message": str(e.value)}


def compiled_runs(rank, world, out, cases):
    """yashard.hf.Trainer (tiny Llama, accumulation 2, 2 steps) for each of ``cases``: the
    ``torch_compile``, ``torch_compile_backend`` and ``torch_compile_mode`` arguments, or none.
    Returns per case the step logs, what each compile was asked for, how many decoder layers are
    compiled, and the graphs Dynamo compiled."""
    import torch._dynamo

    import yashard.hf

    results = []
    own = torch.compile
    for i, compile_args in enumerate(cases):
        calls = []

        def spy(*args, **kwargs):  # (what each compile is asked for; the compile itself runs as asked)
            calls.append({k: v for k, v in kwargs.items() if k in ("backend", "mode")})
            return own(*args, **kwargs)

        torch.compile = spy
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        try:
            args = hf_workers._args(os.path.join(out, str(i)), max_steps=2, gradient_accumulation_steps=2,
                                    **compile_args)
            trainer = yashard.hf.Trainer(model=models.build("llama", seed=0), args=args,
                                         train_dataset=hf_workers.lm_data())
            trainer.train()
        finally:
            torch.compile = own
        layers = trainer.model.module.model.layers
        results.append({"steps": hf_workers._steps(trainer.state.log_history), "calls": calls,
                        "compiled_layers": sum(getattr(m, "_compiled_call_impl", None) is not None for m in layers),
                        "graphs": int(torch._dynamo.utils.counters["stats"]["unique_graphs"])})
    return results


def init_refusals(rank, world, out):
    """What building the model refuses, on one rank: a PeftModel with ``peft_config``,
    ``quantization_config`` with a loaded model or given twice, an 8-bit one, a float16 or unknown ``model_init_kwargs`` dtype, a ``chat_template_path``
    that TRL would clone into the model. Returns the messages."""
    import pytest
    from peft import get_peft_model

    import yashard.hf

    folder = _gemma2_folder(rank, out)
    data, tok, got = _sft_data(), hf_workers.tokenizer(), {}

    def refused(name, model, peft_config=None, error=ValueError, **kwargs):
        init = kwargs.pop("model_init_kwargs", None)
        with pytest.raises(error) as e:
            yashard.hf.SFTTrainer(model=model, args=_sft_config(out, model_init_kwargs=init), train_dataset=data,
                                  processing_class=tok, peft_config=peft_config, **kwargs)
        got[name] = str(e.value)

    refused("peft_model", get_peft_model(models.build("gemma2", num_hidden_layers=2), _lora()), _lora())
    from transformers import BitsAndBytesConfig

    loaded = models.build("gemma2", num_hidden_layers=2)
    refused("quantization", loaded, quantization_config=BitsAndBytesConfig(load_in_4bit=True))
    refused("quantization_twice", folder, _lora(), quantization_config=BitsAndBytesConfig(load_in_4bit=True),
            model_init_kwargs={"quantization_config": BitsAndBytesConfig(load_in_4bit=True)})
    refused("quantization_8bit", folder, _lora(),
            model_init_kwargs={"quantization_config": BitsAndBytesConfig(load_in_8bit=True)})
    refused("float16", folder, model_init_kwargs={"dtype": "float16"})
    refused("float16_peft", folder, _lora(), model_init_kwargs={"dtype": "float16"})
    refused("bad_dtype", folder, model_init_kwargs={"dtype": "int8"})
    with pytest.raises(ValueError) as e:  # (TRL would clone the template after the model is sharded)
        yashard.hf.SFTTrainer(model=folder, args=_sft_config(out, chat_template_path=folder), train_dataset=data,
                              processing_class=tok)
    got["chat_template"] = str(e.value)
    return got
