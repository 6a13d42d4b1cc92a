"""Public entry points: :func:`shard` and :func:`from_pretrained`, which return a :class:`ShardedModel`."""

from __future__ import annotations

import logging
import os

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .bnb4 import is_params4bit
from .call_gate import watch
from .collectives import Comm
from .config import ShardConfig, low_precision_dtype
from .partition import base_model_of, check_peft_method, float_param_dtypes, hf_checkpointing_on
from .patch.spec import resolve_spec
from .runtime import Runtime
from .sharded_model import ShardedModel

logger = logging.getLogger("yashard")


def _pick_device(config: ShardConfig, comm: Comm) -> torch.device:
    if config.device is not None:
        return config.device
    if "nccl" in comm.backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def cuda_device(device: torch.device, current: int) -> torch.device:
    """``device`` with its index, which must be the current CUDA device ``current``: NCCL and
    the compute stream the runtime orders its collectives against belong to the current device,
    so a model on another GPU would be ordered against the wrong stream."""
    if device.index is None:
        return torch.device("cuda", current)
    if device.index != current:
        raise ValueError(
            f"ShardConfig(device={str(device)!r}) but the current CUDA device is cuda:{current}; NCCL and yashard's "
            f"streams work on the current device. Call torch.cuda.set_device({device.index}) before yashard.shard "
            "(under torchrun: torch.cuda.set_device(int(os.environ['LOCAL_RANK']))), or pass "
            f"ShardConfig(device='cuda:{current}')"
        )
    return device


def shard(model: nn.Module, *, config: ShardConfig | None = None, process_group=None, mesh=None,
          weights: str | os.PathLike | None = None) -> ShardedModel:
    """Shard every parameter of a HuggingFace decoder model across ``process_group``.

    Which ranks shard together: all of ``process_group`` (default: the world); or groups of
    ``config.shard_group_size`` consecutive ranks, replicated across the groups (hybrid sharding);
    or a ``torch.distributed.DeviceMesh``, as FSDP2's ``fully_shard(mesh=...)`` takes it: a 1-D mesh
    is the data-parallel group, a 2-D ``(replicate, shard)`` mesh shards along its second dim
    (its rows) and replicates along its first (its columns), with the mesh's own process groups.

    Every rank must call this with the same architecture. Where the weights come from:

    * ``weights=<HF folder>``: each rank reads only the rows of its shards from the folder's
      safetensors files (the model may be on the meta device; no rank ever holds the full model);
    * a model built on the meta device (``with torch.device("meta"): AutoModelForCausalLM.from_config(cfg)``):
      the model's own initialisation runs one module at a time, drawing exactly the random numbers
      that building it on the CPU draws, so the weights are bitwise those of the unsharded model
      built with the same RNG state (rank 0's state, with ``sync_module_states``);
    * a model with real weights: with ``config.sync_module_states`` (the default) rank 0's weights
      are broadcast first, one unit at a time.

    A ``peft.PeftModel`` (LoRA; apply ``get_peft_model`` before sharding) is sharded as its HF base
    model, and the returned model calls the PEFT model. The trainable adapter weights form one unit
    of their own, the adapter group, gathered and reduced like the norm group; the frozen base
    weights get no gradient buffer and no optimizer state.

    The original ``nn.Parameter`` objects are removed from ``model``: build the optimizer from the
    returned model (``param_groups`` or ``parameters()``) afterwards. The memory plan is logged at
    INFO level on rank 0.
    """
    if isinstance(model, ShardedModel):
        raise ValueError("model is already sharded by yashard; call yashard.shard once per model")
    if not isinstance(model, nn.Module):
        raise TypeError(f"yashard.shard expects an nn.Module, got {type(model).__name__}")
    low = low_precision_dtype(float_param_dtypes(model))
    if config is None:
        # a bf16/fp16 model computes in its dtype, as FSDP2 keeps it (the masters are fp32 all the same)
        config = ShardConfig() if low is None else ShardConfig(param_dtype=low)
    elif not isinstance(config, ShardConfig):
        raise TypeError(f"config must be a yashard.ShardConfig, got {type(config).__name__}")
    elif low is not None and config.param_dtype != low:
        logger.warning("yashard: the model's parameters are %s but ShardConfig.param_dtype is %s: it computes in "
                       "%s (masters are fp32 either way); pass ShardConfig(param_dtype=%s) to compute in %s",
                       low, config.param_dtype, config.param_dtype, low, low)
    wide = [n for n, p in model.named_parameters() if p.dtype == torch.float64]
    if wide:
        logger.warning("yashard: %d parameter(s) are float64 (%s%s); yashard keeps fp32 master weights and computes "
                       "in %s, so they are rounded to fp32", len(wide), wide[0], ", ..." if len(wide) > 1 else "",
                       config.param_dtype)
    check_peft_method(model)
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}")
    comm = Comm(process_group, shard_group_size=config.shard_group_size,
                secondary_group_size=config.secondary_group_size, timeout=config.collective_timeout, mesh=mesh)
    comm.log.track = config.debug_collectives
    watch(comm)  # (a peer that gives up on a collective call this rank never joined ends this process)
    hf = base_model_of(model)  # a PEFT model's HF model: its modules are sharded, the PEFT model is called
    if hf is not model:
        inside = {id(p) for p in hf.parameters()}
        outside = next((n for n, p in model.named_parameters() if id(p) not in inside), None)
        if outside is not None:
            raise ValueError(
                f"{outside} is a parameter of the {type(model).__name__} outside its HF model "
                f"({type(hf).__name__}), which yashard shards: it would train unsharded and never be reduced across "
                "ranks. yashard shards PEFT methods that put their adapters inside the model's layers (LoRA); "
                "prompt learning methods (prompt tuning, prefix tuning, p-tuning) are not supported"
            )
    spec = resolve_spec(hf)
    config = _take_over_kbit_checkpointing(hf, spec, config)
    device = _pick_device(config, comm)
    comm.device_type = device.type
    if mesh is not None and mesh.device_type != device.type:
        raise ValueError(
            f"the mesh is a {mesh.device_type!r} mesh but yashard runs on {device}; build it with "
            f"init_device_mesh({device.type!r}, ...) or pass ShardConfig(device=...) on the mesh's device"
        )
    if device.type == "cuda" and "nccl" not in comm.backend:
        raise ValueError(
            f"device {device} needs an NCCL process group, but the group's backend is {comm.backend}: "
            "init the group with backend='nccl', or pass ShardConfig(device='cpu')"
        )
    if device.type == "cuda":
        device = cuda_device(device, torch.cuda.current_device())
    if device.type == "cpu" and "gloo" not in comm.backend:
        raise ValueError(
            f"the CPU device needs a gloo process group, but the group's backend is {comm.backend}: "
            "init the group with backend='gloo' (or 'cpu:gloo,cuda:nccl'), or pass a CUDA ShardConfig(device=...)"
        )
    runtime = Runtime(hf, spec, config, comm, device, weights=os.fspath(weights) if weights is not None else None)
    wrapped = ShardedModel(model, runtime)
    if comm.rank == 0:
        logger.info("%s", runtime.memory_plan())
    return wrapped


