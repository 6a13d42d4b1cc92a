"""The model a yashard.hf trainer shards, built in the order TRL's trainers build it.

TRL's trainers (``SFTTrainer``, ``DPOTrainer``, ...) call ``set_seed(args.seed)`` first, then load a
model given as a folder (``args.model_init_kwargs``; ``dtype`` float32 unless it names another),
then apply ``peft_config`` (PEFT draws the adapters' initial values from the RNG). A yashard.hf
trainer applies ``peft_config`` itself, before sharding, so it does the same three steps in the same
order: the adapters are those of the same run on DDP, and two runs with one ``seed`` are equal.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import transformers

from ..api import folder_dtype, from_pretrained, shard
from ..config import ShardConfig

_DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def with_adapters(model, peft_config, args, seed: bool = True):
    """``get_peft_model(model, peft_config)`` right after ``set_seed(args.seed)`` (``seed``: the
    caller has just set it), as TRL does."""
    import peft

    if isinstance(model, peft.PeftModel):  # (TRL refuses it as well)
        raise ValueError("peft_config= with a PeftModel: merge and unload its adapter (merge_and_unload), or pass "
                         "the base model with peft_config=, or the PeftModel without it")
    if seed:
        transformers.set_seed(args.seed)
    return peft.get_peft_model(model, peft_config)


def _init_kwargs(args) -> tuple[dict, object]:
    """``args.model_init_kwargs`` (a copy) without the dtype, and the dtype as TRL reads it:
    ``"float32"`` when absent, a ``torch.dtype`` or ``"auto"`` otherwise."""
    kwargs = dict(getattr(args, "model_init_kwargs", None) or {})
    dtype = kwargs.pop("dtype", kwargs.pop("torch_dtype", None))
    dtype = "float32" if dtype is None else dtype
    if isinstance(dtype, str) and dtype != "auto":
        if dtype.removeprefix("torch.") not in _DTYPE_NAMES:
            raise ValueError(f"model_init_kwargs dtype={dtype!r}: pass 'float32', 'bfloat16' or 'auto'")
        dtype = _DTYPE_NAMES[dtype.removeprefix("torch.")]
    return kwargs, dtype


def _folder_dtype(path) -> torch.dtype:
    """The dtype the folder's config.json names (``"auto"``), as ``yashard.from_pretrained`` reads it."""
    return folder_dtype(transformers.AutoConfig.from_pretrained(os.fspath(path), local_files_only=True), path)


def computing_in(config: ShardConfig, dtype: torch.dtype) -> ShardConfig:
    """``config`` (from the arguments) with the compute dtype the model's own dtype asks for: a
    model loaded in bf16 computes in bf16, as it does on DDP (yashard's masters stay fp32)."""
    if dtype == torch.float16:
        raise ValueError("model_init_kwargs dtype float16 (or a float16 folder with dtype='auto') with yashard.hf: "
                         "yashard.hf computes in fp32 or bf16; pass model_init_kwargs={'dtype': 'bfloat16'}")
    if dtype == torch.bfloat16 and config.param_dtype == torch.float32:
        return dataclasses.replace(config, param_dtype=torch.bfloat16)
    return config


def folder_model(path, args, config: ShardConfig, peft_config=None):
    """The sharded model of a local HF folder, as TRL builds it from a model id: ``set_seed``, the
    folder loaded with ``args.model_init_kwargs``, ``peft_config`` applied. ``config``: the
    ``ShardConfig`` the arguments ask for; the dtype ``model_init_kwargs`` names sets its compute
    dtype. Without ``peft_config`` the folder is streamed into the shards (``yashard.from_pretrained``);
    with it, the model is loaded whole first, as on DDP, for PEFT to wrap it."""
    kwargs, dtype = _init_kwargs(args)
    transformers.set_seed(args.seed)
    quantization = kwargs.pop("quantization_config", None)
    if quantization is not None:  # (QLoRA: each rank loads the 4-bit base, then peft_config, then shard)
        if dtype == "auto":
            dtype = _folder_dtype(path)
        return from_pretrained(path, config=computing_in(config, dtype), quantization_config=quantization,
                               peft_config=peft_config, **kwargs)
    if peft_config is None:
        if dtype == "auto":
            dtype = _folder_dtype(path)
        return from_pretrained(path, config=computing_in(config, dtype), **kwargs)
    if not os.path.isfile(os.path.join(os.fspath(path), "config.json")):
        raise FileNotFoundError(f"{os.fspath(path)} has no config.json: pass a local folder save_pretrained wrote")
    kwargs = {"device_map": None, "local_files_only": True, **kwargs}  # (a device_map given: refused by shard)
    model = transformers.AutoModelForCausalLM.from_pretrained(os.fspath(path), dtype=dtype, **kwargs)
    low = {p.dtype for p in model.parameters()} - {torch.float32}
    config = computing_in(config, low.pop() if len(low) == 1 else torch.float32)
    return shard(with_adapters(model, peft_config, args, seed=False), config=config)
