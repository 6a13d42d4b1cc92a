"""Rank functions for test_loading.py (module level, so spawned ranks can import them)."""

from __future__ import annotations

import re

import torch

import yashard
from models import tiny_config


def meta_model(family: str, **overrides):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(tiny_config(family, **overrides))


def shard_meta(rank, world, family, overrides, seed):
    """Shard a meta-built model; return its full weights and the RNG draw right after shard()."""
    torch.manual_seed(seed + 1000 * rank)  # ranks differ: rank 0's state must win (sync_module_states)
    torch.manual_seed(seed) if rank == 0 else None
    model = meta_model(family, **overrides)
    sm = yashard.shard(model)
    after = torch.rand(4)
    full = sm.full_state_dict()
    buffers = {k: v.clone() for k, v in sm.module.named_buffers()}
    return dict(params=full, after=after, buffers=buffers)


def shard_folder(rank, world, folder, use_from_pretrained):
    if use_from_pretrained:
        sm = yashard.from_pretrained(folder)
    else:
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32)
        sm = yashard.shard(model, weights=folder)
    ids = torch.arange(12).reshape(2, 6) % 90
    with torch.no_grad():
        logits = sm(input_ids=ids).logits
    return dict(params=sm.full_state_dict(), logits=logits)


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{key}:\s+(\d+)", f.read(), re.M).group(1))


def loading_peak(rank, world, family, overrides, folder):
    """Peak RSS increase while the masters are filled (meta init, or folder when given)."""
    import ctypes

    import yashard.masters as masters

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 64 * 1024)   # M_MMAP_THRESHOLD: large blocks are mmapped and returned on free
    libc.mallopt(-1, 128 * 1024)  # M_TRIM_THRESHOLD
    seen = {}
    inner = masters.materialise

    def measured(*args):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        before = _status_kib("VmRSS")
        out = inner(*args)
        seen["peak"] = (_status_kib("VmHWM") - before) * 1024
        seen["masters"] = sum(t.numel() * t.element_size() for t in out.values())
        return out

    masters.materialise = measured
    try:
        model = meta_model(family, **overrides)
        full_bytes = sum(p.numel() * 4 for p in model.parameters())
        largest = max(p.numel() * 4 for p in model.parameters())
        yashard.shard(model, weights=folder)
    finally:
        masters.materialise = inner
    return dict(seen, full=full_bytes, largest=largest)


def folder_as_transformers_reads_it(rank, world, folder, out):
    """from_pretrained of ``folder``, then export_hf to ``out``: the weights it read, its generation
    config and what the ``yashard`` logger said while reading."""
    import logging

    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("yashard").addHandler(handler)
    try:
        sm = yashard.from_pretrained(folder)
    finally:
        logging.getLogger("yashard").removeHandler(handler)
    gen = sm.generation_config
    yashard.export_hf(sm, out)
    return dict(params=sm.full_state_dict(), eos=gen.eos_token_id, do_sample=gen.do_sample,
                temperature=gen.temperature, said=said, buffers=dict(sm.module.named_buffers()))