def _take_over_kbit_checkpointing(hf: nn.Module, spec, config: ShardConfig) -> ShardConfig:
    """peft's ``prepare_model_for_kbit_training`` turns HF gradient checkpointing on for a 4-bit
    base. yashard checkpoints through its own layer hooks (HF's would re-run them in backward), so
    for a 4-bit base it turns HF's off and checkpoints every layer itself
    (``ShardConfig.checkpoint_layers``): what the unsharded model recomputes, the same values. Any
    other model with HF checkpointing on is refused (``partition.validate``)."""
    import dataclasses

    from .patch.spec import get_path

    if not (hf_checkpointing_on(hf) and any(is_params4bit(p) for p in hf.parameters())):
        return config
    (getattr(hf, "activation_checkpointing_disable", None) or hf.gradient_checkpointing_disable)()
    n = len(get_path(hf, spec.layers))
    logger.info("yashard: the 4-bit base has HF gradient checkpointing on (prepare_model_for_kbit_training): "
                "yashard checkpoints its %d layers itself (ShardConfig.checkpoint_layers=%d)", n, n)
    return dataclasses.replace(config, checkpoint_layers=n)


def folder_dtype(hf_config, path) -> torch.dtype:
    """The dtype a folder's config.json names (``dtype``, or ``torch_dtype`` before transformers 5)
    when it is one yashard computes in (fp32, bf16, fp16); fp32 otherwise, with a warning when it
    names another (transformers' ``dtype="auto"`` would compute in a float64 folder's float64)."""
    named = _as_dtype(getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None))
    if named in (torch.float32, torch.bfloat16, torch.float16):
        return named
    if named is not None:
        logger.warning("yashard: %s names dtype %s, which yashard does not compute in; it computes in torch.float32 "
                       "(fp32 master weights, the stored values rounded to fp32): pass dtype=torch.float32 (or "
                       "bfloat16/float16) to choose it and silence this", path, named)
    return torch.float32


