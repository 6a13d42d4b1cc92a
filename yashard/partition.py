"""Which unit each parameter belongs to, checked before anything in the model is changed.

:func:`partition` assigns every parameter of the HF model to exactly one unit: the embedding, one
decoder layer, the lm_head, the norm group of all 1-D parameters, or the adapter group of the
trainable PEFT adapter weights (tied input/output embeddings are one parameter of the embedding
unit). :func:`validate` refuses models yashard cannot shard as given, and :func:`check_same_model`
refuses ranks that shard different models. :func:`base_model_of` finds the HF model inside a PEFT
model.
"""

from __future__ import annotations

import dataclasses
import zlib

from torch import nn

from . import bnb4
from .collectives import Comm
from .config import ShardConfig
from .norm_group import is_small_param
from .patch.spec import ModelSpec, get_path


def validate(model: nn.Module, spec: ModelSpec, config: ShardConfig) -> None:
    """Checks that need the model, run before anything in it is changed."""
    if getattr(model, "_yashard_sharded", False):
        raise ValueError(
            "model was already sharded by yashard.shard (its parameters now live in that ShardedModel); "
            "use the ShardedModel it returned"
        )
    wrapped = other_sharding(model)
    if wrapped is not None:
        raise ValueError(
            f"the model is already distributed by {wrapped}: yashard shards a plain HF model itself. Build the "
            "model without it (no fully_shard / FSDP / DeepSpeed / DTensor parameters) and pass that to yashard.shard"
        )
    other = other_quantization(model)
    if other is not None:
        raise ValueError(
            f"the model is quantised with {other}; yashard shards bitsandbytes 4-bit bases only (QLoRA: "
            "BitsAndBytesConfig(load_in_4bit=True)). Load the base in 4-bit, or unquantised (bf16/fp32)")
    four_bit = any(bnb4.is_params4bit(p) for p in model.parameters())
    if four_bit:
        check_packed(model, partition(model, spec), config)
    n_layers = len(get_path(model, spec.layers))
    ckpt = config.checkpoint_layers
    if ckpt > n_layers:
        raise ValueError(
            f"ShardConfig.checkpoint_layers={ckpt} but the model has {n_layers} decoder layers; "
            f"use a value between 0 and {n_layers}"
        )
    # (a 4-bit base's: prepare_model_for_kbit_training's, which shard() takes over, api._take_over_kbit_checkpointing)
    if hf_checkpointing_on(model) and not four_bit:
        raise ValueError(
            "the model has HF activation checkpointing enabled (activation_checkpointing_enable() / "
            "gradient_checkpointing_enable()); it would re-run yashard's layer hooks during backward. "
            "Turn it off (model.gradient_checkpointing_disable()) and use ShardConfig(checkpoint_layers=N) instead"
        )


def other_sharding(model: nn.Module) -> str | None:
    """What already distributes ``model``'s parameters, if anything does: FSDP2 (``fully_shard``),
    FSDP1, DeepSpeed ZeRO-3, or DTensor parameters (tensor parallelism)."""
    from torch.distributed.tensor import DTensor

    for name, m in model.named_modules():
        kind = type(m).__name__
        if kind.startswith("FSDP") or kind == "FullyShardedDataParallel":
            return f"FSDP ({kind} at {name or 'the root'})"
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            return f"DTensor parameters ({name}: FSDP2's fully_shard or tensor parallelism)"
        if hasattr(p, "ds_id"):
            return f"DeepSpeed ZeRO-3 ({name} is partitioned)"
    return None


def base_model_of(model: nn.Module) -> nn.Module:
    """The HF model a PEFT model wraps (``peft.PeftModel``: its ``get_base_model()``, one of its
    submodules); any other model itself."""
    get = getattr(type(model), "get_base_model", None)
    if not callable(get) or not type(model).__module__.startswith("peft."):
        return model
    base = model.get_base_model()
    if base is model or not any(m is base for m in model.modules()):
        return model
    return base


def float_param_dtypes(model: nn.Module):
    """The dtypes of ``model``'s floating-point parameters, 4-bit weights aside (their storage dtype
    holds packed bytes): what the default compute dtype is read from (``config.low_precision_dtype``)."""
    return (p.dtype for p in model.parameters() if p.is_floating_point() and not bnb4.is_params4bit(p))


def hf_checkpointing_on(model: nn.Module) -> bool:
    """Whether HF's own activation (gradient) checkpointing is enabled on ``model``."""
    flags = [f for f in ("is_activation_checkpointing", "is_gradient_checkpointing") if hasattr(type(model), f)]
    return bool(flags) and bool(getattr(model, flags[0]))


def adapter_weights(model: nn.Module) -> set[int]:
    """``id()`` of every parameter held by a PEFT tuner layer's adapter modules (``lora_A``,
    ``lora_B``, ``lora_embedding_A``, ...): a module whose class lists them in
    ``adapter_layer_names``, as peft's ``BaseTunerLayer`` does. Only the names are read: peft is
    not imported."""
    out: set[int] = set()
    for module in model.modules():
        names = getattr(type(module), "adapter_layer_names", None)
        if not isinstance(names, tuple):
            continue
        for name in names:
            sub = module._modules.get(name)
            if sub is not None:
                out.update(id(p) for p in sub.parameters())
    return out


