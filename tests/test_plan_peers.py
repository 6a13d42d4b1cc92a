"""The peers' rules in ``yashard.plan.peers`` and the loss and step modes of the planner (issue 42):
FSDP2 as torchtitan wraps it against the root wrapping, the MLP's backward transient against
autograd, the copy-in moment, ZeRO-3's prefetch cap, the chunked loss, the step in backward, and
the CLI flags. Pure arithmetic, except one tiny profiled MLP backward on CPU."""

import pytest

from yashard.plan.activations import activations, shape_of, yashard_peak
from yashard.plan.peers import (DS_MAX_LIVE_PARAMETERS, DS_PREFETCH_BUCKET, deepspeed_gathered_numel,
                                deepspeed_kept_layers, deepspeed_zero3_peak, fsdp2_peak)
from yashard.plan.presets import preset_config

GiB = 2**30


def _shape(name: str):
    return shape_of(preset_config(name))


def _acts(shape, loss: str = "hf"):
    return activations(shape, seq=4096, micro_batch=1, param_bytes=2, checkpoint_layers=shape.layers, loss=loss)


def _moment(peak, name: str) -> int:
    return next(m.bytes for m in peak.moments if m.name == name)


def test_the_mlp_transient_is_what_autograd_holds_in_the_mul_backward():
    """A Llama MLP's backward, profiled on CPU: the rise above its forward's saved tensors is
    ``2*n*i*p + h*i*p`` (the planner's ``mlp_transient`` less the layer's two ``n*h*p`` gradients),
    not the old ``3*h*i*p + 2*n*i*p``."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    for n, h, i in ((256, 512, 1792), (512, 512, 1792)):  # the 70B and 8B ratios of tokens to hidden
        mlp = LlamaMLP(LlamaConfig(hidden_size=h, intermediate_size=i)).to(torch.bfloat16)
        x = torch.randn(n, h, dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(n, h, dtype=torch.bfloat16)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            y = mlp(x)
            torch.ones(1)  # (marks the backward's start)
            y.backward(grad)
        events = sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns())
        start = min(e.start_ns() for e in events if e.name() == "aten::ones")
        live = base = peak = 0
        for e in events:
            if e.name() == "[memory]":
                live += e.nbytes()
                if e.start_ns() < start:
                    base = live
                else:
                    peak = max(peak, live)
        shape = shape_of(LlamaConfig(hidden_size=h, intermediate_size=i, num_hidden_layers=1, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=64))
        acts = activations(shape, seq=n, micro_batch=1, param_bytes=2)
        planned = acts.mlp_transient - 2 * acts.io
        assert planned == (2 * n * i + h * i) * 2
        assert abs(peak - base - planned) <= 0.01 * planned, (peak - base, planned)
        assert (3 * h * i + 2 * n * i) * 2 > 1.3 * (peak - base)  # (the old formula)


def test_torchtitans_wrapping_against_the_root_group_with_the_hf_loss():
    """The root wrapping holds the embedding and the prefetched last layer over the loss's
    backward; torchtitan's holds only [norm, lm_head] there, and prefetches after it."""
    shape = _shape("llama-3-8b")
    acts = _acts(shape)
    v1 = fsdp2_peak(shape, acts, world=8, param_bytes=2, root_group=True)
    v3 = fsdp2_peak(shape, acts, world=8, param_bytes=2)
    assert _moment(v1, "loss backward") - _moment(v3, "loss backward") == (shape.embed_numel + shape.layer_numel) * 2
    names1, names3 = [m.name for m in v1.moments], [m.name for m in v3.moments]
    assert names1.index("backward: prefetch of the last layer") < names1.index("loss backward")
    assert names3.index("loss backward") < names3.index("lm_head pre-backward: prefetch of the last layer")
    assert "embedding reduce-scatter" in names3 and "root reduce-scatter" in names1
    # the peaks the independent derivation gives (shared/reference/peak-memory-audit.md, section 2)
    assert (round(v1.bytes / GiB, 2), round(v3.bytes / GiB, 2)) == (21.56, 20.17)
    assert round(_moment(v1, "root reduce-scatter: copy-in") / GiB, 2) == 21.32  # (section 4, item 3)
    shape70 = _shape("llama-3-70b")
    v3_70 = fsdp2_peak(shape70, _acts(shape70), world=256, param_bytes=2)
    assert v3_70.at == "layer 79 backward (MLP)" and round(v3_70.bytes / GiB, 2) == 18.69


def test_the_lm_heads_gradient_stays_to_the_end_only_in_the_root_group():
    shape = _shape("llama-3-8b")
    acts = _acts(shape)
    v1 = fsdp2_peak(shape, acts, world=8, param_bytes=2, root_group=True)
    v3 = fsdp2_peak(shape, acts, world=8, param_bytes=2)
    # at layer 0's backward the root wrapping holds the root gathered and the lm_head's bf16
    # gradient; torchtitan's holds the prefetched embedding and the lm_head's gradient shard
    lm, emb, w = shape.lm_head_numel, shape.embed_numel, 8
    other = shape.total_numel - shape.layers * shape.layer_numel - lm - emb
    diff = _moment(v1, "layer 0 backward (MLP)") - _moment(v3, "layer 0 backward (MLP)")
    assert diff == (lm + emb + other) * 2 + lm * 2 - emb * 2 - (lm + other) * 4 // w