def _as_dtype(dtype):
    """``torch.bfloat16`` for ``torch.bfloat16``, ``"bfloat16"`` or ``"torch.bfloat16"``; else as given."""
    if isinstance(dtype, str):
        return getattr(torch, dtype.removeprefix("torch."), dtype)
    return dtype


def _check_local_folder(path) -> None:
    """from_pretrained reads a local folder: name what is wrong before transformers looks on the Hub."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"yashard.from_pretrained reads a local checkpoint folder and {path!r} is not a directory; for a Hub model, "
            "download it first (huggingface_hub.snapshot_download(repo_id)) and pass the folder it returns"
        )
    if not os.path.isfile(os.path.join(path, "config.json")):
        found = sorted(os.listdir(path))
        raise FileNotFoundError(
            f"{path} has no config.json (found: {', '.join(found[:10]) or 'nothing'}); pass the folder "
            "save_pretrained wrote, or build the model yourself and call yashard.shard(model, weights=path)"
        )


# transformers' from_pretrained arguments that from_config has no use for: what each means here
_LOADER_KWARGS = {
    **dict.fromkeys(("device_map", "max_memory", "offload_folder", "offload_state_dict", "offload_buffers"),
                    "places weights on devices; yashard puts every rank's shards on ShardConfig(device=...) (the "
                    "process group's device by default)"),
    **dict.fromkeys(("load_in_8bit", "load_in_4bit"),
                    "is the old spelling of quantization_config; pass quantization_config=BitsAndBytesConfig("
                    "load_in_4bit=True, ...) (yashard shards bitsandbytes 4-bit bases)"),
    "gguf_file": "loads GGUF weights; yashard reads safetensors folders",
    **dict.fromkeys(("tp_plan", "tp_size", "device_mesh"),
                    "shards for tensor parallelism; yashard shards for data parallelism (mesh= for hybrid sharding)"),
    **dict.fromkeys(("revision", "cache_dir", "force_download", "proxies", "token", "resume_download"),
                    "finds files on the Hub; yashard reads the local folder given"),
    "subfolder": "reads a folder inside the one given; pass os.path.join(path, subfolder) as the path",
    **dict.fromkeys(("state_dict", "key_mapping", "output_loading_info", "weights_only"),
                    "changes what is read or returned; yashard reads the folder's safetensors names as stored"),
}
# arguments that only ask for what yashard always does
_LOADER_KWARGS_MET = {"low_cpu_mem_usage": True, "local_files_only": True, "use_safetensors": True}


def _check_loader_kwargs(kwargs: dict) -> None:
    for name in list(kwargs):
        if name in _LOADER_KWARGS_MET:
            value = kwargs.pop(name)
            if name == "use_safetensors" and value is False:
                raise ValueError("yashard.from_pretrained(use_safetensors=False): yashard reads safetensors files only "
                                 "(it never unpickles weights)")
        elif name in _LOADER_KWARGS:
            raise TypeError(f"yashard.from_pretrained({name}=...): in transformers it {_LOADER_KWARGS[name]}; "
                            "leave it out")


def _check_quantization(qc) -> None:
    """The quantisation a from_pretrained may ask for: bitsandbytes 4-bit, named otherwise."""
    method = str(getattr(qc, "quant_method", "") or (qc.get("quant_method") if isinstance(qc, dict) else ""))
    method = method.split(".")[-1].lower().replace("quantizationmethod.", "")
    four = getattr(qc, "load_in_4bit", None) if not isinstance(qc, dict) else qc.get("load_in_4bit")
    if method in ("bitsandbytes", "bits_and_bytes") and four:
        return
    what = ("bitsandbytes 8-bit (load_in_8bit)" if method in ("bitsandbytes", "bits_and_bytes") else
            f"{method or type(qc).__name__} quantisation")
    raise ValueError(f"yashard.from_pretrained(quantization_config=...) asks for {what}; yashard shards "
                     "bitsandbytes 4-bit bases only: pass BitsAndBytesConfig(load_in_4bit=True, ...), or leave "
                     "quantization_config out for float weights")


def _from_pretrained_4bit(path, config, process_group, mesh, peft_config, model_kwargs) -> ShardedModel:
    """A bitsandbytes 4-bit base: every rank loads it with transformers (quantised as it loads, 0.5
    byte per parameter plus its state), applies ``peft_config``, and :func:`shard` keeps its shard of
    each layer's packed bytes."""
    from transformers import AutoModelForCausalLM

    from .collectives import group_backend

    device = config.device if config is not None and config.device is not None else None
    if device is None:  # (as shard() picks it: the current CUDA device under NCCL, else the CPU)
        cuda = "nccl" in group_backend(process_group) and torch.cuda.is_available()
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    model_kwargs.setdefault("dtype", config.param_dtype if config is not None else torch.float32)
    model = AutoModelForCausalLM.from_pretrained(os.fspath(path), device_map={"": device}, local_files_only=True,
                                                 **model_kwargs)
    if peft_config is not None:
        from peft import get_peft_model

        model = get_peft_model(model, peft_config)
    return shard(model, config=config, process_group=process_group, mesh=mesh)