# PEFT methods whose tuner reads or calls what shard() replaces: (peft_type, why, fix)
_UNSUPPORTED_PEFT = {
    "ADALORA": ("AdaLoraModel.forward calls the HF model's forward itself, and its rank allocator "
                "(update_and_allocate) reads each adapter parameter's .grad, which yashard keeps in flat shards",
                "train with LoraConfig (LoRA or DoRA: use_dora=True) instead, or train AdaLoRA unsharded"),
    "VERA": ("VeRA's shared random projections (vera_A, vera_B) are buffers outside the adapter weights, and "
             "saving the adapter needs them (save_projection)",
             "train with LoraConfig (LoRA or DoRA: use_dora=True) instead, or train VeRA unsharded"),
}


def check_peft_method(model: nn.Module) -> None:
    """Refuse, before anything is changed, a PEFT model whose method yashard cannot shard
    correctly (:data:`_UNSUPPORTED_PEFT`). Reads ``model.peft_config`` only: peft is not imported."""
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict) or not type(model).__module__.startswith("peft."):
        return
    for name, cfg in configs.items():
        kind = str(getattr(getattr(cfg, "peft_type", None), "value", getattr(cfg, "peft_type", "")))
        if kind in _UNSUPPORTED_PEFT:
            why, fix = _UNSUPPORTED_PEFT[kind]
            raise NotImplementedError(
                f"yashard.shard does not support the PEFT method {kind} (adapter {name!r}): {why}. Fix: {fix}")


