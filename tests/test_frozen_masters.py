"""Frozen units under a 16-bit ``param_dtype`` keep their master shards in ``param_dtype``: a unit
whose parameters are all frozen at ``shard()`` (a PEFT LoRA model's decoder layers, embedding,
lm_head and norms) holds 2 bytes per element instead of 4, and no cast copy. The shard is the fp32
master rounded once, the bits every gather used to cast it to, so LoRA training is bitwise what it
was with fp32 masters (compared here against that behaviour, forced). The memory plan states it
(the ``bf16 frozen shards`` row), ``yashard.plan`` computes the same, and what reads masters
handles them: checkpoints (saved in bf16, the dtype in the index; loaded at another world size
and across a change of ``param_dtype``), DCP, ``full_state_dict``, ``export_hf`` (merged in fp32
over the bf16 base weights) and ``save_adapter``."""

from __future__ import annotations

import contextlib
import json
from unittest import mock

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("peft")

import yashard  # noqa: E402
from harness import run_distributed  # noqa: E402
from models import batches, build  # noqa: E402
from peft_workers import LR, WD, lora_model  # noqa: E402

BF16 = dict(param_dtype=torch.bfloat16)
FROZEN = ["embed", "layer_0", "layer_1", "layer_2", "layer_3", "lm_head", "small"]  # the LoRA model's frozen units


def fp32_masters():
    """The behaviour before: every master fp32, a frozen unit's cast to param_dtype at each gather."""
    return mock.patch("yashard.build.master_dtype", lambda config, trains: torch.float32)


def _train(sm, rank: int, world: int, steps: int = 3) -> dict:
    """LoRA steps on this rank's part of the global batch: losses, grad norms, logits after."""
    opt = torch.optim.AdamW(sm.param_groups(WD), lr=LR)
    data = batches(steps, 4, 8, 96)
    losses, norms = [], []
    for batch in data:
        local = batch.chunk(world)[rank]
        out = sm(input_ids=local, labels=local)
        out.loss.backward()
        loss = out.loss.detach().clone()
        dist.all_reduce(loss)
        losses.append(loss.item())
        norms.append(sm.clip_grad_norm_(1.0).item())
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        logits = sm(input_ids=data[0]).logits
    return dict(losses=losses, norms=norms, logits=logits, opt=opt)


def _held_bytes(sm) -> int:
    return sum(t.numel() * t.element_size() for t in sm.runtime.allocated_tensors().values())


def _planned(world: int, rank: int, config):
    return yashard.plan(lora_model(), world_size=world, config=config, rank=rank, backend="gloo")


def run_masters_and_plans(rank: int, world: int) -> dict:
    """Per setting (plain and hybrid with one-rank shard groups, whose slots are direct), the
    masters' dtypes and values against the fp32-master behaviour, the plans, and what is held."""
    out = {}
    for name, kw in {"sharded": {}, "direct": {"shard_group_size": 1}}.items():
        for dtype in (torch.float32, torch.bfloat16):
            config = yashard.ShardConfig(param_dtype=dtype, **kw)
            with fp32_masters():
                old = yashard.shard(lora_model(), config=config)
                old_planned = _planned(world, rank, config)
            new = yashard.shard(lora_model(), config=config)
            units = new.runtime.units
            out[name, dtype] = dict(
                dtypes={u.name: u.master.dtype for u in units},
                # a frozen bf16 shard is the fp32 master rounded once
                values_equal=all(torch.equal(u.master.detach(), v.master.detach().to(u.master.dtype))
                                 for u, v in zip(units, old.runtime.units)),
                cast_copies=sorted(k for k in new.runtime.allocated_tensors() if k.endswith(".gather_src")),
                frozen_numel=sum(u.layout.shard_numel for u in units if u.name in FROZEN),
                plan=new.memory_plan(), planned=_planned(world, rank, config), held=_held_bytes(new),
                old_plan=old.memory_plan(), old_planned=old_planned, old_held=_held_bytes(old),
                trained=[u.name for u in units if u.master.requires_grad],
                groups=[[p.dtype for p in g["params"]] for g in new.param_groups(WD)],
            )
            del old, new
    return out


