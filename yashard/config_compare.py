"""Comparing HuggingFace model configs: which fields differ in a way that changes what the model
computes from its weights, or how it trains. Pure functions over dicts (and a config's JSON form);
a checkpoint's load and a HuggingFace folder's load warn with them."""

from __future__ import annotations

import json


def config_dict(hf) -> dict | None:
    """The whole config of the HF model ``hf`` as a dict (defaults included), or None if it has none."""
    cfg = getattr(hf, "config", None)
    if cfg is None or not hasattr(cfg, "to_json_string"):
        return None
    return json.loads(cfg.to_json_string(use_diff=False))


# config fields that do not change what a model computes from its weights, nor how it trains
# (pad_token_id does: it is the embedding's padding_idx, whose row gets no gradient)
_CONFIG_NOISE = {"_name_or_path", "architectures", "transformers_version", "torch_dtype", "dtype", "use_cache",
                 "_attn_implementation", "_attn_implementation_autoset", "attn_implementation", "output_attentions",
                 "output_hidden_states", "return_dict", "bos_token_id", "eos_token_id",
                 "max_position_embeddings", "_commit_hash", "id2label", "label2id", "problem_type", "tokenizer_class"}


def _rope_reads_length(cfg: dict) -> bool:
    """Whether the config's RoPE frequencies depend on max_position_embeddings: dynamic NTK, YaRN
    and LongRoPE scaling read it, Llama 3's when its own original_max_position_embeddings is unset;
    plain and linear RoPE do not."""
    for key in ("rope_parameters", "rope_scaling"):
        rope = cfg.get(key)
        if not isinstance(rope, dict):
            continue
        # (per attention type in some models: {"full_attention": {...}, "sliding_attention": {...}})
        for params in [rope, *(v for v in rope.values() if isinstance(v, dict))]:
            kind = params.get("rope_type", params.get("type"))
            if kind in ("dynamic", "yarn", "longrope") or (
                    kind == "llama3" and not params.get("original_max_position_embeddings")):
                return True
    return False


def config_diff(saved: dict | None, now: dict | None, limit: int = 5) -> list[str]:
    """``field: saved -> now`` for the config fields that differ (those that change what the model
    computes or how it trains; the noise fields above are left out, and max_position_embeddings
    unless the RoPE reads it), at most ``limit``."""
    if not saved or not now:
        return []
    reads_length = _rope_reads_length(saved) or _rope_reads_length(now)
    noise = _CONFIG_NOISE - {"max_position_embeddings"} if reads_length else _CONFIG_NOISE
    keys = sorted(k for k in set(saved) | set(now) if k not in noise and saved.get(k) != now.get(k))
    return [f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in keys[:limit]]
