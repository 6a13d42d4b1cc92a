"""Tiny random-init HF models for tests (no downloads)."""

from __future__ import annotations

import torch


def tiny_config(family: str = "llama", **overrides):
    from transformers import GemmaConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    base = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                tie_word_embeddings=False, attn_implementation="eager")
    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config,
           "gemma": GemmaConfig}[family]
    if family in ("qwen3", "gemma"):
        base["head_dim"] = 8
    if family == "gemma":  # Gemma ties its embeddings and scales them by sqrt(hidden_size)
        base["tie_word_embeddings"] = True
    base.update(overrides)
    attn = base.pop("attn_implementation")
    cfg = cls(**base)
    cfg._attn_implementation = attn
    return cfg


def build(family: str = "llama", seed: int = 0, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides))
    return model.float()


def batches(steps: int, global_batch: int, seq: int, vocab: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (global_batch, seq), generator=g) for _ in range(steps)]