@pytest.mark.parametrize("root_group", [False, True])
def test_a_reduce_scatter_copies_in_while_the_bf16_gradients_live(root_group):
    """At the copy-in both the group's bf16 gradients and its fp32 input exist; then the bf16 ones
    go and the fp32 output (the shard) comes."""
    shape = _shape("llama-3-8b")
    peak = fsdp2_peak(shape, _acts(shape), world=8, param_bytes=2, root_group=root_group)
    for k in (31, 7, 0):
        n = shape.layer_numel
        assert (_moment(peak, f"layer {k} reduce-scatter: copy-in") - _moment(peak, f"layer {k} reduce-scatter")
                == n * 2 - n * 4 // 8)
    last = "root" if root_group else "embedding"
    n = shape.total_numel - shape.layers * shape.layer_numel if root_group else shape.embed_numel
    assert _moment(peak, f"{last} reduce-scatter: copy-in") - _moment(peak, f"{last} reduce-scatter") == n * 2 - n * 4 // 8


def test_zero3_caps_only_the_prefetch_at_max_live_parameters():
    """70B: the lm_head alone (1.05e9 elements) is over stage3_max_live_parameters, and is gathered
    whole; no prefetch runs past the cap. 8B: the lm_head and one prefetch bucket."""
    for name, world, prefetch in (("llama-3-70b", 256, 0), ("llama-3-8b", 8, DS_PREFETCH_BUCKET)):
        shape = _shape(name)
        acts = _acts(shape)
        peak = deepspeed_zero3_peak(shape, acts, world=world, param_bytes=2, reduce_bytes=4)
        layer, _, head = deepspeed_gathered_numel(shape)
        required = deepspeed_kept_layers(shape) * layer + head
        gathered = _moment(peak, "forward end") - peak.state - acts.forward_end - acts.loss_forward
        assert gathered == (required + prefetch) * 2
        if name == "llama-3-70b":
            assert required > DS_MAX_LIVE_PARAMETERS


def test_a_chunked_loss_holds_one_chunk_and_no_logits():
    shape = _shape("llama-3-8b")
    hf, chunked = _acts(shape), _acts(shape, "chunked")
    n, v = 4096, shape.vocab
    assert chunked.logits == 0 and chunked.loss_chunks == 8
    assert chunked.loss_chunk == n // 8 * v * (2 + 12)
    assert hf.head - chunked.head == n * v * 4  # (no fp32 log-probabilities kept)
    # the full loss's terms are the chunk's at n tokens
    assert hf.logits + n * v * 4 + hf.loss_backward == n * v * (2 + 12)
    y = yashard_peak(1000, shape, chunked)
    names = [m.name for m in y.moments]
    assert "lm_head backward" not in names  # (its weight gradient lands in the slot)
    # yashard's fused loss: chunks of 1024 tokens, logits in p, their fp32 upcast and log-softmax
    assert _moment(y, "loss (one chunk)") == 1000 + chunked.forward_end + n * shape.hidden * 2 + 1024 * v * (2 + 8)
    small = yashard_peak(1000, shape, chunked, loss_chunk_tokens=256)
    assert _moment(y, "loss (one chunk)") - _moment(small, "loss (one chunk)") == (1024 - 256) * v * 10
    with pytest.raises(ValueError, match=r"loss_chunk_tokens=0: the fused loss's tokens per chunk, an int >= 1"):
        yashard_peak(1000, shape, chunked, loss_chunk_tokens=0)
    for engine in (fsdp2_peak(shape, hf, world=8, param_bytes=2), deepspeed_zero3_peak(shape, hf, world=8, param_bytes=2)):
        chunk = (fsdp2_peak if engine.engine == "fsdp2" else deepspeed_zero3_peak)(shape, chunked, world=8, param_bytes=2)
        assert chunk.bytes < engine.bytes, engine.engine


def test_step_in_backward_drops_the_gradient_shards_from_yashards_state():
    import yashard
    from yashard.plan import grad_shard_bytes

    cfg = preset_config("llama-3-8b")
    import torch

    planned = yashard.plan(cfg, world_size=8, config=yashard.ShardConfig(param_dtype=torch.bfloat16))
    shape = shape_of(cfg)
    acts = _acts(shape, "chunked")
    state = planned.total_bytes + planned.adamw_bytes
    saves = grad_shard_bytes(planned)
    assert saves == 4 * shape.total_numel // 8
    off, on = yashard_peak(state, shape, acts), yashard_peak(state, shape, acts, step_in_backward_saves=saves)
    assert off.state - on.state == saves and off.bytes - on.bytes == saves
    with pytest.raises(ValueError, match=r"step_in_backward_saves=-1: the fp32 gradient shards' bytes, between 0"):
        yashard_peak(state, shape, acts, step_in_backward_saves=-1)


def test_bad_loss_arguments_are_refused():
    shape = _shape("llama-3-8b")
    with pytest.raises(ValueError, match=r"loss='fused': the estimate knows 'hf', 'chunked'"):
        activations(shape, seq=8, micro_batch=1, param_bytes=2, loss="fused")
    with pytest.raises(ValueError, match=r"loss_chunks=0: the number of sequence chunks of the loss, an int >= 1"):
        activations(shape, seq=8, micro_batch=1, param_bytes=2, loss="chunked", loss_chunks=0)


def _rows(out: str) -> dict[str, tuple[float, float]]:
    """The peak table's rows: engine -> (state, peak) in GiB."""
    rows = {}
    for name in ("yashard", "FSDP2", "DeepSpeed ZeRO-3"):
        line = next(line for line in out.splitlines() if line.startswith(f"  {name} ") and "GiB" not in line)
        state, peak = line[len(name) + 2:].split()[:2]
        rows[name] = (float(state), float(peak))
    return rows


def test_the_cli_flags_change_the_right_rows(capsys):
    from yashard.plan.__main__ import main

    base = ["--config", "llama-3-8b", "--world", "8", "--checkpoint-layers", "32"]
    outs = {}
    for flags in ((), ("--fsdp2-root-group",), ("--loss", "chunked"), ("--loss", "chunked", "--step-in-backward")):
        assert main([*base, *flags]) == 0
        outs[flags] = capsys.readouterr().out
    rows = {k: _rows(v) for k, v in outs.items()}
    plain, root = rows[()], rows[("--fsdp2-root-group",)]
    assert root["yashard"] == plain["yashard"] and root["DeepSpeed ZeRO-3"] == plain["DeepSpeed ZeRO-3"]
    assert (plain["FSDP2"][1], root["FSDP2"][1]) == (20.17, 21.56)
    assert "[norm, lm_head] kept gathered" in outs[()] and "(--fsdp2-root-group)" in outs[("--fsdp2-root-group",)]
    chunked, step = rows[("--loss", "chunked")], rows[("--loss", "chunked", "--step-in-backward")]
    assert all(chunked[e][1] < plain[e][1] for e in plain) and all(chunked[e][0] == plain[e][0] for e in plain)
    assert "chunked loss:" in outs[("--loss", "chunked")] and "8 sequence chunks" in outs[("--loss", "chunked")]
    assert step["FSDP2"] == chunked["FSDP2"] and step["DeepSpeed ZeRO-3"] == chunked["DeepSpeed ZeRO-3"]
    assert round(chunked["yashard"][0] - step["yashard"][0], 2) == 3.74  # 4 N/W, the fp32 gradient shards
    assert "(--step-in-backward): no fp32 gradient shards" in outs[("--loss", "chunked", "--step-in-backward")]
    assert "with --step-in-backward: no fp32 grad shards, model state 15.296 GiB, 3.739 GiB less" in outs[
        ("--loss", "chunked", "--step-in-backward")]


@pytest.mark.parametrize("args, message", [
    (["--step-in-backward", "--grad-accum", "2"], "--step-in-backward with --grad-accum 2: the step in backward "
                                                  "consumes each gradient as it is reduced"),
    (["--loss", "fused"], "argument --loss: invalid choice: 'fused'"),
])
def test_bad_mode_flags_are_usage_errors(args, message, capsys):
    from yashard.plan.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["--config", "llama-3-8b", "--world", "8", *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err, err


def test_share_outer_slot_on_a_tied_model_names_a_command_the_cli_accepts(tmp_path, capsys):
    """Issue 41: the message told the user to pass --share-outer-slot=False, which the CLI rejects."""
    from models import tiny_config
    from yashard.plan.__main__ import main

    tiny_config("llama", tie_word_embeddings=True).save_pretrained(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(["--config", str(tmp_path), "--world", "2", "--share-outer-slot"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Drop --share-outer-slot (it is off by default)" in err, err
    assert "--share-outer-slot=" not in err
    assert main(["--config", str(tmp_path), "--world", "2"]) == 0  # (the command it names runs)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("loss", ["hf", "chunked"])
@pytest.mark.parametrize("root_group", [False, True])
def test_fsdp2s_timeline_frees_what_it_allocates(tied, loss, root_group):
    """At the backward's end FSDP2 holds its state, every gradient shard, the last group's
    reduce-scatter input and the logits the output keeps (none with a chunked loss): nothing else."""
    from models import tiny_config

    shape = shape_of(tiny_config("llama", tie_word_embeddings=tied))
    acts = activations(shape, seq=64, micro_batch=1, param_bytes=2, checkpoint_layers=2, loss=loss)
    peak = fsdp2_peak(shape, acts, world=1, param_bytes=2, root_group=root_group)
    outer = shape.total_numel - shape.layers * shape.layer_numel
    last = outer if root_group or tied else shape.embed_numel
    assert peak.moments[-1].bytes == peak.state + shape.total_numel * 4 + last * 4 + acts.logits
    assert (acts.logits == 0) == (loss == "chunked")
