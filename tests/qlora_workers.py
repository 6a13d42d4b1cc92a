"""Workers of tests/test_qlora.py: QLoRA (LoRA on a bitsandbytes 4-bit base) sharded by yashard, and
the same training on one process, unsharded."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import yashard
from models import batches

# hidden sizes multiples of bitsandbytes' block of 64; init_lora_weights=False: lora_B starts random
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0,
            init_lora_weights=False)
STEPS, GLOBAL_BATCH, SEQ, LR, WD = 3, 6, 8, 1e-2, 0.1
# AdamW's eps: its first step moves every element by lr * g / (|g| + eps), so with torch's 1e-8 an
# element whose gradient is near 0 moves by +-lr on the sign of rounding noise (bf16 compute: several
# elements of a layer). 1e-4 keeps such elements near still, so the comparison sees the gradients.
EPS = 1e-4
# (name, quant storage, double quantisation, compute dtype, prepare_model_for_kbit_training)
VARIANTS = {
    "u8": (torch.uint8, False, torch.float32, False),
    "u8-dq": (torch.uint8, True, torch.float32, False),
    "bf16-dq-prepared": (torch.bfloat16, True, torch.bfloat16, True),
    "bf16": (torch.bfloat16, False, torch.bfloat16, True),
    "u8-dq-prepared": (torch.uint8, True, torch.float32, True),
}


def save_tiny(path: str) -> str:
    """A tiny Llama folder (2 layers, hidden 64) for the 4-bit loads."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
                      attn_implementation="eager")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def bnb_config(variant: str):
    from transformers import BitsAndBytesConfig

    storage, dq, compute, _ = VARIANTS[variant]
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=dq,
                              bnb_4bit_quant_storage=storage, bnb_4bit_compute_dtype=compute)


