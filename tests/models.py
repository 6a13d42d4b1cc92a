"""Tiny random-init HF models for tests (no downloads)."""

from __future__ import annotations

import torch


# Other HF decoder families "of the same shape" (model.layers / model.embed_tokens / lm_head): each
# with the fields its tiny config needs beyond the shared ones. Mixture-of-experts families get 4
# experts, 2 per token; families whose defaults train with dropout get none (the sharded run and the
# reference draw different masks). RecurrentGemma trains without its KV cache (transformers 4.57 cannot:
# its cache cuts k_proj and v_proj of the attention layers out of the graph, so torch skips them at
# the step while yashard steps them with zero gradients and says so; without the cache 4.57 backs
# through one forward's state twice, unsharded too: left out there). Left out: families whose unsharded gradients change with how the
# batch is split (expert capacity: HunYuan-MoE on transformers 4.57; a zero-gradient bias summed from
# noise: XGLM's k_proj), and those whose parameters are not all in the three modules (DeepSeek-V4,
# Gemma 4: refused by shard(), naming the parameter).
MOE = dict(num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1)
MLA = dict(MOE, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
           head_dim=None, num_key_value_heads=4)  # DeepSeek's latent attention (head_dim: qk_rope_head_dim)
OTHER_FAMILIES = {
    "phi3": {}, "phi": dict(head_dim=None, num_key_value_heads=None), "gemma2": {}, "gemma3_text": {},
    "vaultgemma": {}, "olmo": {}, "olmo2": {}, "olmo3": {}, "flex_olmo": MOE, "granite": {}, "granitemoe": MOE,
    "smollm3": {}, "cohere": {}, "stablelm": {}, "glm": {}, "glm4": {}, "helium": {}, "starcoder2": {},
    "qwen3_moe": MOE, "mixtral": MOE, "jetmoe": MOE, "minimax": MOE, "gpt_oss": MOE, "llama4_text": dict(MOE, intermediate_size_mlp=64),
    "qwen3_next": MOE, "exaone4": {}, "seed_oss": dict(attention_dropout=0.0, residual_dropout=0.0),
    "arcee": {}, "apertus": {}, "ministral": {}, "hunyuan_v1_dense": {}, "ernie4_5": {}, "falcon_h1": {},
    "lfm2": dict(block_multiple_of=16), "bitnet": {}, "doge": dict(num_experts=16), "nemotron": {},
    "zaya": dict(MOE, num_experts_per_tok=1, router_hidden_size=32),
    "deepseek_v2": MLA, "deepseek_v3": MLA, "dots1": MOE, "glm4_moe": MOE, "qwen2_moe": MOE, "olmoe": MOE,
    "phimoe": dict(MOE, router_jitter_noise=0.0), "ernie4_5_moe": MOE,
    "granitemoeshared": MOE, "cohere2": {}, "exaone": {}, "internlm3": {}, "persimmon": {}, "recurrent_gemma": dict(use_cache=False),
    "zamba": dict(use_mamba_kernels=False), "diffllama": {}, "qwen3_5_text": {}, "qwen3_5_moe_text": MOE, "minimax_m2": MOE,
}
OTHER_FAMILIES["qwen3_next"] = dict(MOE, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                                    linear_num_value_heads=4, shared_expert_intermediate_size=32)
OTHER_FAMILIES["falcon_h1"] = dict(mamba_d_ssm=64, mamba_n_heads=8, mamba_d_head=8, mamba_d_state=16,
                                   mamba_chunk_size=16)


def known_families(families) -> list[str]:
    """The ``families`` this transformers release has a config class for (4.x lacks the newer ones)
    and can train (RecurrentGemma: from 5.0 on, see above)."""
    import transformers
    from transformers import CONFIG_MAPPING

    old = int(transformers.__version__.split(".")[0]) < 5
    return [f for f in families if f in CONFIG_MAPPING and not (old and f == "recurrent_gemma")]


def tiny_config(family: str = "llama", **overrides):
    from transformers import AutoConfig, GemmaConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    base = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                tie_word_embeddings=False, attn_implementation="eager")
    named = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config,
             "gemma": GemmaConfig}
    if family in ("qwen3", "gemma") or family in OTHER_FAMILIES:
        base["head_dim"] = 8
    if family == "gemma":  # Gemma ties its embeddings and scales them by sqrt(hidden_size)
        base["tie_word_embeddings"] = True
    if family in OTHER_FAMILIES:  # (special tokens inside the tiny vocabulary)
        base.update(pad_token_id=0, bos_token_id=1, eos_token_id=2, **OTHER_FAMILIES[family])
    base.update(overrides)
    attn = base.pop("attn_implementation")
    base = {k: v for k, v in base.items() if v is not None}
    cfg = named[family](**base) if family in named else AutoConfig.for_model(family, **base)
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
