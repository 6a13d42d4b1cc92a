"""PEFT adapters of a sharded ``peft.PeftModel``: saving them, and merging LoRA for ``export_hf``.

:func:`save_adapter` writes what ``PeftModel.save_pretrained`` writes (``adapter_config.json`` and
``adapter_model.safetensors`` under peft's key names), from the master shards: every rank joins the
gathers of the units that hold adapter weights (usually only the adapter group), rank 0 writes.
``PeftModel.from_pretrained(base_model, path)`` then loads the trained adapter bitwise.

:func:`lora_merge_plan` tells ``export_hf`` how a LoRA model's folder is written as the plain HF
model's: each base layer's weight under its HF name (``q_proj.weight``, not
``q_proj.base_layer.weight``) with the active LoRA adapters merged in, as peft's
``merge_and_unload`` computes it, and no adapter weight.
"""

from __future__ import annotations

import contextlib
import copy
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from .call_gate import enter
from .checkpoint import CheckpointError, agree
from .masters import gather_whole
from .partition import base_model_of
from .saved_state import persistent_buffers
from .sharded_model import runtime_of

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
# what the names of a PEFT model's parameters hold that the plain HF model's do not
_PEFT_MARKERS = (".base_layer.", ".lora_", ".modules_to_save.", ".original_module.", ".trainable_tokens_")


def peft_model_of(model, what: str) -> tuple[nn.Module, str]:
    """The PEFT model a :class:`~yashard.sharded_model.ShardedModel` calls, and the prefix of its HF
    model's names in it (``"base_model.model."``)."""
    rt = runtime_of(model, what)
    peft_model = model.module
    if base_model_of(peft_model) is peft_model or not hasattr(peft_model, "peft_config"):
        raise TypeError(
            f"{what} needs a sharded peft.PeftModel, and this model is a plain {type(peft_model).__name__}: "
            "apply get_peft_model before sharding and shard the PeftModel itself "
            "(yashard.shard(get_peft_model(model, lora_config)))"
        )
    prefix = next(name for name, m in peft_model.named_modules() if m is rt.model)
    return peft_model, prefix + "."


def gather_units(rt, units) -> dict[str, torch.Tensor]:
    """Full fp32 tensors of ``units`` by every HF name (a collective: every rank, the same units)."""
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for u in units:
            flat = gather_whole(rt.comm, u, u.master, "adapter weights")
            for entry, fqns in zip(u.layout.entries, u.fqns):
                t = flat[entry.offset:entry.end].view(entry.shape).clone()
                for fqn in fqns:
                    out[fqn] = t
    return out


def _is_modules_to_save(module: nn.Module) -> bool:
    """peft's ``ModulesToSaveWrapper`` (read by its attributes: peft is not imported here)."""
    return hasattr(module, "original_module") and hasattr(module, "modules_to_save")


@contextlib.contextmanager
def _modules_to_save_by_name(peft_model: nn.Module):
    """peft picks a ``modules_to_save`` copy's tensors through ``module.state_dict()``, which the
    sharded modules refuse (they hold no parameter since shard()). Within this context each
    wrapper picks them from the state dict peft passes it by name instead: every
    ``modules_to_save.<adapter>.<name>`` key, stored as ``<name>`` (what peft 0.22 saves)."""
    wrappers = [m for m in peft_model.modules() if _is_modules_to_save(m)]

    def picker(module):
        def adapter_state_dict(adapter_name, state_dict):
            if adapter_name not in getattr(module, "_adapters", module.modules_to_save):
                return {}
            head = f"modules_to_save.{adapter_name}."
            return {k.removeprefix(head): v for k, v in state_dict.items() if k.startswith(head)}
        return adapter_state_dict

    for m in wrappers:
        m.__dict__["adapter_state_dict"] = picker(m)
    try:
        yield
    finally:
        for m in wrappers:
            m.__dict__.pop("adapter_state_dict", None)


