"""Over a shard group of one rank the slots show the units' own shards in place (direct slots):
no gather copies and no weight buffers, with results bitwise those of the copying path."""

from __future__ import annotations

import contextlib

import pytest
import torch

import yashard
from yashard import build as rt_mod
from models import batches, build


def _train(dtype: torch.dtype, steps: int = 3, accum: int = 2):
    """A few AdamW steps with gradient accumulation and clipping; what each step saw and left."""
    sm = yashard.shard(build(), config=yashard.ShardConfig(param_dtype=dtype))
    opt = torch.optim.AdamW(sm.param_groups(weight_decay=0.1), lr=1e-2)
    views = []  # storage of layer 1's q_proj weight as its forward saw it
    handle = sm.module.model.layers[1].self_attn.q_proj.register_forward_pre_hook(
        lambda m, args: views.append(m.weight.untyped_storage().data_ptr()))
    losses = []
    for ids in batches(steps, 4, 16, sm.module.config.vocab_size):
        for micro in ids.chunk(accum):
            loss = sm(input_ids=micro, labels=micro).loss
            (loss / accum).backward()
            losses.append(loss.detach())
        sm.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad()
    handle.remove()
    return sm, torch.stack(losses), sm.full_state_dict(), views


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_rank_reads_the_shards_in_place_and_matches_the_copying_path(pg, monkeypatch, dtype):
    sm, losses, params, views = _train(dtype)
    rt = sm.runtime
    assert rt.direct and all(s.direct for s in rt.slots.values())
    layer1 = rt.layers[1]
    # the forward computed with a view of layer 1's own shard (fp32: the master; bf16: its cast copy)
    assert set(views) == {layer1.gather_src.untyped_storage().data_ptr()}
    if dtype == torch.float32:
        assert layer1.gather_src is layer1.master
    allocated = rt.allocated_tensors()
    assert not [k for k in allocated if k.endswith(".weights")]  # no weight buffers at all
    assert "reduce_out" not in allocated  # the default hook's sum over one rank is the buffer itself
    assert sm.memory_plan().total_bytes == sum(t.numel() * t.element_size() for t in allocated.values())
    # ... and no gradient buffers either: Narrow added each gradient to the master's in place
    assert rt.direct_grads and all(s.grads.numel() == 0 for s in rt.slots.values())
    assert not [r for r in sm.memory_plan().rows if r.name.startswith("slot ")]
    assert "no slot buffers" in sm.memory_plan().formula
    # the same training through gradient slots reduced into the masters' gradients ...
    monkeypatch.setattr(rt_mod, "direct_grads", lambda direct, world, cfg: False)
    mid, mid_losses, mid_params, mid_views = _train(dtype)
    assert mid.runtime.direct and set(mid_views) == {mid.runtime.layers[1].gather_src.untyped_storage().data_ptr()}
    rows = {r.name: r for r in mid.memory_plan().rows}
    for slot in mid.runtime.slots.values():  # a slot row counts gradients only
        assert slot.grads.numel() == slot.numel
        assert rows[f"slot {slot.name}"].bytes == slot.grads.numel() * slot.grads.element_size()
        assert "grads (weights: the unit's own shard)" in rows[f"slot {slot.name}"].formula
    # ... and through gathered copies as well (the path of every larger shard group)
    monkeypatch.setattr(rt_mod, "direct_slots", lambda w, cfg: False)
    ref, ref_losses, ref_params, ref_views = _train(dtype)
    assert not ref.runtime.direct and len(set(ref_views)) == 1
    assert set(ref_views) != {ref.runtime.layers[1].gather_src.untyped_storage().data_ptr()}
    for other_losses, other_params in ((mid_losses, mid_params), (ref_losses, ref_params)):
        assert torch.equal(losses, other_losses)
        assert params.keys() == other_params.keys()
        for k in params:
            assert torch.equal(params[k], other_params[k]), k
    plan, mid_plan = sm.memory_plan().total_bytes, mid.runtime.memory_plan().total_bytes
    ref_plan = ref.runtime.memory_plan().total_bytes
    assert mid_plan - plan == sum(s.numel * s.grads.element_size() for s in mid.runtime.slots.values())
    # the copying path holds weight buffers, and no cast copies of the masters: it casts into them
    casts = sum(u.gather_src.numel() * u.gather_src.element_size() for u in mid.runtime.units
                if u.gather_src is not u.master)
    assert (casts > 0) == (dtype == torch.bfloat16)
    assert all(u.gather_src is u.master for u in ref.runtime.units)
    assert ref_plan - mid_plan == sum(s.numel * s.weights.element_size() for s in ref.runtime.slots.values()) - casts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_rank_in_place_write_through_a_module_is_refused(pg, dtype):
    """The norm group's views stay on the modules between forwards; a write through them is refused
    as on more ranks. In fp32 it went into the master (said so); a bf16 copy is cast again."""
    sm = yashard.shard(build(), config=yashard.ShardConfig(param_dtype=dtype))
    ids = batches(1, 2, 8, sm.module.config.vocab_size)[0]
    sm(input_ids=ids, labels=ids).loss.backward()
    before = sm.full_state_dict()["model.norm.weight"].clone()
    with torch.no_grad():
        sm.module.model.norm.weight.fill_(3.0)
    said = "this write did change them" if dtype == torch.float32 else "then lost"
    with pytest.raises(RuntimeError, match=said):
        sm(input_ids=ids, labels=ids)
    after = sm.full_state_dict()["model.norm.weight"]
    if dtype == torch.float32:
        assert torch.all(after == 3.0)
    else:
        assert torch.equal(after, before)  # the masters never saw it ...
        sm(input_ids=ids, labels=ids)       # ... and the next forward computes with them again
        assert torch.equal(sm.module.model.norm.weight.float(), before.to(dtype).float())