def from_pretrained(path: str | os.PathLike, *, config: ShardConfig | None = None, process_group=None,
                    mesh=None, quantization_config=None, peft_config=None, **model_kwargs) -> ShardedModel:
    """Build the HF causal LM of a local checkpoint folder on the meta device and shard it from the
    folder's safetensors files; no rank ever holds the full model. ``model_kwargs`` go to
    ``AutoModelForCausalLM.from_config`` (e.g. ``attn_implementation="sdpa"``); ``dtype=torch.bfloat16``
    (or float16) computes in that dtype, as ``ShardConfig(param_dtype=...)`` does, with fp32 masters.
    Without ``dtype`` it is ``config.param_dtype`` when a ``config`` is given, else transformers'
    default for ``from_pretrained``: the folder's dtype (``"auto"``) from transformers 5 on (fp32, with a
    warning, for a folder in another dtype, e.g. float64), fp32 before.
    transformers' loading arguments that ask for what yashard always does (``low_cpu_mem_usage``,
    ``local_files_only``, ``use_safetensors=True``) are accepted; the others (``device_map``,
    ``revision``, ...) are refused, naming why.

    ``quantization_config=BitsAndBytesConfig(load_in_4bit=True, ...)`` loads a 4-bit base (QLoRA):
    each rank loads it with transformers, quantised as it loads, and keeps its shard of every layer's
    packed bytes. ``peft_config`` (a ``peft.LoraConfig``) is applied to it before sharding. Other
    quantisations are refused by name."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    _check_local_folder(path)
    if config is not None and not isinstance(config, ShardConfig):
        raise TypeError(
            f"yashard.from_pretrained(config=...) takes a yashard.ShardConfig, got {type(config).__name__}; to build "
            "the model from another HF config, build it on the meta device (with torch.device('meta'): "
            "AutoModelForCausalLM.from_config(hf_config)) and call yashard.shard(model, weights=path)"
        )
    _check_loader_kwargs(model_kwargs)
    if quantization_config is not None:
        _check_quantization(quantization_config)
        return _from_pretrained_4bit(path, config, process_group, mesh, peft_config,
                                     {**model_kwargs, "quantization_config": quantization_config})
    if peft_config is not None:
        raise ValueError(
            "yashard.from_pretrained(peft_config=...) goes with a 4-bit base (quantization_config=...): a float base "
            "is built on the meta device and read from the folder, which holds no adapters. Build the model "
            "(AutoModelForCausalLM.from_pretrained), apply get_peft_model, then call yashard.shard")
    trust = {k: model_kwargs[k] for k in ("trust_remote_code",) if k in model_kwargs}  # (from_config takes it too)
    hf_config = AutoConfig.from_pretrained(os.fspath(path), **trust)
    if "torch_dtype" in model_kwargs:  # (the older name of dtype)
        model_kwargs["dtype"] = model_kwargs.pop("torch_dtype")
    dtype = model_kwargs.get("dtype")
    if dtype is not None and dtype != "auto" and _as_dtype(dtype) not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(
            f"yashard.from_pretrained(dtype={dtype}): yashard computes in float32, bfloat16 or float16 "
            "(ShardConfig.param_dtype) over fp32 master weights; pass one of those, or \"auto\" for the folder's"
        )
    if "dtype" not in model_kwargs:  # a ShardConfig given names the compute dtype itself
        model_kwargs["dtype"] = (config.param_dtype if isinstance(config, ShardConfig) else
                                 "auto" if int(transformers.__version__.split(".")[0]) >= 5 else torch.float32)
    if model_kwargs["dtype"] == "auto":
        model_kwargs["dtype"] = folder_dtype(hf_config, os.fspath(path))
    with torch.device("meta"):  # dtype=torch.bfloat16: computes in bf16 (ShardConfig.param_dtype), fp32 masters
        model = AutoModelForCausalLM.from_config(hf_config, **{"dtype": torch.float32, **model_kwargs})
    if os.path.isfile(os.path.join(os.fspath(path), "generation_config.json")):
        # as transformers' from_pretrained: generate() stops at every EOS id and samples as the folder says
        # (from_config gives the defaults), and export_hf writes it back
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(os.fspath(path))
    return shard(model, config=config, process_group=process_group, mesh=mesh, weights=path)