def adapter_state_dict(model, adapter_name: str = "default", save_embedding_layers="auto") -> dict[str, torch.Tensor]:
    """The adapter ``adapter_name`` as ``PeftModel.save_pretrained`` stores it: peft's key names
    (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``), full fp32 tensors.
    Collective: every rank calls it and gets the tensors; only the units holding them are gathered."""
    from peft import get_peft_model_state_dict

    rt = runtime_of(model, "adapter_state_dict")
    peft_model, prefix = peft_model_of(model, "adapter_state_dict")
    enter(rt.comm, "adapter_state_dict")
    if adapter_name not in peft_model.peft_config:
        raise ValueError(f"adapter {adapter_name!r} is not one of this model's: {sorted(peft_model.peft_config)}")
    # Which tensors peft keeps for this adapter, asked with placeholders (peft decides by name), so
    # that only the units holding them are gathered.
    placeholders = {prefix + fqn: torch.empty(e.shape, device="meta")
                    for u in rt.units for e, fqns in zip(u.layout.entries, u.fqns) for fqn in fqns}
    placeholders.update({prefix + n: b for n, b in persistent_buffers(rt.model)})
    with _modules_to_save_by_name(peft_model):
        picked = get_peft_model_state_dict(peft_model, state_dict=placeholders, adapter_name=adapter_name,
                                           save_embedding_layers=save_embedding_layers)
    source = {id(t): k for k, t in placeholders.items()}
    wanted = {source[id(t)] for t in picked.values() if id(t) in source}
    if all(id(t) in source for t in picked.values()):
        units = [u for u in rt.units if any(prefix + f in wanted for fqns in u.fqns for f in fqns)]
    else:  # (peft made a tensor of its own from one: it may read any)
        units = list(rt.units)
    full = {prefix + k: v for k, v in gather_units(rt, units).items()}
    state = {k: full.get(k, t) for k, t in placeholders.items()}
    with _modules_to_save_by_name(peft_model):
        out = get_peft_model_state_dict(peft_model, state_dict=state, adapter_name=adapter_name,
                                        save_embedding_layers=save_embedding_layers)
    meta = [k for k, t in out.items() if t.is_meta]
    if meta:  # pragma: no cover - peft read a unit this function did not gather
        raise RuntimeError(f"adapter_state_dict: {meta[0]} was not gathered")
    return out


def save_adapter(model, path: str | os.PathLike, *, selected_adapters: list[str] | None = None,
                 save_embedding_layers="auto") -> Path:
    """Write the PEFT adapters of a sharded ``PeftModel`` as ``PeftModel.save_pretrained`` does:
    ``path/adapter_config.json`` and ``path/adapter_model.safetensors`` (adapters other than
    ``"default"`` in ``path/<name>/``), under peft's key names, in fp32, bitwise the trained masters.
    ``PeftModel.from_pretrained(base_model, path)`` loads them. Collective: every rank calls it;
    rank 0 writes (each file written aside, then renamed into place). Returns ``path``."""
    from safetensors.torch import save_file

    peft_model, _ = peft_model_of(model, "yashard.save_adapter")
    rt = model.runtime
    enter(rt.comm, "save_adapter")
    names = list(peft_model.peft_config) if selected_adapters is None else list(selected_adapters)
    dest = Path(path)
    for name in names:
        tensors = adapter_state_dict(model, name, save_embedding_layers)
        err = None
        if rt.comm.rank == 0:
            try:
                folder = dest if name == "default" else dest / name
                folder.mkdir(parents=True, exist_ok=True)
                tmp = folder / f".{ADAPTER_WEIGHTS}.yashard-tmp"
                save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"format": "pt"})
                os.replace(tmp, folder / ADAPTER_WEIGHTS)
                cfg = copy.deepcopy(peft_model.peft_config[name])
                if cfg.base_model_name_or_path is None:  # (as peft: the base model's own path, if it has one)
                    cfg.base_model_name_or_path = rt.model.__dict__.get("name_or_path", None)
                cfg.inference_mode = True
                cfg.save_pretrained(str(folder))
            except Exception as e:  # noqa: BLE001 - shared with every rank by agree
                err = e
        agree(rt.comm, "save_adapter", err)
    return dest


# ------------------------------------------------------------------------------------------------
# export_hf of a LoRA model: the plain HF model's folder, the adapters merged


@dataclass
class LoraMerge:
    """How ``export_hf`` writes a PEFT model's HF model as the plain HF model."""

    renamed: dict[str, str | None] = field(default_factory=dict)  # PEFT name -> HF name (None: not stored)
    # HF name of a base weight -> [(lora_A name, lora_B name, scaling, fan_in_fan_out)] (PEFT names)
    merges: dict[str, list[tuple[str, str, float, bool]]] = field(default_factory=dict)

    @property
    def needed(self) -> set[str]:
        """The adapter weights the merges read."""
        return {n for ms in self.merges.values() for a, b, _, _ in ms for n in (a, b)}

    def stored_name(self, name: str) -> str | None:
        return self.renamed.get(name, name)

    def merged(self, name: str, weight: torch.Tensor, adapters: dict[str, torch.Tensor]) -> torch.Tensor:
        """``weight`` (the HF name ``name``) with its active adapters merged in, as peft's
        ``merge_and_unload`` computes it: ``W + transpose(B @ A) * scaling``, adapter by adapter, in
        fp32 (``weight`` and the adapters are gathered in fp32: :func:`yashard.masters.gather_whole`)."""
        if name not in self.merges:
            return weight
        out = weight.clone()
        for a, b, scaling, fan_in_fan_out in self.merges[name]:
            delta = adapters[b] @ adapters[a]
            out += (delta.T if fan_in_fan_out else delta) * scaling
        return out


def _refuse_merge(name: str, why: str) -> None:
    raise NotImplementedError(
        f"export_hf of a PEFT model merges LoRA adapters of linear layers into their base weights, and {name} "
        f"{why}. Save the adapter with yashard.save_adapter(model, path) instead (PeftModel.from_pretrained loads it)"
    )