def test_one_rank_reduce_output_only_for_a_hook_that_asks(pg):
    """The reduce-scatter output exists at one rank only for a hook that writes ``bucket.output()``
    (its workspace_plan says so: it is allocated at register_comm_hook, and listed by the plan from
    then on), and the result is the default hook's (fp32 through bf16: bf16 rounding)."""
    from yashard.comm_hooks import bf16_compress_hook

    sm = yashard.shard(build())
    assert "reduce-scatter out" not in {r.name for r in sm.memory_plan().rows}
    assert sm.runtime.reduce_out is None
    sm.register_comm_hook(None, bf16_compress_hook)
    plan = sm.memory_plan()
    assert "reduce-scatter out" in {r.name for r in plan.rows}
    ids = batches(1, 2, 8, sm.module.config.vocab_size)[0]
    sm(input_ids=ids, labels=ids).loss.backward()
    allocated = sm.runtime.allocated_tensors()
    rows = {r.name: r for r in sm.memory_plan().rows}
    assert rows["reduce-scatter out"].bytes == allocated["reduce_out"].numel() * 4
    assert sm.memory_plan() == plan  # nothing more was allocated by the backward
    assert plan.total_bytes == sum(t.numel() * t.element_size() for t in allocated.values())
    got = sm.full_grads()
    ref = yashard.shard(build())
    ref(input_ids=ids, labels=ids).loss.backward()
    for k, g in ref.full_grads().items():
        assert torch.equal(got[k], g.bfloat16().float()), k


@pytest.mark.parametrize("kw, said", [({"quantized_weights": 8}, "qwZ (quantized_weights) quantizes the weights for "
                                                                  "nothing"),
                                      ({"secondary_group_size": 1}, "hpZ (secondary_group_size) keeps a copy of every "
                                                                    "layer for nothing")])
def test_zeropp_weight_options_at_one_rank_are_warned(pg, caplog, kw, said):
    import logging

    with caplog.at_level(logging.WARNING, logger="yashard"):
        yashard.shard(build(), config=yashard.ShardConfig(**kw))
    assert "over a one-rank shard group nothing is gathered, yet " + said in caplog.text


