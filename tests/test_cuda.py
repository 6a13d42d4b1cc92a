"""CUDA-only checks (skipped without a GPU): real streams and events, overlap, allocator-free steps.

Run on a CUDA machine with ``pytest tests/test_cuda.py``; they use a 1-rank NCCL group in-process,
except the overlap test, which needs 2 GPUs (2 ranks through tests/harness.py).
"""

import gc
import os
import socket

import pytest
import torch
import torch.distributed as dist

import yashard
from models import batches, build

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def nccl_group():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _train(model, steps, ids, step_fn=None):
    opt = torch.optim.AdamW(model.param_groups(0.1) if hasattr(model, "param_groups") else model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        if hasattr(model, "clip_grad_norm_") and isinstance(model, yashard.ShardedModel):
            model.clip_grad_norm_(1.0)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(out.loss.item())
        if step_fn:
            step_fn()
    return losses


def test_parity_world_one_with_real_streams(nccl_group):
    dev = torch.device("cuda", 0)
    ids = batches(1, 4, 64, 96)[0].to(dev)
    ref_model = build("llama").to(dev)
    decay = [p for p in ref_model.parameters() if p.dim() >= 2]
    nod = [p for p in ref_model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": nod, "weight_decay": 0.0}], lr=1e-3)
    ref = []
    for _ in range(5):
        out = ref_model(input_ids=ids, labels=ids)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        ref.append(out.loss.item())
    sm = yashard.shard(build("llama"))
    got = _train(sm, 5, ids)
    assert max(abs(a - b) / abs(b) for a, b in zip(got, ref)) < 1e-5, (got, ref)


def test_a_backward_called_on_another_stream_returns_with_every_gradient_written(nccl_group):
    """Over one rank Narrow adds the gradients to master.grad on the stream the forward ran on;
    autograd syncs the caller's stream only with streams that produced leaf gradients (none here),
    so the runtime's end-of-backward callback makes the caller's stream wait for the compute
    stream. The compute stream is held back by a sleep kernel: without that wait the caller's
    stream would read the gradients before the backward's kernels ran."""
    dev = torch.device("cuda", 0)
    ids = batches(1, 4, 64, 96)[0].to(dev)
    sm = yashard.shard(build("llama"))
    assert sm.runtime.direct_grads
    loss = sm(input_ids=ids, labels=ids).loss
    side = torch.cuda.Stream(device=dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    torch.cuda._sleep(200_000_000)  # (on the compute stream, ahead of every backward kernel)
    with torch.cuda.stream(side):
        loss.backward()
        seen = [p.grad.clone() for p in sm.parameters()]
    torch.cuda.synchronize()
    final = [p.grad for p in sm.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(seen, final))
    assert all(bool(g.abs().sum() > 0) for g in final)


@pytest.mark.parametrize("reshard", [True, False])
def test_buffers_fixed_and_memory_plan_matches_allocation(nccl_group, reshard):
    dev = torch.device("cuda", 0)
    model = build("llama", hidden_size=256, intermediate_size=512, num_hidden_layers=6)
    torch.cuda.synchronize()

    def requested():  # bytes asked of the caching allocator and still held (no block rounding)
        return torch.cuda.memory_stats(dev)["requested_bytes.all.current"]

    # earlier tests' models are cyclic garbage: a collection inside the measured span would free them
    gc.collect()
    # and their buffers used by the communication stream (record_stream) are freed only once the
    # allocator processes their events, lazily, at some later allocation: inside the span, unless now
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    gc.disable()
    try:
        _fixed_buffers(sm_config=yashard.ShardConfig(reshard_after_forward=reshard), model=model, dev=dev,
                       requested=requested)
    finally:
        gc.enable()


def _fixed_buffers(sm_config, model, dev, requested):
    before = requested()
    sm = yashard.shard(model, config=sm_config)
    torch.cuda.synchronize()
    held = requested() - before
    plan = sm.memory_plan().total_bytes
    moved = sum(b.numel() * b.element_size() for b in sm.module.buffers())  # model buffers (rotary)
    # beyond the plan: the moved buffers and a few tiny tensors (per-unit flags, gate tokens); a
    # 64 KiB bound still catches any buffer of real size (one layer's slot here is ~2.3 MiB)
    assert plan + moved <= held <= plan + moved + 64 * 1024, (plan, moved, held)
    ids = batches(1, 4, 64, 96)[0].to(dev)
    ptrs, alloc = [], []

    def snapshot():
        torch.cuda.synchronize()
        ptrs.append({k: t.data_ptr() for k, t in sm.runtime.allocated_tensors().items()})
        alloc.append(torch.cuda.memory_allocated(dev))

    mallocs = []  # cudaMalloc calls so far (the caching allocator's segments ever created)
    _train(sm, 6, ids, lambda: (snapshot(), mallocs.append(_stats(dev)["segment.all.allocated"])))
    assert all(p == ptrs[0] for p in ptrs)
    # after step one (AdamW state now exists) the memory at step end is constant
    assert len(set(alloc[1:])) == 1, alloc
    # and the allocator asks the driver for nothing more: no cudaMalloc, no retry after a failed one
    assert len(set(mallocs[1:])) == 1, mallocs
    assert _stats(dev)["num_alloc_retries"] == 0


def _stats(dev) -> dict:
    torch.cuda.synchronize(dev)
    return torch.cuda.memory_stats(dev)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (one NCCL rank skips its collectives)")
def test_collectives_overlap_compute():
    """World 2 on 2 GPUs: all-gathers and reduce-scatters run while compute kernels run (a 1-rank NCCL
    group would launch no collective kernel at all, and the default hook skips reducing at one rank)."""
    from harness import run_distributed

    from cuda_workers import collective_overlap

    for rank, res in enumerate(run_distributed(collective_overlap, 2, backend="nccl")):
        for kind, r in res.items():
            assert r["count"] > 0, f"rank {rank}: no NCCL {kind} kernel was recorded: {res}"
            assert r["overlapped"] > 0, f"rank {rank}: no {kind} ran while a compute kernel ran: {res}"


def test_gathers_overlap_compute_on_one_gpu(nccl_group, monkeypatch):
    """One GPU, a 1-rank NCCL group, the slots forced to gather (as at world > 1; at world 1 they
    normally show the shards in place): each layer's gather (NCCL's one-rank all-gather, a copy on
    its own stream) runs while the previous layer's kernels run on the compute stream."""
    from cuda_workers import stream_overlap

    monkeypatch.setattr(yashard.build, "direct_slots", lambda shard_world, config: False)
    res = stream_overlap(torch.device("cuda", 0))
    print("stream overlap, world 1, gathered slots:", res)
    assert res["side_count"] > 0, f"no GPU work outside the compute stream: the gathers ran on it ({res})"
    # the host runs ahead of a GPU-bound step, so each prefetch waits on the GPU only for its slot's
    # release and then copies while the compute stream runs the layer in between: most of it overlaps
    assert res["overlapped"] > 0.5 * res["side"], f"most side-stream work ran with the compute stream idle ({res})"


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_weight_gathers_train_alike_with_triton_and_torch_kernels(nccl_group, monkeypatch, bits):
    """qwZ at world 1 (a quantized gather is not a direct slot): the Triton kernels, run inside the
    training loop on the communication stream, give the losses and weights the torch fallback gives
    (their dequantized values are bitwise equal; the rest of the step runs the same kernels)."""
    import yashard.quant as Q

    if not Q.triton_available():
        pytest.skip("triton cannot be imported")
    dev = torch.device("cuda", 0)
    ids = batches(1, 4, 64, 96)[0].to(dev)

    def run(backend):
        if backend == "torch":
            monkeypatch.setattr(Q, "_triton_module", lambda: None)
        torch.manual_seed(0)
        sm = yashard.shard(build("llama"), config=yashard.ShardConfig(quantized_weights=bits))
        losses = _train(sm, 4, ids)
        return losses, torch.cat([p.detach().float().reshape(-1) for p in sm.parameters()]).cpu()

    mod, launched = Q._triton_module(), []
    for name in ("launch_quantize", "launch_dequantize"):
        orig = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _orig=orig, _name=name, **k: (launched.append(_name), _orig(*a, **k))[1])
    got, got_w = run("triton")
    assert {"launch_quantize", "launch_dequantize"} <= set(launched), launched
    ref, ref_w = run("torch")
    monkeypatch.undo()
    assert got == pytest.approx(ref, rel=1e-6), (got, ref)
    torch.testing.assert_close(got_w, ref_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_outer_slot_trains_bitwise_as_the_outer_slot_with_real_streams(nccl_group, monkeypatch, dtype):
    """``share_outer_slot=True`` on real streams: the slots forced to gather (as at world > 1), so
    every gather runs on the communication stream, ordered by events alone (R1, R4 over the
    overlapped slots). An embedding larger than both layer slots; a checkpointed layer; a no-grad
    forward between forward and backward. Bitwise the run with an outer slot of its own."""
    monkeypatch.setattr(yashard.build, "direct_slots", lambda shard_world, config: False)
    dev = torch.device("cuda", 0)
    kw = dict(hidden_size=512, intermediate_size=1376, num_attention_heads=8, num_key_value_heads=4,
              vocab_size=16384, attn_implementation="sdpa")
    ids = batches(1, 4, 64, 16384)[0].to(dev)
    runs = {}
    for share in (False, True):
        sm = yashard.shard(build("llama", **kw), config=yashard.ShardConfig(
            param_dtype=dtype, share_outer_slot=share, checkpoint_layers=1))
        opt = torch.optim.AdamW(sm.param_groups(0.1), lr=1e-3)
        losses = []
        for _ in range(4):
            out = sm(input_ids=ids, labels=ids)
            with torch.no_grad():
                sm(input_ids=ids.flip(1))
            out.loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(out.loss.detach())
        runs[share] = (torch.stack(losses).cpu(), {k: v.cpu() for k, v in sm.full_state_dict().items()})
        del sm, opt
    assert torch.equal(runs[True][0], runs[False][0]), (runs[True][0], runs[False][0])
    assert all(torch.equal(runs[True][1][k], v) for k, v in runs[False][1].items())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_step_in_backward_equals_the_ordinary_step_on_real_streams(nccl_group, dtype):
    """``ShardConfig(step_in_backward=True)`` on CUDA: each unit steps on the communication stream, in
    its reduction's follow-up (events rule R7); the masters, read by the next forward on the compute
    stream, match the ordinary step's. Fused AdamW, 4 steps, no clipping; fixed data pointers."""
    dev = torch.device("cuda", 0)
    ids = batches(1, 4, 64, 96)[0].to(dev)
    runs = {}
    for sib in (False, True):
        sm = yashard.shard(build("llama"), config=yashard.ShardConfig(param_dtype=dtype, step_in_backward=sib))
        if sib:
            opt = sm.optimizer_in_backward(torch.optim.AdamW, sm.param_groups(0.1), lr=1e-3, fused=True)
        else:
            opt = torch.optim.AdamW(sm.param_groups(0.1), lr=1e-3, fused=True)
        losses, ptrs = [], []
        for _ in range(4):
            out = sm(input_ids=ids, labels=ids)
            out.loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(out.loss.item())
            ptrs.append({k: t.data_ptr() for k, t in sm.runtime.allocated_tensors().items()})
        assert all(p == ptrs[0] for p in ptrs)
        runs[sib] = (losses, {k: v.cpu() for k, v in sm.full_state_dict().items()})
    (ref_losses, ref), (got_losses, got) = runs[False], runs[True]
    assert got_losses == pytest.approx(ref_losses, rel=1e-6)
    assert all(torch.allclose(got[k], ref[k], rtol=1e-6, atol=1e-7) for k in ref)