def test_frozen_units_keep_bf16_masters_and_the_plan_says_so():
    """bf16 masters for the frozen units with bf16 param_dtype, fp32 with fp32; the values are the
    fp32 masters rounded once; no cast copy with direct slots; the plan drops by 2 B per frozen
    element and rank (4 B with direct slots, the cast copy gone too), equals yashard.plan row for
    row, and is the bytes held."""
    res = run_distributed(run_masters_and_plans, 2)
    for rank, out in enumerate(res):
        for (name, dtype), r in out.items():
            want = {u: (dtype if u in FROZEN else torch.float32) for u in FROZEN + ["adapters"]}
            assert r["dtypes"] == want, (name, dtype)
            assert r["values_equal"], (name, dtype)
            assert r["trained"] == ["adapters"] and r["groups"] == [[torch.float32]]  # frozen masters: no optimizer
            assert r["plan"].rows == r["planned"].rows and str(r["plan"]) == str(r["planned"]), (name, dtype)
            assert r["old_plan"].rows == r["old_planned"].rows, (name, dtype)
            assert r["plan"].total_bytes == r["held"] and r["old_plan"].total_bytes == r["old_held"], (name, dtype)
            assert r["plan"].adamw_bytes == r["old_plan"].adamw_bytes
            rows = {row.name: row for row in r["plan"].rows}
            z = r["frozen_numel"]
            if dtype == torch.float32:
                assert r["plan"] == r["old_plan"], name  # fp32 runs unchanged
                assert "bf16 frozen shards" not in rows
                continue
            direct = name == "direct"
            # with direct slots the old behaviour also kept a bf16 cast copy of every frozen shard
            assert r["old_plan"].total_bytes - r["plan"].total_bytes == (4 if direct else 2) * z, (name, rank)
            assert rows["bf16 frozen shards"].numel == z and rows["bf16 frozen shards"].bytes == 2 * z
            assert rows["fp32 master shards"].numel == r["plan"].adamw_bytes // 8  # the adapter group's shard
            assert "Z/W*2" in r["plan"].formula
            assert r["cast_copies"] == (["adapters.gather_src"] if direct else []), name
            if direct:
                assert rows["torch.bfloat16 gather sources"].numel == rows["fp32 master shards"].numel
    # world 2, bf16: the numbers the docs state
    sharded = res[0]["sharded", torch.bfloat16]
    assert (sharded["old_plan"].total_bytes, sharded["plan"].total_bytes) == (155264, 111968)


def run_training(rank: int, world: int, shard_kw: dict) -> dict:
    """The same LoRA training with bf16 frozen masters and with fp32 ones (forced)."""
    out = {}
    for name in ("bf16 masters", "fp32 masters"):
        with fp32_masters() if name == "fp32 masters" else contextlib.nullcontext():
            sm = yashard.shard(lora_model(), config=yashard.ShardConfig(**BF16, **shard_kw))
        res = _train(sm, rank, world)
        del res["opt"]
        out[name] = dict(res, params=sm.full_state_dict())
        del sm
    return out


@pytest.mark.parametrize("shard_kw", [{}, {"shard_group_size": 1}, {"reshard_after_forward": False}],
                         ids=["sharded", "direct", "own slots"])
def test_lora_training_is_bitwise_the_fp32_master_behaviour(shard_kw):
    new, old = (run_distributed(run_training, 2, shard_kw)[0][k] for k in ("bf16 masters", "fp32 masters"))
    assert new["losses"] == old["losses"] and new["norms"] == old["norms"]
    assert torch.equal(new["logits"], old["logits"])
    for k, v in old["params"].items():
        if ".lora_" in k:  # the trained adapters
            assert torch.equal(new["params"][k], v), k
        else:  # full_state_dict: the frozen weights' bf16 values, widened to fp32
            assert new["params"][k].dtype == torch.float32
            assert torch.equal(new["params"][k], v.to(torch.bfloat16).float()), k