def test_quant_block_without_qwz_is_warned_about(pg, caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="yashard"):
        yashard.shard(build(), config=yashard.ShardConfig(quant_block=256))
    assert "quant_block=256 is ignored: it sizes qwZ's quantization blocks and quantized_weights is off" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="yashard"):
        yashard.shard(build())
    assert caplog.text == ""


@pytest.mark.parametrize("param, wire, at_registration, way_out", [
    (torch.float32, torch.float32, None, ", or bf16_compress_hook"),
    (torch.bfloat16, torch.float32, "param_dtype=bfloat16", ", or bf16_compress_hook"),
    (torch.float32, torch.bfloat16, "reduce_dtype=bfloat16", ", or bf16_compress_hook"),
    (torch.float32, torch.float16, None, ", or reduce_dtype=torch.float32 with bf16_compress_hook"),
])
def test_fp16_compression_without_loss_scaling_is_warned_about(pg, caplog, param, wire, at_registration, way_out):
    """fp16 on the wire underflows like fp16 weights do: the first step warns, naming every change
    that removes fp16 from the run; a bf16 run (weights or gradient buffers), whose gradients fp16
    cannot range over and which has no loss scaling, is warned about at registration."""
    import logging

    from yashard import comm_hooks

    sm = yashard.shard(build(), config=yashard.ShardConfig(param_dtype=param, reduce_dtype=wire))
    opt = torch.optim.SGD(sm.parameters(), lr=1e-2)
    with caplog.at_level(logging.WARNING, logger="yashard"):
        sm.register_comm_hook(None, comm_hooks.fp16_compress_hook)
        registered = caplog.text
        ids = batches(1, 2, 8, sm.module.config.vocab_size)[0]
        sm(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    if at_registration is None:
        assert registered == ""
    else:
        assert f"fp16_compress_hook with {at_registration}: the gradients go over the wire in float16" in registered
    step = [r.getMessage() for r in caplog.records if "without yashard.ShardedGradScaler" in r.getMessage()]
    assert len(step) == 1 and "comm hook fp16_compress_hook without" in step[0], step
    assert step[0].endswith("ShardedGradScaler(model)" + way_out), step[0]


def test_a_compression_hook_on_16_bit_gradients_needs_nothing_at_one_rank(pg):
    """bf16 gradients through bf16_compress_hook take the default hook's path: over one rank that
    is the buffer itself, so no reduce output is planned or allocated (it was, at the first backward,
    outside the plan)."""
    from yashard.comm_hooks import bf16_compress_hook

    sm = yashard.shard(build(), config=yashard.ShardConfig(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16))
    sm.register_comm_hook(None, bf16_compress_hook)
    plan = sm.memory_plan()
    ids = batches(1, 2, 8, sm.module.config.vocab_size)[0]
    sm(input_ids=ids, labels=ids).loss.backward()
    assert sm.memory_plan() == plan and sm.runtime.reduce_out is None


def test_a_plain_grad_scaler_works_over_a_one_rank_shard_group(pg):
    """Every rank holds whole gradients there (reduced alike), so torch.amp.GradScaler's per-rank
    check agrees across ranks: it is not refused (it is over a shard group of several ranks)."""
    sm = yashard.shard(build())
    opt = torch.optim.SGD(sm.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    ids = batches(1, 2, 8, sm.module.config.vocab_size)[0]
    before = [p.detach().clone() for p in sm.parameters()]
    scaler.scale(sm(input_ids=ids, labels=ids).loss).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 8.0 and not all(torch.equal(b, p) for b, p in zip(before, sm.parameters()))


@pytest.mark.parametrize("reshard", [True, False])
def test_gradients_added_in_place_match_the_gradient_slot_path(pg, monkeypatch, reshard):
    """Over one rank Narrow adds each gradient to ``master.grad`` itself (``direct_grads``). Through
    both ``zero_grad`` modes, accumulation (``no_sync()`` where the slot path allows it, starting
    from zeroed gradients), a partly frozen unit, a ``.grad`` the user assigned and a shard turned
    off between forward and backward, the gradients are bitwise those of the gradient-slot path."""
    import contextlib

    def run():
        model = build()
        model.model.layers[0].mlp.up_proj.requires_grad_(False)  # layer 0's unit is partly frozen
        sm = yashard.shard(model, config=yashard.ShardConfig(reshard_after_forward=reshard))
        opt = torch.optim.SGD(sm.parameters(), lr=0.1)
        seen = []
        for i, ids in enumerate(batches(4, 2, 8, sm.module.config.vocab_size)):
            unsynced = not reshard and i % 2 == 0
            with sm.no_sync() if unsynced else contextlib.nullcontext():
                sm(input_ids=ids, labels=ids).loss.backward()
            if i % 2:
                seen.append(sm.full_grads())
                opt.step()
                opt.zero_grad(set_to_none=i == 1)
        shards = dict(sm.named_parameters())
        for name, p in shards.items():  # a gradient the user put there is added to, as torch would
            if p.requires_grad:
                p.grad = torch.full_like(p, 0.5)
        loss = sm(input_ids=ids, labels=ids).loss
        shards["shards.lm_head"].requires_grad_(False)  # turned off after its forward: torch leaves
        loss.backward()                                 # its .grad alone
        seen.append(sm.full_grads())
        return sm.runtime.direct_grads, seen

    direct, got = run()
    monkeypatch.setattr(rt_mod, "direct_grads", lambda direct, world, cfg: False)
    slots, want = run()
    assert direct and not slots
    assert len(got) == len(want) == 3
    for g, w in zip(got, want):
        assert g.keys() == w.keys()
        for k in g:
            assert torch.equal(g[k], w[k]), k
    assert torch.all(got[-1]["lm_head.weight"] == 0.5)
    assert torch.all(got[-1]["model.layers.0.mlp.up_proj.weight"] == 0.5)  # frozen: the assigned value


def test_no_sync_at_one_rank_accumulates_in_place_as_torch_does(pg):
    """Over one rank no_sync() needs no buffers of its own (the gradients accumulate in master.grad,
    as in plain torch): it is allowed with the default config, and sync -> no_sync -> sync gives the
    gradients of three plain backwards, bitwise (the slot path would add the unsynced micro-batch's
    gradients to the others in another order). With the HF loss: bitwise equality to torch needs
    its ops; the fused chunked loss is held to 1e-6 in tests/test_fused_head.py."""
    model = build()
    ref = build()
    ref.load_state_dict(model.state_dict())
    sm = yashard.shard(model, config=yashard.ShardConfig(loss="hf"))
    micro = batches(3, 2, 8, ref.config.vocab_size)
    for i, ids in enumerate(micro):
        with sm.no_sync() if i == 1 else contextlib.nullcontext():
            sm(input_ids=ids, labels=ids).loss.backward()
        ref(input_ids=ids, labels=ids).loss.backward()
    got = sm.full_grads()
    for name, p in ref.named_parameters():
        assert torch.equal(got[name], p.grad), name


def test_a_failed_backward_at_one_rank_zeroes_every_gradient_it_reached(pg):
    """Narrow writes master.grad as the backward goes, so a backward that raises midway has already
    added to some of them, an assigned .grad included: the next forward zeroes them all, and the
    batch after trains as on a fresh model."""
    def run(fail: bool):
        sm = yashard.shard(build())
        boom = {"on": fail}

        def raise_once(module, grad_in, grad_out):
            if boom.pop("on", False):
                raise RuntimeError("simulated out of memory")

        sm.module.model.layers[1].register_full_backward_hook(raise_once)
        for p in sm.parameters():
            p.grad = torch.full_like(p, 0.5)
        a, b = batches(2, 2, 8, sm.module.config.vocab_size)
        if fail:
            with pytest.raises(RuntimeError, match="simulated out of memory"):
                sm(input_ids=a, labels=a).loss.backward()
        else:
            for p in sm.parameters():
                p.grad.zero_()
        sm(input_ids=b, labels=b).loss.backward()
        return sm.full_grads()

    got, want = run(True), run(False)
    for k in want:
        assert torch.equal(got[k], want[k]), k
