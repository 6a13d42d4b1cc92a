"""Model specs: where the decoder layers, embedding, final norm and lm_head of a model live."""

from .spec import ModelSpec, resolve_spec, FAMILIES

__all__ = ["ModelSpec", "resolve_spec", "FAMILIES"]