def lora_merge_plan(hf: nn.Module, names: list[str]) -> LoraMerge | None:
    """How to export ``hf`` (a PEFT model's HF model, whose parameters ``names`` are sharded) as the
    plain HF model; None when it holds no PEFT layer. Raises ``NotImplementedError`` for a PEFT
    layer it cannot merge exactly."""
    plan = LoraMerge()
    found = False
    for mod_name, module in hf.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        if _is_modules_to_save(module):
            found = True
            _plan_modules_to_save(plan, module, prefix, names)
            continue
        kinds = getattr(type(module), "adapter_layer_names", None)
        if not isinstance(kinds, tuple):
            continue
        found = True
        base = module._modules.get("base_layer")
        if "lora_A" not in kinds or not isinstance(base, nn.Linear):
            _refuse_merge(mod_name, f"is a {type(module).__name__}, not LoRA on an nn.Linear")
        adapter_prefixes = tuple(f"{prefix}{sub}." for sub in kinds)
        for name in names:  # (the modules hold no parameter since shard(): their names are the units')
            if name.startswith(adapter_prefixes):  # every adapter weight: not stored
                plan.renamed[name] = None
            elif name.startswith(f"{prefix}base_layer."):
                plan.renamed[name] = prefix + name.removeprefix(f"{prefix}base_layer.")
        if getattr(module, "disable_adapters", False):
            continue
        merges = []
        for adapter in module.active_adapters:
            if adapter not in module.lora_A:
                continue
            if module.use_dora.get(adapter) or getattr(module, "lora_bias", {}).get(adapter):
                _refuse_merge(mod_name, f"has a DoRA or bias adapter ({adapter!r})")
            merges.append((f"{prefix}lora_A.{adapter}.weight", f"{prefix}lora_B.{adapter}.weight",
                           module.scaling[adapter], bool(getattr(module, "fan_in_fan_out", False))))
        if merges:
            plan.merges[f"{prefix}weight"] = merges
    if not found:
        return None
    return plan


def _plan_modules_to_save(plan: LoraMerge, module: nn.Module, prefix: str, names: list[str]) -> None:
    """A ``modules_to_save`` wrapper is written as the module its forward calls: the active
    adapter's trained copy under the plain name (``lm_head.weight``), or the original module
    while the adapters are disabled or none of its copies is active; the other copies are not
    stored."""
    active = list(getattr(module, "active_adapters", []) or [])
    use = None if getattr(module, "disable_adapters", False) or not active or active[0] not in module.modules_to_save \
        else f"modules_to_save.{active[0]}."
    for name in names:
        if not name.startswith(prefix):
            continue
        rest = name.removeprefix(prefix)
        if use is None and rest.startswith("original_module."):
            plan.renamed[name] = prefix + rest.removeprefix("original_module.")
        elif use is not None and rest.startswith(use):
            plan.renamed[name] = prefix + rest.removeprefix(use)
        elif rest.startswith(("original_module.", "modules_to_save.")):
            plan.renamed[name] = None


def plain_name(name: str) -> str:
    """The plain HF name a PEFT wrapper's weight stands for (``lm_head.base_layer.weight``,
    ``lm_head.original_module.weight`` -> ``lm_head.weight``)."""
    return name.replace(".base_layer.", ".").replace(".original_module.", ".")


def check_plain_names(names) -> None:
    """Refuse to write a PEFT name into an HF folder: ``from_pretrained`` would not load it and
    would initialise the weight it stands for at random, without an error."""
    for name in names:
        if any(m in f".{name}" for m in _PEFT_MARKERS):
            raise CheckpointError(
                f"export_hf would store {name}, a PEFT name that AutoModelForCausalLM.from_pretrained does not load "
                "(it would initialise that weight at random). Save the adapter with yashard.save_adapter(model, path)"
            )


def check_no_peft_names(names) -> None:
    """Refuse a model whose module tree has no PEFT layer while its sharded weights still carry
    PEFT names: ``unload()`` or ``merge_and_unload()`` ran after ``shard()`` and swapped modules
    the sharded weights do not follow (the folder would hold ``base_layer`` and ``lora_`` names,
    which ``from_pretrained`` skips, initialising those weights at random)."""
    for name in names:
        if any(m in f".{name}" for m in _PEFT_MARKERS):
            raise CheckpointError(
                f"export_hf: the sharded weights hold the PEFT name {name}, but the model's modules hold no PEFT "
                "layer: unload() or merge_and_unload() was called after yashard.shard, which swaps modules and leaves "
                "the sharded weights as they were. Do not unload a sharded PEFT model: yashard.export_hf(model, path) "
                "of the PeftModel itself writes the plain model with the active adapters merged (as merge_and_unload); "
                "to export without the adapters, call it inside `with model.module.disable_adapter():`"
            )
