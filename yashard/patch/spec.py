"""Declarative specs for HuggingFace causal LMs.

A spec names, by attribute path from the top-level model, the module list of decoder layers, the
token embedding, the final norm and the lm_head. Families with the usual HF shape share the generic
spec; a family with another shape adds one entry to :data:`FAMILIES`.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class ModelSpec:
    """Attribute paths (dotted, from the top-level model) of a decoder model's parts."""

    family: str
    layers: str = "model.layers"
    embed: str = "model.embed_tokens"
    final_norm: str = "model.norm"
    lm_head: str = "lm_head"


_GENERIC = ModelSpec("generic")

# model_type (from the HF config) -> spec. Llama-shaped families all use the generic paths; listing
# them documents what is tested.
FAMILIES: dict[str, ModelSpec] = {
    name: ModelSpec(name) for name in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text")
}


def get_path(model: nn.Module, path: str):
    obj = model
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def resolve_spec(model: nn.Module) -> ModelSpec:
    """Return the spec of ``model`` after checking that every path in it exists.

    Raises:
        ValueError: naming what was expected and what the model has instead.
    """
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    spec = FAMILIES.get(model_type, _GENERIC)
    missing = []
    layers = get_path(model, spec.layers)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        missing.append(f"a non-empty nn.ModuleList of decoder layers at '{spec.layers}'")
    for what, path in (("token embedding", spec.embed), ("lm_head", spec.lm_head)):
        if not isinstance(get_path(model, path), nn.Module):
            missing.append(f"a {what} module at '{path}'")
    if missing:
        children = ", ".join(f"{n} ({type(m).__name__})" for n, m in model.named_children()) or "none"
        inner = get_path(model, "model")
        if isinstance(inner, nn.Module):
            children += "; model.* children: " + (
                ", ".join(f"{n} ({type(m).__name__})" for n, m in inner.named_children()) or "none"
            )
        raise ValueError(
            f"yashard cannot find the decoder structure of {type(model).__name__} "
            f"(model_type={model_type!r}): expected {'; '.join(missing)}. "
            f"Found top-level children: {children}. Pass an HF causal LM "
            "(AutoModelForCausalLM) of the Llama shape, or add a ModelSpec to yashard.patch.FAMILIES."
        )
    return spec
