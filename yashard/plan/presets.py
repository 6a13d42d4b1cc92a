"""Presets for ``yashard.plan``: the shapes of common models as config dicts (no downloads).

The values are those of each model's published ``config.json`` that decide its memory: vocabulary,
hidden and intermediate sizes, layers, attention and key/value heads, and tied embeddings.
"""

from __future__ import annotations

# Shapes of common models (their published config.json values that decide the memory), by name.
_LLAMA3 = dict(model_type="llama", vocab_size=128256, num_key_value_heads=8, max_position_embeddings=8192,
               rope_theta=500000.0, tie_word_embeddings=False, rms_norm_eps=1e-5)
_QWEN25 = dict(model_type="qwen2", vocab_size=152064, max_position_embeddings=32768, rope_theta=1000000.0,
               tie_word_embeddings=False, rms_norm_eps=1e-6)
PRESETS: dict[str, dict] = {
    "llama-3-8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32),
    "llama-3-70b": dict(_LLAMA3, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                        num_attention_heads=64),
    "llama-3.1-405b": dict(_LLAMA3, hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                           num_attention_heads=128, max_position_embeddings=131072),
    "qwen2.5-7b": dict(_QWEN25, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4),
    "qwen2.5-72b": dict(_QWEN25, hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8),
    "mistral-7b": dict(model_type="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       max_position_embeddings=32768, rope_theta=10000.0, tie_word_embeddings=False,
                       rms_norm_eps=1e-5),
}


def preset_config(name: str):
    """The transformers config of preset ``name`` (see :data:`PRESETS`)."""
    from transformers import AutoConfig

    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; the presets are {', '.join(PRESETS)}, or pass a config.json")
    fields = dict(PRESETS[name])
    return AutoConfig.for_model(fields.pop("model_type"), **fields)