def run_save(rank: int, world: int, dtype: torch.dtype, ckpt: str, dcp_dir: str, adapter: str | None,
             export: str | None) -> dict:
    """Train a little, then save_checkpoint, dcp.save, save_adapter and export_hf."""
    import torch.distributed.checkpoint as dcp

    sm = yashard.shard(lora_model(), config=yashard.ShardConfig(param_dtype=dtype))
    res = _train(sm, rank, world, steps=2)
    yashard.save_checkpoint(ckpt, sm, res["opt"], extra={"step": 2})
    dcp.save(sm.sharded_state_dict(), checkpoint_id=dcp_dir)
    if adapter is not None:
        yashard.save_adapter(sm, adapter)
    if export is not None:
        yashard.export_hf(sm, export)
    return dict(params=sm.full_state_dict(), logits=res["logits"])


def run_load(rank: int, world: int, dtype: torch.dtype, ckpt: str, dcp_dir: str) -> dict:
    """Load the checkpoint (with its optimizer state) and the DCP checkpoint into fresh models."""
    import torch.distributed.checkpoint as dcp

    config = yashard.ShardConfig(param_dtype=dtype)
    sm = yashard.shard(lora_model(seed=1), config=config)  # (other initial weights: all must be loaded)
    opt = torch.optim.AdamW(sm.param_groups(WD), lr=LR)
    extra = yashard.load_checkpoint(ckpt, sm, opt)
    loaded = sm.full_state_dict()
    steps = opt.state[sm.runtime.adapters.master]["step"].item()
    other = yashard.shard(lora_model(seed=1), config=config)
    dcp.load(other.sharded_state_dict(), checkpoint_id=dcp_dir)
    with torch.no_grad():
        logits = sm(input_ids=batches(1, 4, 8, 96)[0]).logits
    return dict(params=loaded, dcp=other.full_state_dict(), extra=extra, steps=steps, logits=logits,
                dtypes={u.name: u.master.dtype for u in sm.runtime.units})


def _bf16_values(params: dict) -> dict:
    """What a bf16-frozen-master run holds of ``params``: the frozen weights rounded to bf16."""
    return {k: v if ".lora_" in k else v.to(torch.bfloat16).float() for k, v in params.items()}


def test_checkpoints_round_trip_at_another_world_size_and_across_param_dtypes(tmp_path):
    """Saved at world 2 (the frozen units' pieces in bf16, the dtype in the index, format version
    3), loaded at world 1 into a bf16 run (bitwise) and into an fp32 run (the bf16 values, widened);
    an fp32 run's checkpoint (version 2, as before) loads into a bf16 run (rounded once). The same
    through DCP."""
    from safetensors import safe_open

    saved = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        ckpt, dcp_dir = str(tmp_path / f"ck-{name}"), str(tmp_path / f"dcp-{name}")
        saved[name] = (run_distributed(run_save, 2, dtype, ckpt, dcp_dir, None, None)[0], ckpt, dcp_dir)
    index = json.loads(next((tmp_path / "ck-bf16").glob("save-*/index.json")).read_text())
    assert index["format_version"] == 3
    q = "model.layers.0.self_attn.q_proj.base_layer.weight"
    lora = "model.layers.0.self_attn.q_proj.lora_A.default.weight"
    assert index["params"][q]["dtype"] == "bfloat16" and index["params"][lora]["dtype"] == "float32"
    files = sorted((tmp_path / "ck-bf16").glob("save-*/shard-*.safetensors"))
    with safe_open(str(files[0]), framework="pt") as f:
        stored = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert {stored[k] for k in stored if k.startswith(f"master/{q}")} == {"BF16"}
    assert {stored[k] for k in stored if k.startswith(f"master/{lora}")} == {"F32"}
    fp32_index = json.loads(next((tmp_path / "ck-fp32").glob("save-*/index.json")).read_text())
    assert fp32_index["format_version"] == 2  # (all fp32: version-2 readers load it)

    for source, load_dtype in (("bf16", torch.bfloat16), ("bf16", torch.float32), ("fp32", torch.bfloat16)):
        res, ckpt, dcp_dir = saved[source]
        got = run_distributed(run_load, 1, load_dtype, ckpt, dcp_dir)[0]
        want = _bf16_values(res["params"]) if load_dtype == torch.bfloat16 else res["params"]
        assert got["extra"] == {"step": 2} and got["steps"] == 2
        for k, v in want.items():
            assert torch.equal(got["params"][k], v), (source, load_dtype, k)
            assert torch.equal(got["dcp"][k], v), (source, load_dtype, k, "dcp")
        frozen = torch.bfloat16 if load_dtype == torch.bfloat16 else torch.float32
        assert got["dtypes"] == {u: (frozen if u in FROZEN else torch.float32) for u in FROZEN + ["adapters"]}
        if source == "bf16" and load_dtype == torch.bfloat16:  # the run resumes where it was
            torch.testing.assert_close(got["logits"], res["logits"], rtol=0, atol=0)