def qlora_model(folder: str, variant: str):
    """The 4-bit base with LoRA, the same on every call (adapters included); the prepared variants
    through peft's prepare_model_for_kbit_training (non-4-bit weights in fp32, gradient
    checkpointing on)."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(folder, quantization_config=bnb_config(variant), dtype=torch.float32)
    if VARIANTS[variant][3]:
        base = prepare_model_for_kbit_training(base)
    torch.manual_seed(100)
    return get_peft_model(base, LoraConfig(**LORA))


def _data():
    return batches(STEPS, GLOBAL_BATCH, SEQ, 96)


def _adapters(model) -> dict:
    return {k: p.detach().float().clone() for k, p in model.named_parameters() if ".lora_" in k}


def train_reference(folder: str, variant: str) -> dict:
    """Single-process QLoRA: the whole global batch per step."""
    pm = qlora_model(folder, variant)
    trained = [p for p in pm.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": trained, "weight_decay": WD}], lr=LR, eps=EPS)
    losses, norms, steps = [], [], []
    pm.train()
    for batch in _data():
        out = pm(input_ids=batch, labels=batch)
        out.loss.backward()
        losses.append(out.loss.item())
        norms.append(torch.nn.utils.clip_grad_norm_(trained, 1.0).item())
        opt.step()
        opt.zero_grad()
        steps.append({k: v for k, v in _adapters(pm.get_base_model()).items()})
    pm.eval()
    with torch.no_grad():
        logits = pm(input_ids=_data()[0]).logits.float()
    return dict(losses=losses, norms=norms, steps=steps, logits=logits)


def train_sharded(rank: int, world: int, folder: str, variant: str, adapter_dir: str | None = None,
                  **shard_kw) -> dict:
    """The same QLoRA on ``world`` ranks: per-step losses, norms and adapters, the plan against what
    the runtime holds, the bytes a layer's gather moves, the optimizer's state."""
    pm = qlora_model(folder, variant)
    before = {n: (p.detach().clone(), p.quant_state) for n, p in pm.get_base_model().named_parameters()
              if type(p).__name__ == "Params4bit"}
    sm = yashard.shard(pm, config=yashard.ShardConfig(**shard_kw) if shard_kw else None)
    rt = sm.runtime
    rt.comm.log.enabled = True
    opt = torch.optim.AdamW(sm.param_groups(WD), lr=LR, eps=EPS)
    losses, norms, steps = [], [], []
    sm.train()
    for batch in _data():
        local = batch.chunk(world)[rank]
        out = sm(input_ids=local, labels=local)
        out.loss.backward()
        loss = out.loss.detach().clone() * local.shape[0]
        dist.all_reduce(loss)
        losses.append(loss.item() / batch.shape[0])
        norms.append(sm.clip_grad_norm_(1.0).item())
        opt.step()
        opt.zero_grad()
        full = sm.full_state_dict()
        steps.append({k: v.float() for k, v in full.items() if ".lora_" in k})
    # a layer's weights, gathered: bitwise the 4-bit weights and state the unsharded model holds
    layer = rt.layers[0]
    rt.gathers.ensure(layer)
    layer.install_views(None)
    same = []
    for entry, locs in zip(layer.layout.entries, layer.locations):
        module, attr = locs[0]
        w = module.__dict__[attr]
        data, state = before[entry.name]
        ok = torch.equal(w.detach().view(torch.uint8), data.view(torch.uint8))  # (packed bf16 storage: NaN patterns)
        ok = ok and type(w).__name__ == "Params4bit" and torch.equal(w.quant_state.absmax, state.absmax)
        if state.nested:
            ok = ok and torch.equal(w.quant_state.state2.absmax, state.state2.absmax) and torch.equal(
                w.quant_state.offset, state.offset)
        ok = ok and w.untyped_storage().data_ptr() == layer.slot.weights.untyped_storage().data_ptr()
        same.append(ok)
    layer.remove_views()
    rt.gathers.release(layer.slot)
    sm.eval()
    with torch.no_grad():
        logits = sm(input_ids=_data()[0]).logits.float()
    if adapter_dir is not None:
        yashard.save_adapter(sm, adapter_dir)
    moments = [t for st in opt.state.values() for t in st.values() if torch.is_tensor(t) and t.dim() > 0]
    plan = sm.memory_plan()
    layer_bytes = layer.layout.padded
    return dict(
        losses=losses, norms=norms, steps=steps, logits=logits, same_weights=same,
        layer_bytes=layer_bytes, layer_bf16_bytes=2 * sum(before[e.name][1].shape.numel() for e in layer.layout.entries),
        slot_dtypes={s.name: s.weights.dtype for s in rt.slots.values()},
        trained_units=[u.name for u in rt.units if u.grad_storage is not None],
        opt_bytes=sum(t.numel() * t.element_size() for t in moments), adamw_bytes=plan.adamw_bytes,
        plan=plan.total_bytes, rows={r.name: r.bytes for r in plan.rows},
        allocated=sum(t.numel() * t.element_size() for t in rt.allocated_tensors().values()),
        planned={r.name: r.bytes for r in yashard.plan(qlora_model(folder, variant), world_size=world,
                                                       backend="gloo").rows},
        layer_gathers=sorted({r.nbytes for r in rt.comm.log.records if r.op == "all_gather" and r.unit == "layer_0"}),
    )


def train_variants(rank: int, world: int, folder: str, variants: list, adapter_dir: str | None = None) -> dict:
    """:func:`train_sharded` for each variant, in one set of processes."""
    out = {}
    for v in variants:
        out[v] = train_sharded(rank, world, folder, v, adapter_dir=os.path.join(adapter_dir, v) if adapter_dir else None)
    return out


def checkpoint_round_trip(rank: int, world: int, folder: str, path: str, save: bool) -> dict:
    """``save``: two steps of QLoRA, a checkpoint after the first. Else: the checkpoint loaded (at
    another world size), then the second step. Losses of the second step, the adapters and the
    4-bit weights after it."""
    sm = yashard.shard(qlora_model(folder, "u8-dq"))
    opt = torch.optim.AdamW(sm.param_groups(WD), lr=LR, eps=EPS)
    data = _data()

    def step(batch):
        local = batch.chunk(world)[rank]
        out = sm(input_ids=local, labels=local)
        out.loss.backward()
        loss = out.loss.detach().clone() * local.shape[0]
        dist.all_reduce(loss)
        opt.step()
        opt.zero_grad()
        return loss.item() / batch.shape[0]

    if save:
        step(data[0])
        yashard.save_checkpoint(path, sm, opt)
    else:
        yashard.load_checkpoint(path, sm, opt)
    loss = step(data[1])
    full = sm.full_state_dict()
    return dict(loss=loss, state={k: v.clone() for k, v in full.items() if torch.is_tensor(v)})


def train_with_trainer(rank: int, world: int, folder: str, out: str) -> dict:
    """Two steps of yashard.hf.Trainer on a QLoRA model, then its save_model; the sharded model's
    logits after, for the saved adapter to match."""
    from datasets import Dataset
    from transformers import TrainingArguments

    import yashard.hf

    data = _data()[0]
    ds = Dataset.from_dict({"input_ids": data.tolist(), "labels": data.tolist()})
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=1, max_steps=2, report_to=[], use_cpu=True,
                             save_strategy="no", logging_steps=1, learning_rate=LR)
    trainer = yashard.hf.Trainer(model=qlora_model(folder, "u8"), args=args, train_dataset=ds)
    result = trainer.train()
    trainer.save_model(out)
    model = trainer.model
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=data[:2]).logits.float()
    return dict(loss=result.training_loss, logits=logits, steps=result.global_step)


def train_with_sft_trainer(rank: int, world: int, folder: str, out: str) -> dict:
    """TRL's usual QLoRA call through yashard.hf.SFTTrainer: a folder, ``quantization_config=`` and
    ``peft_config=``. Two steps, then save_model; the masters' dtypes and the sharded logits after."""
    from datasets import Dataset
    from peft import LoraConfig
    from trl import SFTConfig

    import hf_workers
    import yashard.hf

    g = torch.Generator().manual_seed(5)
    ids = [torch.randint(3, 96, (12,), generator=g).tolist() for _ in range(8)]
    args = SFTConfig(output_dir=out, per_device_train_batch_size=2, max_steps=2, logging_steps=1, learning_rate=LR,
                     report_to=[], save_strategy="no", use_cpu=True, bf16=False, disable_tqdm=True, seed=3,
                     model_init_kwargs={"dtype": "float32"})
    trainer = yashard.hf.SFTTrainer(model=folder, args=args, train_dataset=Dataset.from_dict({"input_ids": ids}),
                                    processing_class=hf_workers.tokenizer(), quantization_config=bnb_config("u8-dq"),
                                    peft_config=LoraConfig(**LORA))
    result = trainer.train()
    trainer.save_model(out)
    model = trainer.model
    dtypes = sorted({str(p.dtype) for p in model.parameters() if p.requires_grad})
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=_data()[0][:2]).logits.float()
    return dict(loss=result.training_loss, logits=logits, steps=result.global_step, dtypes=dtypes)
