"""Workers of tests/test_peft.py: PEFT LoRA on yashard, and the same LoRA training on one process."""

from __future__ import annotations

import torch
import torch.distributed as dist

import yashard
from models import batches, build

# init_lora_weights=False: lora_B starts random too, so lora_A gets a gradient from step one
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False)
STEPS, GLOBAL_BATCH, SEQ, LR, WD = 4, 4, 8, 1e-2, 0.1


def lora_model(seed: int = 0, **kw):
    """A tiny Llama with LoRA on q_proj and v_proj, the same on every call (adapters included)."""
    from peft import LoraConfig, get_peft_model

    model = build("llama", seed=seed)
    torch.manual_seed(seed + 100)  # the adapters' init
    return get_peft_model(model, LoraConfig(**{**LORA, **kw}))


def adapter_shard(model, world: int) -> int:
    """The adapter group's shard, by the layout's rules: each adapter weight starts at a multiple of
    16 elements, and the shards are cut equal and rounded up to 16 elements."""
    def up(n: int, multiple: int) -> int:
        return (n + multiple - 1) // multiple * multiple

    total = 0
    for p in model.parameters():
        if p.requires_grad:
            total = up(total, 16) + p.numel()
    return up((total + world - 1) // world, 16)


def _data(vocab: int) -> list:
    return batches(STEPS, GLOBAL_BATCH, SEQ, vocab)


def run_lora(rank: int, world: int, adapter_dir: str | None = None, export_dir: str | None = None,
             **shard_kw) -> dict:
    """LoRA on ``world`` ranks: losses, grad norms, adapters, the optimizer state's bytes against
    the plan; then the adapter saved and the model exported (merged). ``shard_kw``: ShardConfig's."""
    pm = lora_model()
    vocab = pm.config.vocab_size
    config = yashard.ShardConfig(**shard_kw)
    sm = yashard.shard(pm, config=config)
    rt = sm.runtime
    opt = torch.optim.AdamW(sm.param_groups(WD), lr=LR)
    losses, norms = [], []
    for batch in _data(vocab):
        local = batch.chunk(world)[rank]
        out = sm(input_ids=local, labels=local)
        out.loss.backward()
        loss = out.loss.detach().clone()
        dist.all_reduce(loss)
        losses.append(loss.item() / world)
        norms.append(sm.clip_grad_norm_(1.0).item())
        opt.step()
        opt.zero_grad()
    moments = [t for st in opt.state.values() for t in st.values() if torch.is_tensor(t) and t.dim() > 0]
    plan = sm.memory_plan()
    probe = _data(vocab)[0]
    with torch.no_grad():
        logits = sm(input_ids=probe).logits
    if adapter_dir is not None:
        yashard.save_adapter(sm, adapter_dir)
    if export_dir is not None:
        yashard.export_hf(sm, export_dir)
    return dict(
        losses=losses, norms=norms, params=sm.full_state_dict(), logits=logits,
        opt_bytes=sum(t.numel() * t.element_size() for t in moments),
        opt_params=[(g["weight_decay"], [p.numel() for p in g["params"]]) for g in opt.param_groups],
        adamw_bytes=plan.adamw_bytes, adamw_formula=plan.adamw_formula,
        trained_units=[u.name for u in rt.units if u.grad_storage is not None],
        adapter_shard=rt.adapters.layout.shard_numel,
        plan=plan.total_bytes,
        allocated=sum(t.numel() * t.element_size() for t in rt.allocated_tensors().values()),
        planned=yashard.plan(lora_model(), world_size=world, config=config, backend="gloo").total_bytes,
    )


def run_lora_configs(rank: int, world: int, configs: list) -> list:
    """:func:`run_lora` under each ShardConfig's keywords in ``configs``."""
    return [run_lora(rank, world, **kw) for kw in configs]


def run_reference() -> dict:
    """The same LoRA training on one process, unsharded, the whole global batch per step."""
    pm = lora_model()
    trained = [p for p in pm.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": trained, "weight_decay": WD}], lr=LR)
    losses, norms = [], []
    for batch in _data(pm.config.vocab_size):
        out = pm(input_ids=batch, labels=batch)
        out.loss.backward()
        losses.append(out.loss.item())
        norms.append(torch.nn.utils.clip_grad_norm_(trained, 1.0).item())
        opt.step()
        opt.zero_grad()
    hf = pm.get_base_model()
    return dict(losses=losses, norms=norms, model=pm,
                params={k: p.detach().clone() for k, p in hf.named_parameters()},
                trainable=sum(p.numel() for p in trained))


def run_peft_after_shard(rank: int, world: int) -> str:
    """get_peft_model applied to a sharded model: the next forward refuses, on every rank."""
    from peft import LoraConfig, get_peft_model

    sm = yashard.shard(build("llama", seed=0))
    get_peft_model(sm.module, LoraConfig(**LORA))
    ids = torch.randint(0, 96, (2, 8))
    try:
        sm(input_ids=ids, labels=ids)
    except RuntimeError as e:
        return str(e)
    return "no error"