def test_export_and_adapter_of_a_bf16_lora_model(tmp_path):
    """export_hf of a LoRA model with bf16 frozen masters: from_pretrained loads it with no missing
    key, bitwise peft's merge_and_unload over the bf16 base weights (widened to fp32: the merge adds
    the fp32 delta in fp32, as before); in bf16, that merge rounded once. save_adapter still writes
    the fp32 adapters bitwise."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter, export = str(tmp_path / "adapter"), str(tmp_path / "export")
    res = run_distributed(run_save, 2, torch.bfloat16, str(tmp_path / "ck"), str(tmp_path / "dcp"), adapter,
                          export)[0]
    base = build("llama", seed=0)
    with torch.no_grad():
        for p in base.parameters():  # the base weights the run held: rounded to bf16
            p.copy_(p.to(torch.bfloat16).float())
    loaded = PeftModel.from_pretrained(base, adapter)
    for k, p in loaded.get_base_model().named_parameters():
        assert torch.equal(p.detach(), res["params"][k]), k
    merged = loaded.merge_and_unload().state_dict()
    exported, info = AutoModelForCausalLM.from_pretrained(export, output_loading_info=True)
    assert not any(info.values()), info
    for k, v in exported.state_dict().items():
        assert torch.equal(v, merged[k]), k


def test_conversions_that_would_widen_the_bf16_frozen_shards_are_refused(pg):
    """``model.float()`` changes nothing fp32, but would widen the bf16 frozen shards (a new storage
    the runtime does not hold): refused, with the others; moves that change nothing pass."""
    sm = yashard.shard(lora_model(), config=yashard.ShardConfig(**BF16))
    ptrs = [p.data_ptr() for p in sm.parameters()]
    for convert in (lambda m: m.float(), lambda m: m.to(torch.float32), lambda m: m.half()):
        with pytest.raises(ValueError, match=r"converting a yashard-sharded model to torch\.(float32|float16) would "
                                             r"break its fp32 master shards and bfloat16 frozen shards"):
            convert(sm)
    assert sm.to("cpu") is sm
    assert [p.data_ptr() for p in sm.parameters()] == ptrs
    ids = torch.randint(0, 96, (2, 8))
    sm(input_ids=ids, labels=ids).loss.backward()  # still trains
    # a frozen bf16 shard set to require gradients is refused at the next forward, as an fp32 one
    frozen = sm.runtime.layers[0].master
    assert frozen.dtype == torch.bfloat16 and not frozen.requires_grad
    frozen.requires_grad_(True)
    with pytest.raises(ValueError, match=r"master shard layer_0 was set to require gradients.*all frozen"):
        sm(input_ids=ids, labels=ids)
    frozen.requires_grad_(False)