def partition(model: nn.Module, spec: ModelSpec) -> dict[str, list]:
    """Assign every parameter to exactly one unit; returns ``{unit_key: [(param, locs, fqns)]}``.

    The adapter weights of PEFT tuner layers with two or more dimensions form the unit
    ``"adapters"``, gathered and reduced like the norm group: the decoder layers then hold only
    frozen weights, with no gradient buffer, reduction or optimizer state. The weights of an
    adapter that does not train (a second, inactive one) join that unit as its frozen entries, so
    their master stays fp32 under a 16-bit ``param_dtype`` (``save_adapter`` writes them as peft
    does)."""
    layers = get_path(model, spec.layers)
    owners: list[tuple[str, nn.Module]] = [("embed", get_path(model, spec.embed))]
    owners += [(f"layer_{i}", layer) for i, layer in enumerate(layers)]
    owners.append(("lm_head", get_path(model, spec.lm_head)))

    # Every (module, attr) location of every parameter, tied parameters seen under all names.
    locations: dict[int, tuple[nn.Parameter, list, list]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for attr, p in module._parameters.items():
            if p is None:
                continue
            fqn = f"{mod_name}.{attr}" if mod_name else attr
            rec = locations.setdefault(id(p), (p, [], []))
            if (module, attr) not in [(m, a) for m, a in rec[1]]:
                rec[1].append((module, attr))
            if fqn not in rec[2]:
                rec[2].append(fqn)
    for p, _, fqns in locations.values():
        if not p.is_floating_point() and not bnb4.is_4bit(p):
            raise ValueError(
                f"parameter {fqns[0]} has dtype {p.dtype}; yashard shards floating-point parameters only: "
                "register it as a buffer (module.register_buffer) if it is not trained"
            )

    owner_of_module = {}
    for key, root in owners:
        for m in root.modules():
            owner_of_module.setdefault(id(m), key)
    adapters = adapter_weights(model)
    groups: dict[str, list] = {key: [] for key, _ in owners}
    groups["adapters"] = []
    groups["small"] = []
    for p, locs, fqns in locations.values():
        if is_small_param(p):
            groups["small"].append((p, locs, fqns))
            continue
        if id(p) in adapters:  # (an inactive adapter too: fp32 like the trained one, as peft saves it)
            groups["adapters"].append((p, locs, fqns))
            continue
        keys = {owner_of_module.get(id(m)) for m, _ in locs}
        keys.discard(None)
        if not keys:
            raise ValueError(
                f"parameter {fqns[0]} (shape {tuple(p.shape)}) is outside the decoder layers "
                f"('{spec.layers}'), the embedding ('{spec.embed}') and the lm_head ('{spec.lm_head}'); "
                "yashard cannot shard it. Move it into one of those modules, or register it as a buffer "
                "if it is not trained."
            )
        if keys == {"embed", "lm_head"}:      # tied input/output embedding: one unit, two names
            groups["embed"].append((p, locs, fqns))
        elif len(keys) > 1:
            raise ValueError(
                f"parameter {fqns[0]} is also {', '.join(fqns[1:]) or 'used by another unit'}; yashard "
                "supports sharing only between the embedding and the lm_head (tied embeddings): untie it "
                "(assign a clone to one of them) before yashard.shard"
            )
        else:
            groups[keys.pop()].append((p, locs, fqns))
    return {k: v for k, v in groups.items() if v}


def packed_units(groups: dict[str, list]) -> set[str]:
    """The units of bitsandbytes 4-bit weights (byte units: :mod:`yashard.bnb4`)."""
    return {key for key, members in groups.items() if any(bnb4.is_4bit(p) for p, _, _ in members)}


def other_quantization(model: nn.Module) -> str | None:
    """The quantisation yashard does not shard that ``model`` holds, named, with where; else None."""
    for name, m in model.named_modules():
        kind = bnb4.OTHER_QUANTIZED.get(type(m).__name__)
        if kind is not None:
            return f"{kind} ({type(m).__name__} at {name or 'the root'})"
        for attr, p in m._parameters.items():
            if p is None:
                continue
            kind = bnb4.OTHER_QUANTIZED.get(type(p).__name__)
            if kind is None and bnb4.is_params4bit(p) and not bnb4.is_4bit(p):
                kind = "a bitsandbytes 4-bit weight not quantised yet (no quant_state: move the model to its device first)"
            if kind is not None:
                return f"{kind} ({type(p).__name__} {name}.{attr})"
    return None


def check_packed(model: nn.Module, groups: dict[str, list], config: ShardConfig) -> None:
    """What yashard refuses of a 4-bit base: a 4-bit weight anywhere but in a decoder layer whose weights with two or more dimensions are all
    4-bit and frozen (QLoRA's frozen base, in byte units), and the settings that read a layer slot
    as ``param_dtype`` elements."""
    packed = packed_units(groups)
    if not packed:
        return
    for key in packed:
        for p, _, fqns in groups[key]:
            if not key.startswith("layer_"):
                raise ValueError(
                    f"{fqns[0]} is a 4-bit weight outside the decoder layers; yashard shards 4-bit weights of the "
                    "decoder layers only: keep the embedding and the lm_head unquantised (transformers does by "
                    "default; llm_int8_skip_modules=['lm_head'])")
            if not bnb4.is_4bit(p):
                raise ValueError(
                    f"{fqns[0]} is not 4-bit but shares its decoder layer with 4-bit weights; yashard holds a 4-bit "
                    "layer as bytes: quantise every linear layer of the decoder layers (leave "
                    "llm_int8_skip_modules to the lm_head)")
            if p.requires_grad:
                raise ValueError(f"{fqns[0]} is a 4-bit weight that requires grad; 4-bit weights are frozen: "
                                 "train adapters on them (peft's get_peft_model)")
    plain = [k for k in groups if k.startswith("layer_") and k not in packed]
    if plain:
        raise ValueError(
            f"decoder layer {plain[0].split('_')[1]} has no 4-bit weight while others have; yashard's layer slots hold "
            "either bytes or param_dtype elements: quantise every decoder layer or none")
    what = ("quantized_weights (qwZ)" if config.quantized_weights else
            "secondary_group_size (hpZ)" if config.secondary_group_size is not None else
            "share_outer_slot=True" if config.share_outer_slot else None)
    if what is not None:
        raise ValueError(f"ShardConfig {what} does not work with a 4-bit base: its layers are gathered as packed "
                         "bytes already. Leave it out")


def check_same_model(comm: Comm, config: ShardConfig, groups: dict[str, list]) -> None:
    """Every rank must shard the same model with the same settings: compare a digest of every
    parameter's name, shape and dtype and of the ShardConfig (its device aside), and on a
    mismatch name the first difference. Without this, ranks would issue collectives of different
    sizes and fail later, in gloo or NCCL, without naming the cause."""
    cfg = {f.name: repr(getattr(config, f.name)) for f in dataclasses.fields(config) if f.name != "device"}
    desc = [("ShardConfig", sorted(cfg.items()))] + [
        (key, [(fqns[0], tuple(p.shape), str(p.dtype)) + (() if p.requires_grad else ("frozen",))
               for p, _, fqns in members]) for key, members in groups.items()]
    digests = comm.all_gather_object(zlib.crc32(repr(desc).encode()), "yashard.shard: same model on every rank")
    if len(set(digests)) == 1:
        return
    every = comm.all_gather_object(desc, "yashard.shard: the models of the ranks")
    r = next(i for i, d in enumerate(digests) if d != digests[0])
    ours, theirs = dict(every[0]), dict(every[r])
    only_one = [k for k in theirs if k not in ours] + [k for k in ours if k not in theirs]  # (layer counts)
    where = only_one[0] if only_one else next(k for k in ours if ours[k] != theirs[k])
    a, b = ours.get(where, []), theirs.get(where, [])
    first = next(((x, y) for x, y in zip(a, b) if x != y), (a[len(b)] if len(a) > len(b) else None,
                                                             b[len(a)] if len(b) > len(a) else None))
    raise ValueError(
        f"the ranks are sharding different models: in {where}, rank 0 has {first[0]} where rank {r} has "
        f"{first[1]}. Every rank must build the same model (same config, same code, the same parameters "
        "frozen) and pass the same ShardConfig (its device aside) to yashard.shard"
    )
