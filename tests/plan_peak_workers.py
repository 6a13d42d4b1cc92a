"""Ranks of ``tests/test_plan_peak.py``: one training step's RSS peak on CPU, as
``recipes/plan_check.py`` measures it (returning malloc, one-time costs paid first, VmHWM reset
through ``/proc/self/clear_refs`` before each phase), for yashard or FSDP2 (wrapped as torchtitan wraps it) on a small Llama."""

from __future__ import annotations

import ctypes
import gc
import re

import torch
import torch.distributed as dist

SHAPE = dict(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=256, tie_word_embeddings=False)
SEQ, MICRO_BATCH = 256, 4


def config():
    from transformers import LlamaConfig

    cfg = LlamaConfig(**SHAPE)
    cfg._attn_implementation = "sdpa"
    return cfg


def _model():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config()).float()


def _kib(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{key}:\s+(\d+)", f.read(), re.M).group(1)) * 1024


def reset_peak() -> bool:
    """Reset this process's RSS high-water mark; False where /proc/self/clear_refs is not writable."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def measure(rank: int, world: int, engine: str) -> dict:
    """Bytes over the RSS before the engine was built: the forward-end increment and the peak of
    the last of three steps (None when VmHWM cannot be reset here)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 64 * 1024)   # M_MMAP_THRESHOLD: large blocks come from mmap and go back on free
    libc.mallopt(-1, 128 * 1024)  # M_TRIM_THRESHOLD
    if not reset_peak():
        return {"forward": None, "peak": None}
    ids = torch.randint(0, SHAPE["vocab_size"], (world * MICRO_BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    ids = ids.chunk(world)[rank]
    warm = _model()  # one-time costs: autograd, kernels' scratch, gloo's first collectives
    warm(input_ids=ids, labels=ids).loss.backward()
    t = torch.ones(2 * world)
    dist.all_reduce(t)
    del warm, t
    gc.collect()
    base = _kib("VmRSS")
    if engine == "yashard":
        import yashard

        model = yashard.shard(_model(), config=yashard.ShardConfig(loss="hf"))  # (the HF loss the planner models)
        opt = torch.optim.AdamW(model.param_groups(0.1), lr=1e-3, fused=True)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        model = _model()
        # as torchtitan wraps it (torchtitan/distributed/fsdp.py:252-265): the embedding alone,
        # [norm, lm_head] kept gathered after forward, each layer, then the root (owning nothing)
        fully_shard(model.model.embed_tokens, mesh=mesh)
        fully_shard([model.model.norm, model.lm_head], mesh=mesh, reshard_after_forward=False)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    for _ in range(3):
        gc.collect()
        start = _kib("VmRSS")
        reset_peak()
        out = model(input_ids=ids, labels=ids)
        forward = _kib("VmRSS") - start
        out.loss.backward()
        del out
        opt.step()
        opt.zero_grad(set_to_none=True)
        peak = _kib("VmHWM") - base
    return {"forward": forward, "peak": peak}
