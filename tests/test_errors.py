"""Every user-facing error of yashard, matched by message.

Layout errors (``yashard.layout``) are covered in ``test_layout.py``. Errors that need a process
group use a 1-rank gloo group initialised in this process by the module-scoped ``pg`` fixture; the
test of the "no process group" error comes first and needs no group (when one is already
initialised, it runs in a fresh interpreter instead).
"""

import contextlib
import math
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

import yashard

from models import build, tiny_config


def _ids(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 96, (2, 8), generator=g)


def _loss(sm, seed: int = 0):
    x = _ids(seed)
    return sm(input_ids=x, labels=x, use_cache=False).loss


# ---------------------------------------------------------------------------------------------
# No process group (must run before the ``pg`` fixture initialises one).


def test_shard_without_process_group():
    pattern = r"yashard\.shard needs an initialised process group: call torch\.distributed\.init_process_group\(\)"
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match=pattern):
            yashard.shard(nn.Linear(2, 2))
        return
    # Some other test left a group initialised: check in a fresh interpreter.
    code = "import torch.nn as nn, yashard\nyashard.shard(nn.Linear(2, 2))\n"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(__file__)),
                                                        os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode != 0
    assert re.search(pattern, proc.stderr), proc.stderr


# ---------------------------------------------------------------------------------------------
# ShardConfig validation (pure: no process group).


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, "bf16"])
def test_config_bad_param_dtype(dtype):
    name = str(dtype).replace("torch.", "")
    with pytest.raises(ValueError, match=rf"ShardConfig\.param_dtype={name} is not supported; use torch\.float32"):
        yashard.ShardConfig(param_dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int8])
def test_config_bad_reduce_dtype(dtype):
    name = str(dtype).replace("torch.", "")
    with pytest.raises(ValueError, match=rf"ShardConfig\.reduce_dtype={name} is not supported; .*or None \(fp32\)"):
        yashard.ShardConfig(reduce_dtype=dtype)


def test_config_fp16_reduce_with_bf16_params():
    with pytest.raises(ValueError, match=r"reduce_dtype=float16 cannot carry gradients of param_dtype=bfloat16.*"
                                         r"use reduce_dtype=torch\.float32 or torch\.bfloat16"):
        yashard.ShardConfig(param_dtype=torch.bfloat16, reduce_dtype=torch.float16)


def test_config_checkpoint_layers_negative():
    with pytest.raises(ValueError, match=r"ShardConfig\.checkpoint_layers must be >= 0, got -1"):
        yashard.ShardConfig(checkpoint_layers=-1)


@pytest.mark.parametrize("value, tname", [(True, "bool"), (1.5, "float"), ("2", "str")])
def test_config_checkpoint_layers_not_an_int(value, tname):
    with pytest.raises(TypeError, match=rf"ShardConfig\.checkpoint_layers must be an int \(number of layers\), got {tname}"):
        yashard.ShardConfig(checkpoint_layers=value)


@pytest.mark.parametrize("value", [0, -16, 2.0, "16"])
def test_config_bad_shard_align(value):
    with pytest.raises(ValueError, match=rf"ShardConfig\.shard_align must be a positive int, got {re.escape(repr(value))}"):
        yashard.ShardConfig(shard_align=value)



@pytest.mark.parametrize("field, value, exc, message", [
    ("shard_group_size", 0, ValueError, r"ShardConfig\.shard_group_size must be a positive int \(ranks per group\) or None, got 0"),
    ("secondary_group_size", True, ValueError, r"ShardConfig\.secondary_group_size must be a positive int .* got True"),
    ("quantized_weights", 16, ValueError, r"ShardConfig\.quantized_weights=16 is not supported; use 8 \(int8\), 4 \(int4\) or None"),
    ("quant_block", 7, ValueError, r"ShardConfig\.quant_block must be an even int in \[2, 32768\], got 7"),
    ("on_nonfinite", "warn", ValueError, r"ShardConfig\.on_nonfinite='warn'; use 'raise', 'skip' or 'ignore'"),
    ("debug_collectives", "yes", TypeError, r"ShardConfig\.debug_collectives must be a bool, got str"),
    ("collective_timeout", 0, ValueError, r"ShardConfig\.collective_timeout must be a positive number of seconds or None, got 0"),
    ("collective_timeout", "60", ValueError, r"ShardConfig\.collective_timeout must be .* got '60'"),
    ("collective_timeout", float("inf"), ValueError, r"ShardConfig\.collective_timeout=inf is longer than a wait can "
                                                     r"be bounded by \(at most \d+ s\); pass None for no bound"),
    ("collective_timeout", float("nan"), ValueError, r"ShardConfig\.collective_timeout must be a positive .* got nan"),
    ("device", "meta", ValueError, r"ShardConfig\.device='meta': yashard trains on 'cpu' \(gloo\) or 'cuda' \(NCCL\) "
                                   r"devices; build the model on the meta device"),
    ("reshard_after_forward", "no", TypeError, r"ShardConfig\.reshard_after_forward must be a bool, got str"),
])
def test_config_bad_field(field, value, exc, message):
    with pytest.raises(exc, match=message):
        yashard.ShardConfig(**{field: value})

# ---------------------------------------------------------------------------------------------
# shard() argument checks that fire before the process group is looked at.


def test_shard_needs_a_module():
    with pytest.raises(TypeError, match=r"yashard\.shard expects an nn\.Module, got dict"):
        yashard.shard({"weight": torch.zeros(2)})


def test_shard_config_of_wrong_type():
    with pytest.raises(TypeError, match=r"config must be a yashard\.ShardConfig, got dict"):
        yashard.shard(nn.Linear(2, 2), config={"param_dtype": torch.bfloat16})


# ---------------------------------------------------------------------------------------------
# Errors that need a process group: one rank, gloo, in this process (the ``pg`` fixture, conftest.py).


def test_shard_twice(pg):
    sm = yashard.shard(build())
    with pytest.raises(ValueError, match=r"model is already sharded by yashard; call yashard\.shard once per model"):
        yashard.shard(sm)


def test_plain_sequential_has_no_decoder_structure(pg):
    with pytest.raises(ValueError, match=r"cannot find the decoder structure of Sequential \(model_type=None\)") as ei:
        yashard.shard(nn.Sequential(nn.Embedding(96, 8), nn.Linear(8, 96)))
    msg = str(ei.value)
    # what was expected ...
    assert "a non-empty nn.ModuleList of decoder layers at 'model.layers'" in msg
    assert "a token embedding module at 'model.embed_tokens'" in msg
    assert "a lm_head module at 'lm_head'" in msg
    # ... what was found, and how to fix it
    assert "Found top-level children: 0 (Embedding), 1 (Linear)" in msg
    assert "AutoModelForCausalLM" in msg


def test_unlisted_model_type_of_the_usual_shape_is_sharded_by_the_generic_spec(pg):
    from yashard.patch import FAMILIES

    model, ref = build(), build()
    model.config.model_type = "my_llama_variant"  # not in FAMILIES: the generic spec must take it
    assert "my_llama_variant" not in FAMILIES
    sm = yashard.shard(model)
    ids = torch.randint(0, 96, (2, 8))
    loss = sm(input_ids=ids, labels=ids).loss
    loss.backward()
    ref_loss = ref(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) < 1e-6 * abs(ref_loss.item())
    grads = sm.full_grads()
    for name, p in ref.named_parameters():
        assert torch.allclose(grads[name], p.grad, rtol=1e-5, atol=1e-7), name


def test_hf_model_without_lm_head(pg):
    model = build()
    del model.lm_head
    with pytest.raises(ValueError, match=r"decoder structure of LlamaForCausalLM \(model_type='llama'\): "
                                         r"expected a lm_head module at 'lm_head'\.") as ei:
        yashard.shard(model)
    msg = str(ei.value)
    assert "decoder layers" not in msg and "token embedding" not in msg  # only the missing part is named
    assert "Found top-level children: model (LlamaModel); model.* children: embed_tokens (Embedding), layers (ModuleList)" in msg


def test_hf_base_model_is_not_a_causal_lm(pg):
    from transformers import AutoModel

    with pytest.raises(ValueError, match=r"decoder structure of LlamaModel .*decoder layers at 'model\.layers'.*"
                                         r"Found top-level children: embed_tokens \(Embedding\), layers \(ModuleList\)"
                                         r".*Pass an HF causal LM \(AutoModelForCausalLM\)"):
        yashard.shard(AutoModel.from_config(tiny_config()))


def test_empty_layer_list(pg):
    model = build()
    model.model.layers = nn.ModuleList()
    with pytest.raises(ValueError, match=r"expected a non-empty nn\.ModuleList of decoder layers at 'model\.layers'\."):
        yashard.shard(model)


def test_partly_meta_model(pg):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config())
    model.lm_head.weight = nn.Parameter(torch.zeros(model.lm_head.weight.shape))
    with pytest.raises(ValueError, match=r"parameter model\.embed_tokens\.weight is on the meta device but "
                                         r"lm_head\.weight is not; build the whole model on the meta device"):
        yashard.shard(model)


def test_non_float_parameter(pg):
    model = build()
    model.model.register_parameter("step", nn.Parameter(torch.zeros(2, 2, dtype=torch.long), requires_grad=False))
    with pytest.raises(ValueError, match=r"parameter model\.step has dtype torch\.int64; "
                                         r"yashard shards floating-point parameters only"):
        yashard.shard(model)


def test_parameter_outside_layers_embed_and_lm_head(pg):
    model = build()
    model.model.extra = nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(ValueError, match=r"parameter model\.extra \(shape \(4, 4\)\) is outside the decoder layers "
                                         r"\('model\.layers'\), the embedding \('model\.embed_tokens'\) and the lm_head "
                                         r"\('lm_head'\); yashard cannot shard it"):
        yashard.shard(model)


def test_parameter_shared_between_decoder_layers(pg):
    model = build()
    model.model.layers[1].mlp.up_proj.weight = model.model.layers[0].mlp.up_proj.weight
    with pytest.raises(ValueError, match=r"parameter model\.layers\.0\.mlp\.up_proj\.weight is also "
                                         r"model\.layers\.1\.mlp\.up_proj\.weight; yashard supports sharing only "
                                         r"between the embedding and the lm_head \(tied embeddings\): untie it"):
        yashard.shard(model)


def test_checkpoint_layers_larger_than_the_model(pg):
    with pytest.raises(ValueError, match=r"ShardConfig\.checkpoint_layers=5 but the model has 4 decoder layers; "
                                         r"use a value between 0 and 4"):
        yashard.shard(build(), config=yashard.ShardConfig(checkpoint_layers=5))


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning")
@pytest.mark.parametrize("enable", ["gradient_checkpointing_enable", "activation_checkpointing_enable"])
def test_hf_gradient_checkpointing_enabled(pg, enable):
    model = build()
    if not hasattr(model, enable):
        pytest.skip(f"this transformers has no {enable}()")
    getattr(model, enable)()
    with pytest.raises(ValueError, match=r"HF activation checkpointing enabled \(activation_checkpointing_enable\(\) / "
                                         r"gradient_checkpointing_enable\(\)\).*Turn it off "
                                         r"\(model\.gradient_checkpointing_disable\(\)\) and use "
                                         r"ShardConfig\(checkpoint_layers=N\) instead"):
        yashard.shard(model)


def test_cuda_device_with_gloo_group(pg):
    # torch.device("cuda") can be built on a CPU-only torch; the backend check fires before any CUDA use.
    with pytest.raises(ValueError, match=r"device cuda needs an NCCL process group, but the group's backend is gloo"):
        yashard.shard(build(), config=yashard.ShardConfig(device="cuda"))


def test_cpu_device_with_non_gloo_group(pg):
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")  # registers backend "fake"
    del fake_pg
    try:
        group = dist.new_group([0], backend="fake")
    except Exception as e:  # pragma: no cover - depends on the torch build
        pytest.skip(f"cannot create a 'fake' backend group: {e}")
    with pytest.raises(ValueError, match=r"the CPU device needs a gloo process group, but the group's backend is fake"):
        yashard.shard(build(), config=yashard.ShardConfig(device="cpu"), process_group=group)


def test_clip_grad_norm_unsupported_norm_type_and_max_norm(pg):
    sm = yashard.shard(build())
    _loss(sm).backward()
    for p in (0, -1, -math.inf, math.nan):
        with pytest.raises(ValueError, match=rf"clip_grad_norm_ norm_type={float(p)}: use a p-norm with p > 0 \(2, 1, \.\.\.\) or inf"):
            sm.clip_grad_norm_(1.0, norm_type=p)
    for m in (math.nan, -1.0):  # torch's would scale every gradient by NaN (or flip their signs)
        with pytest.raises(ValueError, match=rf"clip_grad_norm_ max_norm={m}: it must be a number >= 0"):
            sm.clip_grad_norm_(m)
    assert sm.clip_grad_norm_(math.inf).item() > 0   # inf: the norm alone, nothing clipped


def test_gather_full_bad_what(pg):
    sm = yashard.shard(build())
    with pytest.raises(ValueError, match=r"what must be 'params' or 'grads', got 'weights'"):
        sm.runtime.gather_full("weights")


# ---------------------------------------------------------------------------------------------
# Runtime order errors.


def _sharded_with_layers():
    model = build()
    sm = yashard.shard(model)
    return model, sm, list(model.model.layers)


def test_layers_run_out_of_order(pg):
    model, sm, layers = _sharded_with_layers()
    model.model.layers = nn.ModuleList(layers[::-1])
    with pytest.raises(yashard.OrderError, match=r"decoder layer model\.layers\.3 ran its forward but model\.layers\.0 "
                                                 r"was expected next.*\(a layer was skipped, repeated or called out of order\)"):
        _loss(sm)


def test_layer_runs_twice(pg):
    model, sm, layers = _sharded_with_layers()
    model.model.layers = nn.ModuleList([layers[0], layers[0], layers[1], layers[2]])
    with pytest.raises(yashard.OrderError, match=r"decoder layer model\.layers\.0 ran its forward but model\.layers\.1 "
                                                 r"was expected next"):
        _loss(sm)


def test_layer_runs_after_the_last_layer(pg):
    model, sm, layers = _sharded_with_layers()
    model.model.layers = nn.ModuleList(layers + [layers[3]])
    model.config.num_hidden_layers = 5
    with pytest.raises(yashard.OrderError, match=r"decoder layer model\.layers\.3 ran after all 4 layers of this "
                                                 r"forward already ran; .*exactly once per forward, in order"):
        _loss(sm)


def test_order_error_does_not_poison_the_model(pg):
    model, sm, layers = _sharded_with_layers()
    model.model.layers = nn.ModuleList(layers[::-1])
    with pytest.raises(yashard.OrderError):
        _loss(sm)
    model.model.layers = nn.ModuleList(layers)
    loss = _loss(sm)
    loss.backward()
    assert torch.isfinite(loss)


def test_backward_after_a_newer_forward(pg):
    # Forward #1 completes; forward #2 starts but aborts before reaching the lm_head (a layer out of
    # order); then backward of forward #1 reaches the lm_head, whose weights belong to forward #2.
    model, sm, layers = _sharded_with_layers()
    loss1 = _loss(sm)
    model.model.layers = nn.ModuleList(layers[::-1])
    with pytest.raises(yashard.OrderError):
        _loss(sm)
    with pytest.raises(yashard.OrderError, match=r"backward reached lm_head of forward #1, but forward #2 ran since; "
                                                 r".*call backward\(\) before the next grad-enabled forward"):
        loss1.backward()


def test_two_forwards_then_backward_of_the_first(pg):
    sm = yashard.shard(build())
    loss1 = _loss(sm, 0)
    _loss(sm, 1)
    with pytest.raises(yashard.OrderError, match=r"forward #1, but forward #2 ran since"):
        loss1.backward()


def test_second_backward_of_one_forward_accumulates_like_pytorch(pg):
    # retain_graph=True and a second backward: every layer is gathered again and the gradients add up.
    sm = yashard.shard(build())
    loss = _loss(sm)
    loss.backward(retain_graph=True)
    once = {k: v.clone() for k, v in sm.full_grads().items()}
    loss.backward()
    twice = sm.full_grads()
    for k in once:
        torch.testing.assert_close(twice[k], 2 * once[k], rtol=1e-6, atol=1e-9)


def test_optimizer_step_or_load_between_forward_and_backward(pg, tmp_path):
    """The backward of a graph built with weights changed since (a step, a checkpoint loaded) is
    refused; the load itself is not (after a forward that failed, loading is how one recovers)."""
    sm = yashard.shard(build())
    opt = torch.optim.SGD(sm.parameters(), lr=0.1)
    _loss(sm).backward()          # masters now have gradients, so step() changes them
    yashard.save_checkpoint(tmp_path / "ck", sm, opt)
    loss = _loss(sm)
    opt.step()
    with pytest.raises(RuntimeError, match=r"the master weights of lm_head changed between forward and backward "
                                           r"\(an optimizer\.step\(\), yashard\.load_checkpoint or an in-place edit "
                                           r"of the shards\), and this graph was built with the old ones"):
        loss.backward()
    loss = _loss(sm)
    yashard.load_checkpoint(tmp_path / "ck", sm, opt)
    with pytest.raises(RuntimeError, match=r"changed between forward and backward"):
        loss.backward()
    _loss(sm).backward()          # a new forward after the load trains on


# ---------------------------------------------------------------------------------------------
# Checks added after review: sharding twice, and validation before the model is touched.


def test_shard_the_same_hf_model_twice(pg):
    model = build()
    yashard.shard(model)
    with pytest.raises(ValueError, match=r"already sharded"):
        yashard.shard(model)


def test_rejected_config_leaves_the_model_untouched(pg):
    model = build()
    n = len(list(model.parameters()))
    with pytest.raises(ValueError, match=r"checkpoint_layers=5"):
        yashard.shard(model, config=yashard.ShardConfig(checkpoint_layers=5))
    assert len(list(model.parameters())) == n
    assert not model._forward_pre_hooks


# ---------------------------------------------------------------------------------------------
# Loading weights from a HuggingFace folder (yashard.shard(weights=...) / yashard.from_pretrained).


def _meta(**overrides):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(tiny_config(**overrides))


def test_weights_folder_missing(pg, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"weights='.*nowhere' is not a directory; pass a HuggingFace checkpoint folder"):
        yashard.shard(_meta(), weights=tmp_path / "nowhere")


def test_weights_folder_with_pickles_only(pg, tmp_path):
    torch.save({"x": torch.zeros(1)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match=r"has neither model\.safetensors nor model\.safetensors\.index\.json "
                                                r"\(found: pytorch_model\.bin\)\. It holds pickled weights, which yashard "
                                                r"never loads"):
        yashard.shard(_meta(), weights=tmp_path)


def test_weights_folder_of_another_model(pg, tmp_path):
    build(hidden_size=48, num_hidden_layers=3).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"the weights in .* do not fit the model: 9 parameter\(s\) of the model are not "
                                         r"in the folder \(model\.layers\.3\..*\) and 30 have other shapes "
                                         r"\(model\.embed_tokens\.weight: folder \[96, 48\], model \[96, 32\];.*"
                                         r"Build the model from the folder's own config\.json"):
        yashard.shard(_meta(), weights=tmp_path)


def test_weights_folder_with_a_truncated_file(pg, tmp_path):
    build().save_pretrained(tmp_path)
    f = tmp_path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor '.*' claims bytes \[\d+, \d+\) but the data "
                                         r"section holds \d+ bytes .* the file is truncated or corrupt"):
        yashard.shard(_meta(), weights=tmp_path)
    model = _meta()
    assert all(p.is_meta for p in model.parameters())  # nothing was taken from the model


def test_qgz_state_errors(pg):
    from yashard.comm_hooks import QgzState

    sm = yashard.shard(build())
    cases = [
        (dict(ranks_per_node=2), r"QgzState: ranks_per_node=2 must be a positive divisor of the shard group size 1"),
        (dict(ranks_per_node=1, rounding="up"), r"QgzState: rounding must be 'auto', 'stochastic' or 'nearest', got 'up'"),
        (dict(ranks_per_node=1, seed=-3), r"QgzState: seed must be an int in \[0, 2\*\*32\), got -3"),
        (dict(ranks_per_node=1, bits=2), r"quantization bits must be 8 or 4, got 2"),
    ]
    for kw, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            QgzState(sm, **kw)
    assert QgzState(sm, 1).rounding == "stochastic" and QgzState(sm, 1, bits=8).rounding == "nearest"
    assert (QgzState(sm, 1).block, QgzState(sm, 1, bits=8).block, QgzState(sm, 1, block=1024).block) == (64, 256, 1024)


def test_mesh_errors(pg):
    """A mesh that is not a DeviceMesh, has more than 2 dims, or conflicts with another setting."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    with pytest.raises(TypeError, match=r"mesh must be a torch\.distributed\.device_mesh\.DeviceMesh, got list"):
        yashard.shard(build(), mesh=[[0]])
    mesh3 = DeviceMesh("cpu", torch.zeros(1, 1, 1, dtype=torch.long), mesh_dim_names=("pp", "dp_replicate", "dp_shard"))
    with pytest.raises(ValueError, match=r"yashard takes a 1-D \(shard\) or 2-D \(replicate, shard\) device mesh, got "
                                         r"a 3-D mesh with dims \('pp', 'dp_replicate', 'dp_shard'\); pass the "
                                         r"data-parallel dims only, e\.g\. mesh\['dp_replicate', 'dp_shard'\]"):
        yashard.shard(build(), mesh=mesh3)
    mesh2 = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
    with pytest.raises(ValueError, match=r"ShardConfig\(shard_group_size=1\) and the 2-D mesh \(shape \(1, 1\), dims "
                                         r"\('replicate', 'shard'\)\) both set the shard groups; pass one of them"):
        yashard.shard(build(), mesh=mesh2, config=yashard.ShardConfig(shard_group_size=1))
    with pytest.raises(ValueError, match=r"pass the data-parallel ranks once: process_group= or a 1-D mesh=, not both"):
        yashard.shard(build(), mesh=mesh2["shard"], process_group=pg)
    sm = yashard.shard(build(), mesh=mesh2)  # a 1 x 1 mesh is plain sharding over one rank
    assert sm.runtime.comm.shard_world == 1 and sm.runtime.comm.replica_group is None


def test_shard_group_size_that_does_not_divide_the_world(pg):
    with pytest.raises(ValueError, match=r"shard_group_size=2 does not divide the world size 1; use a divisor of 1"):
        yashard.shard(build(), config=yashard.ShardConfig(shard_group_size=2))


# ---------------------------------------------------------------------------------------------
# reshard_after_forward=False and no_sync().


def test_config_hpz_without_resharding():
    with pytest.raises(ValueError, match=r"ShardConfig\.secondary_group_size=2 \(hpZ\) keeps weight slices for the "
                                         r"backward re-gathers, but reshard_after_forward=False .* drop "
                                         r"secondary_group_size or use reshard_after_forward=True"):
        yashard.ShardConfig(reshard_after_forward=False, secondary_group_size=2)


def test_no_sync_needs_per_unit_buffers(pg, monkeypatch):
    from yashard import build as rt_mod

    # (over one rank gradients accumulate in master.grad, and no_sync() is allowed: take more ranks' path)
    monkeypatch.setattr(rt_mod, "direct_grads", lambda direct, world, cfg: False)
    sm = yashard.shard(build())
    with pytest.raises(RuntimeError, match=r"model\.no_sync\(\) needs ShardConfig\(reshard_after_forward=False\): "
                                           r"by default the decoder layers take turns in two gradient buffers"):
        with sm.no_sync():
            pass


def test_no_sync_needs_fp32_gradient_buffers(pg):
    sm = yashard.shard(build(), config=yashard.ShardConfig(reshard_after_forward=False, reduce_dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match=r"model\.no_sync\(\) would add micro-batches' gradients in the "
                                           r"reduce_dtype=bfloat16 gradient buffers.*reduce_dtype=torch\.float32"):
        with sm.no_sync():
            pass


def _unsynced():
    sm = yashard.shard(build(), config=yashard.ShardConfig(reshard_after_forward=False))
    with sm.no_sync():
        _loss(sm).backward()
    return sm


@pytest.mark.parametrize("call, what", [
    (lambda sm: torch.optim.AdamW(sm.parameters()).step(), r"AdamW\.step\(\)"),
    (lambda sm: sm.clip_grad_norm_(1.0), r"clip_grad_norm_"),
    (lambda sm: sm.full_grads(), r"full_grads\(\)"),
])
def test_unreduced_gradients_are_refused(pg, call, what):
    sm = _unsynced()
    with pytest.raises(RuntimeError, match=what + r" after a backward inside model\.no_sync\(\): the gradients of "
                                                  r"model\.embed_tokens, model\.layers\.0, model\.layers\.1 and 4 more "
                                                  r"were accumulated on this rank but never reduced across ranks\. "
                                                  r"Run the last micro-batch's forward and backward outside no_sync\(\)"):
        call(sm)


def _grads(sm) -> dict:
    return {k: v.clone() for k, v in sm.full_grads().items()}


def test_no_sync_accumulates_and_zero_grad_drops_what_it_held(pg):
    """no_sync + one synced backward gives the gradients of both micro-batches; a zero_grad in
    between (either mode) drops what no_sync held, as it drops DDP's accumulated .grad."""
    cfg = yashard.ShardConfig(reshard_after_forward=False)
    ref = yashard.shard(build(), config=cfg)
    _loss(ref, 0).backward()
    _loss(ref, 1).backward()
    both = _grads(ref)
    ref.zero_grad()
    _loss(ref, 1).backward()
    second = _grads(ref)

    sm = yashard.shard(build(), config=cfg)
    opt = torch.optim.SGD(sm.parameters(), lr=0.0)
    with sm.no_sync():
        _loss(sm, 0).backward()
    _loss(sm, 1).backward()
    for k, v in _grads(sm).items():
        torch.testing.assert_close(v, both[k], rtol=1e-6, atol=1e-9)
    for set_to_none in (True, False):
        opt.zero_grad(set_to_none=set_to_none)
        with sm.no_sync():
            _loss(sm, 0).backward()
        opt.zero_grad(set_to_none=set_to_none)
        _loss(sm, 1).backward()
        for k, v in _grads(sm).items():
            torch.testing.assert_close(v, second[k], rtol=1e-6, atol=1e-9)
        # dropped, nothing unreduced is left: the clip and the step no longer refuse
        opt.zero_grad(set_to_none=set_to_none)
        with sm.no_sync():
            _loss(sm, 0).backward()
        with pytest.raises(RuntimeError, match=r"after a backward inside model\.no_sync\(\)"):
            sm.clip_grad_norm_(1.0)
        opt.zero_grad(set_to_none=set_to_none)
        sm.clip_grad_norm_(1.0)
        opt.step()


def test_no_sync_keeps_gradients_of_parameters_the_last_micro_batch_skips(pg):
    """A parameter with gradients in a no_sync() micro-batch and none in the synced one keeps what
    was held (the unwritten ranges of a held buffer are not zeroed)."""
    def run(sm, no_sync: bool):
        mlp = sm.module.model.layers[1].mlp
        with sm.no_sync() if no_sync else contextlib.nullcontext():
            _loss(sm, 0).backward()
        mlp.forward = lambda x: mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)))  # up_proj gets no gradient
        _loss(sm, 1).backward()
        return _grads(sm)

    want = run(yashard.shard(build()), no_sync=False)
    got = run(yashard.shard(build(), config=yashard.ShardConfig(reshard_after_forward=False)), no_sync=True)
    assert torch.count_nonzero(want["model.layers.1.mlp.up_proj.weight"]) > 0
    for k, v in got.items():
        torch.testing.assert_close(v, want[k], rtol=1e-6, atol=1e-9)


# ---------------------------------------------------------------------------------------------
# Lifetime.


@pytest.mark.parametrize("last_forward", ["train", "no_grad"])
def test_a_dropped_model_frees_its_buffers(pg, last_forward):
    """Deleting the model and its optimizer frees the runtime and every buffer it allocated,
    whether the last forward built a graph (the parameter views then carry autograd nodes) or not."""
    import gc
    import weakref

    sm = yashard.shard(build())
    opt = torch.optim.AdamW(sm.parameters(), lr=1e-3)
    _loss(sm).backward()
    opt.step()
    opt.zero_grad()
    if last_forward == "train":
        _loss(sm).backward()
    else:
        with torch.no_grad():
            _loss(sm)
    runtime = weakref.ref(sm.runtime)
    slot = weakref.ref(next(iter(sm.runtime.slots.values())).weights)
    del sm, opt
    gc.collect()
    assert runtime() is None and slot() is None


def test_cuda_device_must_be_the_current_one():
    from yashard.api import cuda_device

    assert cuda_device(torch.device("cuda"), 2) == torch.device("cuda", 2)  # no index: the current device
    assert cuda_device(torch.device("cuda", 1), 1) == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=re.escape(
            "ShardConfig(device='cuda:1') but the current CUDA device is cuda:0; NCCL and yashard's streams work on "
            "the current device. Call torch.cuda.set_device(1) before yashard.shard")):
        cuda_device(torch.device("cuda", 1), 0)


def test_a_clip_norm_that_overflows_is_refused_at_the_step(pg):
    """Finite gradients whose squares overflow fp32 make the clip norm inf, and clipping by it
    would zero every gradient: the step check reports the layer instead of stepping on zeros."""
    sm = yashard.shard(build())
    opt = torch.optim.AdamW(sm.parameters(), lr=1e-3)
    _loss(sm).backward()
    layer = sm.runtime.layers[1]
    layer.master.grad[0] = 1e30  # finite, but its square is not
    assert torch.isfinite(layer.master.grad).all()
    assert not torch.isfinite(sm.clip_grad_norm_(1.0))
    with pytest.raises(yashard.NonFiniteError, match=r"non-finite gradients in model\.layers\.1\b"):
        opt.step()


def test_state_dict_is_refused_with_the_alternatives(pg, tmp_path):
    """Every rank's flat shards under the same names: torch.save / torch.distributed.checkpoint
    would silently keep one rank's piece, so state_dict() refuses and names what to use."""
    sm = yashard.shard(build())
    for call in (sm.state_dict, sm.module.state_dict, lambda: sm.module.save_pretrained(tmp_path / "hf")):
        with pytest.raises(RuntimeError, match=r"state_dict\(\) of a yashard-sharded model: .*silently keep one "
                                               r"rank's piece.*yashard\.save_checkpoint\(path, model, optimizer\).*"
                                               r"model\.sharded_state_dict\(\) with torch\.distributed\.checkpoint.*"
                                               r"model\.full_state_dict\(\).*yashard\.export_hf"):
            call()
    # a submodule's state_dict() left its sharded parameters out without a word (it has none)
    for sub in (sm.module.model, sm.module.lm_head, sm.module.model.layers[0], sm.module.model.layers[0].mlp.up_proj):
        with pytest.raises(RuntimeError, match=r"state_dict\(\) of a yashard-sharded model"):
            sub.state_dict()
    assert sm.module.model.rotary_emb.state_dict() == {}  # (no parameter of its own: as before)
    with pytest.raises(RuntimeError, match=r"load_state_dict\(\) into a yashard-sharded model: .*yashard\.load_checkpoint"
                                           r".*dcp\.load\(model\.sharded_state_dict\(\), checkpoint_id=path\)"
                                           r".*yashard\.from_pretrained"):
        sm.load_state_dict({})
    assert set(sm.full_state_dict()) == set(build().state_dict())  # the collective form works
    sd = sm.sharded_state_dict()                                    # and the DCP form
    assert set(sd) == set(build().state_dict())
    w = sd["model.layers.0.mlp.up_proj.weight"]
    assert repr(w) == "ShardedParameter(model.layers.0.mlp.up_proj.weight, shape=(64, 32), 2048 elements on this rank in 1 boxes)"
    with pytest.raises(TypeError, match=r"aten\.\w+\.default on a yashard ShardedParameter: sharded_state_dict\(\) is "
                                        r"for torch\.distributed\.checkpoint \(dcp\.save / dcp\.load; dcp\.async_save with "
                                        r"async_stager=yashard\.dcp\.SnapshotStager\(\)\); read full tensors"):
        w.clone()
    with pytest.raises(TypeError, match=r"pickling \(torch\.save\) a yashard ShardedParameter \(model\.layers\.0\.mlp"
                                        r"\.up_proj\.weight\) would keep only this rank's part; save with dcp\.save"):
        torch.save(w, tmp_path / "w.pt")


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_generate_matches_the_unsharded_model(pg, family):
    """HF's generate() reads model.device / model.dtype from a parameter, and a sharded HF module has
    none: they answer the runtime's device and compute dtype, and greedy decoding (KV cache on)
    gives the unsharded model's tokens."""
    ref = build(family).eval()
    sm = yashard.shard(build(family)).eval()
    assert sm.module.device == torch.device("cpu") and sm.module.dtype == torch.float32
    assert type(sm.module).__name__ == type(ref).__name__ and isinstance(sm.module, type(ref))
    prompt = _ids(3)[:, :4]
    with torch.no_grad():
        want = ref.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
        got = sm.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert got.shape == (2, 10) and torch.equal(got, want)


@pytest.mark.parametrize("tied", [False, True])
def test_hf_parameter_counts_include_the_sharded_parameters(pg, tied):
    """HF's num_parameters() counts the module's own parameters, and a sharded HF module has none
    left: it counts what the unsharded model counts (tied weights once; without embeddings too).
    get_memory_footprint() is this rank's master shards plus the buffers."""
    ref = build("qwen2", tie_word_embeddings=tied)
    sm = yashard.shard(build("qwen2", tie_word_embeddings=tied))
    for kw in ({}, {"only_trainable": True}, {"exclude_embeddings": True}):
        assert sm.num_parameters(**kw) == sm.module.num_parameters(**kw) == ref.num_parameters(**kw) > 0, kw
    assert ref.num_parameters(exclude_embeddings=True) < ref.num_parameters()
    buffers = sum(b.numel() * b.element_size() for b in sm.module.buffers())
    assert sm.module.get_memory_footprint() == sum(p.numel() * 4 for p in sm.parameters()) + buffers


@pytest.mark.parametrize("tied", [False, True])
def test_the_inner_base_model_answers_device_dtype_and_counts(pg, tied):
    """The causal LM's base model (``model.model``, what get_decoder() returns) holds no parameters
    after shard() either: its device and dtype raised StopIteration and num_parameters() said 0.
    They answer as the unsharded base model's; HF checkpointing through it is refused too."""
    ref = build("qwen2", tie_word_embeddings=tied).to(torch.bfloat16)
    sm = yashard.shard(build("qwen2", tie_word_embeddings=tied).to(torch.bfloat16))
    inner = sm.module.get_decoder()
    assert inner is sm.module.model and type(inner).__name__ == type(ref.model).__name__
    assert inner.device == torch.device("cpu") and inner.dtype == torch.bfloat16
    for kw in ({}, {"only_trainable": True}, {"exclude_embeddings": True}):
        assert inner.num_parameters(**kw) == ref.model.num_parameters(**kw) > 0, kw
    with pytest.raises(ValueError, match=r"HF activation checkpointing on a yashard-sharded model"):
        inner.gradient_checkpointing_enable()


def test_the_hf_module_answers_its_shards_as_its_parameters(pg):
    """As FSDP2 leaves a module: after shard(), the HF module's parameters are this rank's shards (the
    ShardedModel's, same names), so code that kept the HF module acts on what trains. Before, its
    parameters() was empty: hf.zero_grad() left a stray backward's gradients in place and torch's
    clip_grad_norm_(hf.parameters()) returned 0 and clipped nothing, without a word."""
    ref = build()
    hf = build()
    sm = yashard.shard(hf)
    assert [(n, id(p)) for n, p in hf.named_parameters()] == [(n, id(p)) for n, p in sm.named_parameters()]
    assert [n for n, _ in hf.named_parameters(prefix="m")][0] == "m.shards.embed"
    assert hf.num_parameters() == ref.num_parameters()  # the unsharded count, not the padded shards'
    _loss(sm, seed=1).backward()  # a stray backward ...
    hf.zero_grad()               # ... dropped through the HF module
    assert all(p.grad is None for p in sm.parameters())
    _loss(sm).backward()
    _loss(ref).backward()
    norm = torch.nn.utils.clip_grad_norm_(hf.parameters(), 1e-3)  # the global norm, and it clips
    want = torch.cat([p.grad.flatten() for p in ref.parameters()]).norm()
    torch.testing.assert_close(norm, want, rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.cat([p.grad for p in hf.parameters()]).norm(), torch.tensor(1e-3), rtol=1e-4, atol=0)
    with pytest.raises(RuntimeError, match=r"model\.embed_tokens\.weight \(shape \(96, 32\)\) is a parameter of the "
                                           r"sharded model that yashard\.shard did not shard"):
        hf.model.embed_tokens.weight_extra = nn.Parameter(torch.zeros(96, 32))
        hf.model.embed_tokens._parameters["weight"] = hf.model.embed_tokens._parameters.pop("weight_extra")
        torch.optim.SGD(sm.parameters(), lr=0.1).step()


def test_dtype_and_device_conversions_are_refused(pg):
    sm = yashard.shard(build())
    masters = [p.data_ptr() for p in sm.parameters()]
    for convert in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.double(),
                    lambda m: m.module.to(torch.bfloat16), lambda m: m.to("meta")):
        with pytest.raises(ValueError, match=r"converting a yashard-sharded model to (torch\.(bfloat16|float16|float64)|meta) "
                                             r"would break its fp32 master shards.*ShardConfig\(param_dtype=torch\.bfloat16\)"):
            convert(sm)
    assert sm.to("cpu") is sm and sm.float() is sm and sm.module.to(torch.float32) is sm.module  # no-ops pass
    assert [p.data_ptr() for p in sm.parameters()] == masters and all(p.dtype == torch.float32 for p in sm.parameters())
    _loss(sm).backward()  # still trains


@pytest.mark.parametrize("checkpoint_layers", [0, 2])
def test_weights_read_outside_the_forward_raise_instead_of_showing_another_layer(pg, checkpoint_layers):
    """Decoder layers take turns in two buffers: after the forward, layer 0's module attributes would
    view the buffer that now holds layer 2. They are taken off once nothing reads them (after the
    forward, or after the backward for activation-checkpointed layers); what is read then is a stub
    with the parameter's metadata, and anything that needs its values says why it cannot have them."""
    sm = yashard.shard(build(num_hidden_layers=4), config=yashard.ShardConfig(checkpoint_layers=checkpoint_layers))
    ref = build(num_hidden_layers=4)
    q0 = sm.module.model.layers[0].self_attn.q_proj
    loss = _loss(sm)
    # off after the forward, checkpointed or not (a checkpointed layer's backward puts its forward's
    # views back for the recompute: its BackwardEntry node keeps them, so they live with the graph)
    assert "weight" not in q0.__dict__
    loss.backward()
    w = q0.weight
    assert isinstance(w, yashard.ShardedStub) and w.shape == (32, 32) and w.dtype == torch.float32
    assert w.device == torch.device("cpu") and w.requires_grad and w.detach().shape == (32, 32)
    for use in (lambda: w + 1, lambda: torch.equal(w, ref.model.layers[0].self_attn.q_proj.weight), w.tolist,
                w.data_ptr, w.untyped_storage, lambda: w.float().sum(), lambda: w.data.clone(),
                lambda: torch.nn.functional.linear(torch.ones(2, 32), w)):
        with pytest.raises(RuntimeError, match=r"^model\.layers\.0\.self_attn\.q_proj\.weight is sharded by "
                                               r"yashard.*: .*model\.full_state_dict\(\)"):
            use()
    with torch.no_grad():
        _loss(sm)
    with pytest.raises(RuntimeError, match=r"^lm_head\.weight is sharded by yashard \(aten\.sum\.default needs its values\)"):
        sm.module.lm_head.weight.sum()
    assert isinstance(q0, nn.Linear) and type(q0).__name__ == "Linear" and q0.in_features == 32
    # the norm weights sit in a buffer of their own: they stay readable, with the right values
    norm = sm.module.model.layers[3].input_layernorm.weight
    assert torch.equal(norm, ref.model.layers[3].input_layernorm.weight)
    with pytest.raises(AttributeError, match=r"no attribute 'nonexistent'"):
        q0.nonexistent  # other missing attributes keep torch's message


def test_a_stub_answers_the_runtimes_device_and_param_dtype_whatever_the_shards_hold(pg):
    """The stub's metadata is the runtime's, fixed at ``shard()``: the device as configured
    (``cpu:0`` stays ``cpu:0``, as ``model.device`` answers) and ``param_dtype``, also after a
    shard's data was replaced (refused at the next forward, not at a read before it)."""
    sm = yashard.shard(build(num_hidden_layers=2), config=yashard.ShardConfig(device="cpu:0"))
    head = sm.module.lm_head
    assert head.weight.device == sm.module.device == torch.device("cpu", 0)
    for p in sm.parameters():
        p.data = p.data.double()
    assert head.weight.dtype == torch.float32 and head.weight.device == torch.device("cpu", 0)


def test_a_sharded_weight_read_outside_its_unit_gives_what_the_unit_computes_in(pg):
    """The stub's dtype and device are those the gathered weights will have (``param_dtype``, not
    the masters' fp32), so ``x.to(lm_head.weight.dtype)`` in an HF forward casts to what the head
    computes in; ``requires_grad`` follows the shard (frozen at ``shard()``, or turned off after)."""
    model = build(num_hidden_layers=2)
    model.model.layers[1].self_attn.k_proj.weight.requires_grad_(False)
    sm = yashard.shard(model, config=yashard.ShardConfig(param_dtype=torch.bfloat16))
    head, k1 = sm.module.lm_head, sm.module.model.layers[1].self_attn.k_proj
    assert head.weight.dtype == torch.bfloat16 and head.weight.shape == (96, 32) and head.weight.requires_grad
    assert not k1.weight.requires_grad and sm.module.model.layers[1].self_attn.q_proj.weight.requires_grad
    sm.requires_grad_(False)
    assert not head.weight.requires_grad
    sm.requires_grad_(True)
    assert head.weight.requires_grad
    assert "ShardedStub(lm_head.weight, shape=(96, 32), dtype=torch.bfloat16" in repr(head.weight)
    # freezing one after shard(): the stub took the flag and lost it (a new one each read), so nothing froze
    for freeze in (lambda: setattr(head.weight, "requires_grad", False), lambda: head.weight.requires_grad_(False),
                   lambda: [p.requires_grad_(False) for p in [sm.module.model.embed_tokens.weight]]):
        with pytest.raises(RuntimeError, match=r"^setting requires_grad of (lm_head|model\.embed_tokens)\.weight after "
                                               r"yashard\.shard: .*would freeze nothing\. Freeze them before "
                                               r"yashard\.shard .*or turn a whole master shard off"):
            freeze()
    assert head.weight.requires_grad
    head.weight.requires_grad = True  # (to what it is: nothing to do)
    head.weight.requires_grad_()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_print_model_shows_the_unsharded_modules(pg, family):
    """print(model) reads shapes in extra_repr (RMSNorm: weight.shape; Linear: bias is not None, and
    Qwen2's q/k/v projections have sharded biases): it shows what the unsharded model shows, before a
    forward, after one, and inside one (where the running layer's attributes are real views)."""
    model = build(family, num_hidden_layers=2)
    before = repr(model)
    sm = yashard.shard(model)
    assert repr(sm.module) == before and repr(sm).startswith(f"ShardedModel(\n  (module): {type(model).__name__}(\n")
    seen = []
    sm.module.model.layers[1].register_forward_pre_hook(lambda m, a: seen.append(repr(m)))
    _loss(sm).backward()
    assert repr(sm.module) == before and seen == [repr(model.model.layers[1])]
    assert torch.equal(sm.module.model.layers[1].input_layernorm.weight,
                       build(family, num_hidden_layers=2).model.layers[1].input_layernorm.weight)  # views kept


@pytest.mark.parametrize("kind", ["Adafactor", "LBFGS", "ZeroRedundancyOptimizer", "transformers.Adafactor"])
def test_optimizers_that_need_whole_parameters_are_refused(pg, kind):
    import transformers.optimization
    from torch.distributed.optim import ZeroRedundancyOptimizer

    sm = yashard.shard(build())
    make = {"Adafactor": lambda: torch.optim.Adafactor(sm.parameters(), lr=1e-2),
            "transformers.Adafactor": lambda: transformers.optimization.Adafactor(
                sm.parameters(), lr=1e-3, relative_step=False, scale_parameter=False),
            "LBFGS": lambda: torch.optim.LBFGS(sm.parameters()),
            "ZeroRedundancyOptimizer": lambda: ZeroRedundancyOptimizer(sm.parameters(), torch.optim.AdamW, lr=1e-3)}
    opt = make[kind]()
    before = [p.detach().clone() for p in sm.parameters()]
    ids = torch.randint(0, 96, (2, 8))
    sm(input_ids=ids, labels=ids).loss.backward()
    match = (r"ZeroRedundancyOptimizer over yashard master shards: .* use the plain torch\.optim optimizer"
             if kind == "ZeroRedundancyOptimizer" else
             rf"{kind.split('.')[-1]} over yashard master shards: its update depends on each parameter's shape .* Use an "
             r"element-wise")
    with pytest.raises(TypeError, match=match):
        opt.step((lambda: sm(input_ids=ids, labels=ids).loss) if kind == "LBFGS" else None)
    assert all(torch.equal(a, p) for a, p in zip(before, sm.parameters()))


def test_a_model_distributed_by_fsdp2_is_refused(pg):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = build()
    mesh = init_device_mesh("cpu", (1,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    with pytest.raises(ValueError, match=r"the model is already distributed by FSDP \(FSDPLlamaForCausalLM at the root\): "
                                         r"yashard shards a plain HF model itself"):
        yashard.shard(model)


def test_pickling_or_copying_a_sharded_model_is_refused(pg, tmp_path):
    import copy

    sm = yashard.shard(build())
    for what in (lambda: torch.save(sm, tmp_path / "m.pt"), lambda: copy.deepcopy(sm),
                 lambda: torch.save(sm.module, tmp_path / "m.pt"), lambda: copy.deepcopy(sm.module),
                 lambda: torch.optim.swa_utils.AveragedModel(sm)):
        with pytest.raises(TypeError, match=r"a yashard-sharded model \((ShardedModel|LlamaForCausalLM)\) cannot be "
                                            r"pickled or copied .* for an EMA, keep copies of the master shards"):
            what()


def test_hf_checkpointing_after_shard_is_refused(pg):
    sm = yashard.shard(build())
    for name in ("gradient_checkpointing_enable", "activation_checkpointing_enable"):
        if hasattr(sm.module, name):
            with pytest.raises(ValueError, match=r"HF activation checkpointing on a yashard-sharded model .* "
                                                 r"ShardConfig\(checkpoint_layers=N\)"):
                getattr(sm, name)()
    _loss(sm).backward()  # nothing was changed


def test_freezing_after_shard_and_hooks_on_shards_are_refused(pg):
    """Both would be silently ignored: a module of the sharded model holds no parameter any more
    (which parameters train is fixed at shard()), autograd never calls hooks on the shards."""
    sm = yashard.shard(build())
    for module in (sm.module.model.embed_tokens, sm.module.model.layers[0], sm.module.model.layers,
                   sm.module.model, sm.module.model.layers[1].mlp):
        with pytest.raises(ValueError, match=rf"{type(module).__name__}\.requires_grad_\(False\) on a yashard-sharded "
                                             r"model: which parameters train is fixed when yashard\.shard runs .* "
                                             r"Freeze them before yashard\.shard"):
            module.requires_grad_(False)
    sm.module.model.embed_tokens.requires_grad_(True)  # a no-op, allowed
    sm.requires_grad_(False)
    with torch.no_grad():
        _loss(sm)  # inference needs no gradients
    assert not _loss(sm).requires_grad  # every shard off: nothing needs a gradient, as in torch
    sm.module.requires_grad_(True)  # the HF module's requires_grad_ reaches the shards
    assert all(p.requires_grad for p in sm.parameters())
    sm.module.requires_grad_(False)
    assert not any(p.requires_grad for p in sm.parameters())
    assert sm.num_parameters(only_trainable=True) == 0 < sm.num_parameters()
    sm.requires_grad_(True)
    for register in (lambda p: p.register_hook(lambda g: g), lambda p: p.register_post_accumulate_grad_hook(lambda p: None)):
        handle = register(list(sm.parameters())[1])
        with pytest.raises(ValueError, match=r"a hook is registered on the master shard layer_0 .* autograd would never "
                                             r"call it.*model\.register_comm_hook"):
            _loss(sm)
        handle.remove()
    _loss(sm).backward()


def test_replacing_a_master_shards_data_is_refused(pg):
    """``p.data = x`` (or ``model.to_empty``) swaps a shard's storage without moving its version
    counter: gathered copies, the gradient buffer and the checkpoint views would keep the old one.
    The next forward and the next optimizer step refuse it; putting the storage back makes the
    model usable again."""
    sm = yashard.shard(build())
    opt = torch.optim.AdamW(sm.parameters(), lr=1e-3)
    _loss(sm).backward()
    shard = dict(sm.named_parameters())["shards.layer_1"]
    kept = shard.data
    for new, what in ((kept.clone(), r"another buffer"), (torch.zeros(3), r"now \(3,\) float32 on cpu, was \(\d+,\)")):
        shard.data = new
        for call in (lambda: _loss(sm), opt.step):
            with pytest.raises(RuntimeError, match=rf"the master shard layer_1 no longer holds the storage yashard\.shard "
                                                   rf"gave it \(.*{what}.*p\.data = \.\.\. .* with torch\.no_grad\(\): "
                                                   r"p\.copy_\(new_values\)"):
                call()
    shard.data = kept
    opt.step()
    with torch.no_grad():
        shard.copy_(shard * 0.5)  # the supported way: in place
    _loss(sm).backward()
    sm.to_empty(device="cpu")  # a module-wide _apply gives every shard a new (uninitialised) buffer
    with pytest.raises(RuntimeError, match=r"the master shard embed no longer holds the storage .* another buffer\): "
                                           r"it was replaced, through p\.data = \.\.\. or a module-wide "
                                           r"\.cuda\(\)/\.to_empty\(\)/_apply"):
        _loss(sm)


@pytest.mark.parametrize("reshard", [True, False])
def test_writes_through_data_are_seen_by_the_next_forward(pg, reshard):
    """An in-place write through ``p.data`` (old-style optimizers, clamping, init code) moves the
    shard's version as a write under ``torch.no_grad()`` does, so the next forward uses the new
    values (here the bf16 copy cast from the masters, which is kept while their version stays)."""
    losses = []
    for how in ("none", "no_grad", "data"):
        sm = yashard.shard(build(), config=yashard.ShardConfig(param_dtype=torch.bfloat16,
                                                              reshard_after_forward=reshard))
        with torch.no_grad():
            _loss(sm)  # casts and gathers every shard
            shard = dict(sm.named_parameters())["shards.layer_1"]
            if how == "no_grad":
                shard.mul_(0.5)
        if how == "data":
            shard.data.mul_(0.5)
        losses.append(_loss(sm).detach())
    assert not torch.equal(losses[0], losses[1])  # the write changes the loss
    assert torch.equal(losses[1], losses[2])


def test_parameters_frozen_before_shard_stay_frozen(pg):
    """Freezing is decided at shard(): what was frozen then cannot be switched on afterwards (it has
    no gradient storage), and the optimizer groups and parameter counts follow it."""
    model = build()
    model.model.embed_tokens.requires_grad_(False)
    model.model.layers[2].self_attn.q_proj.weight.requires_grad_(False)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    sm = yashard.shard(model)
    masters = dict(sm.named_parameters())
    assert not masters["shards.embed"].requires_grad and masters["shards.layer_2"].requires_grad
    assert sm.num_parameters(only_trainable=True) == trainable
    groups = sm.param_groups(0.1)
    assert all(p is not masters["shards.embed"] for g in groups for p in g["params"])
    for module, name in ((sm.module.model.layers[2], "q_proj"), (sm.module.model.embed_tokens, "embed_tokens")):
        with pytest.raises(ValueError, match=rf"requires_grad_\(True\) on a yashard-sharded model: .*{name}\.weight "
                                             r"were frozen \(requires_grad=False\) when yashard\.shard ran and stay frozen"):
            module.requires_grad_(True)
    for root in (sm, sm.module):
        root.requires_grad_(False)
        assert not any(p.requires_grad for p in sm.parameters())
        root.requires_grad_(True)  # back to what shard() decided
        assert not masters["shards.embed"].requires_grad and masters["shards.layer_2"].requires_grad
    masters["shards.embed"].requires_grad_(True)
    with pytest.raises(ValueError, match=r"the master shard embed was set to require gradients, but its parameters "
                                         r"\(model\.embed_tokens\.weight\) were all frozen .* no gradient buffer"):
        _loss(sm)
    masters["shards.embed"].requires_grad_(False)
    _loss(sm).backward()
    assert masters["shards.embed"].grad is None and masters["shards.layer_2"].grad is not None
    # torch's clip given the trainable shards only (the usual filter) is the global norm still
    trained = [p for p in sm.parameters() if p.requires_grad]
    assert torch.nn.utils.clip_grad_norm_(trained, float("inf")) == sm.clip_grad_norm_(float("inf"))
    with pytest.raises(ValueError, match=r"only some of a sharded model's shards"):
        torch.nn.utils.clip_grad_norm_(trained[1:], 1.0)
    # (a rank whose plan had a gradient buffer for the embedding would hold 4 bytes per element more)
    assert "embed.grad" not in sm.runtime.allocated_tensors()


def test_a_shard_turned_off_between_forward_and_backward_gets_no_gradient(pg):
    """As torch leaves a parameter whose requires_grad was turned off after the forward: no .grad."""
    sm = yashard.shard(build())
    masters = dict(sm.named_parameters())
    loss = _loss(sm)
    masters["shards.layer_1"].requires_grad_(False)
    loss.backward()
    assert masters["shards.layer_1"].grad is None and masters["shards.layer_0"].grad is not None
    masters["shards.layer_1"].requires_grad_(True)
    _loss(sm).backward()
    assert masters["shards.layer_1"].grad is not None


def test_optimizer_state_is_made_for_shards_turned_off_for_now(pg):
    """sharded_optim_state_dict of a fresh optimizer creates state for every shard that can train,
    also those turned off at the moment (a dcp.load into it would otherwise drop theirs), and none
    for a shard whose parameters were all frozen at shard()."""
    model = build()
    model.model.embed_tokens.requires_grad_(False)
    sm = yashard.shard(model)
    opt = torch.optim.AdamW(sm.parameters(), lr=1e-3)
    sm.requires_grad_(False)
    sm.sharded_optim_state_dict(opt)
    assert {n for n, p in sm.named_parameters() if opt.state.get(p)} == {n for n, _ in sm.named_parameters()} - {
        "shards.embed"}


def test_slots_of_only_frozen_units_hold_no_gradient_buffer(pg, monkeypatch):
    from yashard import build as rt_mod

    # (one rank adds gradients to the masters' in place, with no gradient slots: take the slot path)
    monkeypatch.setattr(rt_mod, "direct_grads", lambda direct, world, cfg: False)
    model = build()
    for layer in model.model.layers:
        layer.requires_grad_(False)
    sm = yashard.shard(model, config=yashard.ShardConfig(reshard_after_forward=False))
    slots = sm.runtime.slots
    frozen = [name for name in slots if name.startswith("layer_")]
    assert frozen and all(slots[n].grads.numel() == 0 < slots[n].numel for n in frozen)
    assert slots["lm_head"].grads.numel() == slots["lm_head"].numel
    plan = sm.memory_plan()
    assert plan.total_bytes == sum(t.numel() * t.element_size() for t in sm.runtime.allocated_tensors().values())
    assert "G=0" in str(plan)
    _loss(sm).backward()


def test_everything_frozen_leaves_no_param_groups(pg):
    model = build()
    model.requires_grad_(False)
    sm = yashard.shard(model)
    with pytest.raises(ValueError, match=r"param_groups\(\): every parameter of the model is frozen"):
        sm.param_groups(0.1)
    with torch.no_grad():
        _loss(sm)
    assert not _loss(sm).requires_grad


def test_writing_gathered_norm_weights_in_place_is_refused(pg, monkeypatch):
    """The norm group's views stay readable between forwards; writing through one changes a gathered
    copy, which the next forward would use and the next optimizer step would silently drop. (Gathered
    copies as on more ranks; at one rank the views read the shards in place: test_one_rank.py.)"""
    monkeypatch.setattr(yashard.build, "direct_slots", lambda w, cfg: False)
    sm = yashard.shard(build())
    ids = _ids(0)
    with torch.no_grad():
        before = sm(input_ids=ids, labels=ids).loss
        sm.module.model.norm.weight.fill_(2.0)
        with pytest.raises(RuntimeError, match=r"the gathered weights of the norm group were written in place through the "
                                               r"model's modules .* then lost, and full_state_dict\(\) would not show it"):
            sm(input_ids=ids, labels=ids)
        assert torch.equal(sm(input_ids=ids, labels=ids).loss, before)  # gathered again from the masters
    _loss(sm).backward()


def test_the_base_model_called_on_its_own_is_refused(pg):
    """The base model called on its own (before any forward, and after one) used to fail inside the
    runtime ('NoneType' has no attribute 'wait', then a misleading layer-order error)."""
    sm = yashard.shard(build())
    ids = _ids(0)
    match = r"layer_0 ran outside a forward of the whole model: .* output_hidden_states=True returns every layer's"
    with pytest.raises(yashard.OrderError, match=match):
        sm.module.model(input_ids=ids)
    _loss(sm).backward()
    with pytest.raises(yashard.OrderError, match=match):
        sm.module.model(input_ids=ids)
    out = sm(input_ids=ids, labels=ids, output_hidden_states=True)  # the way to get hidden states
    assert len(out.hidden_states) == sm.module.config.num_hidden_layers + 1
    out.loss.backward()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_name_based_no_decay_rules_group_the_shards_as_param_groups_does(pg, family):
    """Every shard is 1-D; by name, the norm group is 'shards.norms_and_biases', so HF Trainer's
    decay rule (and the common `"bias" in name or "norm" in name` one) picks param_groups' split."""
    from transformers import Trainer

    sm = yashard.shard(build(family))
    names = dict(sm.named_parameters())
    assert list(names) == ["shards.embed", *(f"shards.layer_{i}" for i in range(len(sm.module.model.layers))),
                           "shards.lm_head", "shards.norms_and_biases"]
    decay, no_decay = sm.param_groups(0.1)
    hf = set(Trainer.get_decay_parameter_names(None, sm))
    assert {id(names[n]) for n in hf} == {id(p) for p in decay["params"]}
    common = [p for n, p in names.items() if not ("bias" in n or "norm" in n)]
    assert [id(p) for p in common] == [id(p) for p in decay["params"]] and no_decay["weight_decay"] == 0.0


def test_torch_distributed_state_dict_helpers_are_refused(pg):
    """get_optimizer_state_dict(model, opt) would hand DCP the flat per-rank optimizer shards under
    keys every rank shares (DCP keeps one): refused, on the ShardedModel and on its HF module."""
    from torch.distributed.checkpoint import state_dict as dsd

    sm = yashard.shard(build())
    opt = torch.optim.AdamW(sm.parameters(), lr=1e-3)
    _loss(sm).backward()
    opt.step()
    match = (r"torch\.distributed\.checkpoint\.state_dict \(get_/set_model_state_dict, .*\) on a yashard-sharded "
             r"model: .* model\.sharded_optim_state_dict\(optimizer\)")
    for call in (lambda: dsd.get_optimizer_state_dict(sm, opt), lambda: dsd.get_state_dict(sm, opt),
                 lambda: dsd.get_model_state_dict(sm), lambda: dsd.get_optimizer_state_dict(sm.module, opt),
                 lambda: dsd.set_optimizer_state_dict(sm, opt, {})):
        with pytest.raises(TypeError, match=match):
            call()


def test_a_step_right_after_a_failed_backward_is_refused(pg):
    """Until the next forward resets the runtime, the gradients of a backward that raised are
    incomplete: the step, the clip and full_grads refuse them; zero_grad and a new batch go on."""
    sm = yashard.shard(build(num_hidden_layers=4))
    opt = torch.optim.AdamW(sm.parameters(), lr=1e-3)
    boom = {"on": True}

    def raise_once(module, grad_in, grad_out):
        if boom.pop("on", False):
            raise RuntimeError("simulated out of memory")

    sm.module.model.layers[2].register_full_backward_hook(raise_once)
    with pytest.raises(RuntimeError, match="simulated out of memory"):
        _loss(sm).backward()
    before = [p.detach().clone() for p in sm.parameters()]
    for call in (opt.step, lambda: sm.clip_grad_norm_(1.0), sm.full_grads):
        with pytest.raises(RuntimeError, match=r"after a backward that raised: its gradients are incomplete .* "
                                               r"optimizer\.zero_grad\(\) and go on with the next batch"):
            call()
    assert all(torch.equal(a, p) for a, p in zip(before, sm.parameters()))
    opt.zero_grad()
    _loss(sm).backward()
    sm.clip_grad_norm_(1.0)
    opt.step()


def test_a_forward_that_raised_leaves_no_forward_open(pg):
    """A forward that raises (here in layer 1) runs the model's forward hook all the same: the input
    embedding called on its own afterwards starts the next forward (fresh weights), and the base model
    called on its own gets the intended refusal."""
    sm = yashard.shard(build(num_hidden_layers=4))
    boom = {"on": True}

    def raise_once(module, args):
        if boom.pop("on", False):
            raise RuntimeError("simulated failure in forward")

    sm.module.model.layers[1].register_forward_pre_hook(raise_once)
    with pytest.raises(RuntimeError, match="simulated failure in forward"):
        _loss(sm)
    embed = sm.runtime.embed
    with torch.no_grad():
        embed.master.mul_(2.0)  # a change the embedding must see
        got = sm.get_input_embeddings()(_ids(0))
    want = 2.0 * build(num_hidden_layers=4).model.embed_tokens(_ids(0))
    assert torch.equal(got, want)
    with pytest.raises(yashard.OrderError, match=r"layer_0 ran outside a forward of the whole model"):
        sm.module.model(input_ids=_ids(0))
    _loss(sm).backward()


def test_a_parameter_added_after_shard_is_refused_at_the_next_forward_or_step(pg):
    """A module swapped in after shard() (get_peft_model, say) is refused by the next grad-enabled
    forward, and by the step when it came after the backward."""
    sm = yashard.shard(build())
    opt = torch.optim.AdamW(sm.parameters(), lr=1e-3)
    _loss(sm).backward()
    opt.step()  # nothing added yet: steps
    mlp = sm.module.model.layers[0].mlp
    original = mlp.up_proj
    mlp.up_proj = nn.Linear(mlp.up_proj.in_features, mlp.up_proj.out_features, bias=False)
    added = (r"model\.layers\.0\.mlp\.up_proj\.weight \(shape \(\d+, \d+\)\) is a parameter of the sharded model that "
             r"yashard\.shard did not shard: it was added afterwards \(peft's get_peft_model, a module replaced or "
             r"appended\?\).*Apply it before sharding")
    with pytest.raises(RuntimeError, match=added):
        _loss(sm)
    mlp.up_proj = original
    opt.zero_grad()
    _loss(sm).backward()
    mlp.up_proj = nn.Linear(mlp.up_proj.in_features, mlp.up_proj.out_features, bias=False)
    with pytest.raises(RuntimeError, match=added):
        opt.step()


def test_a_parameter_put_into_a_module_dict_after_a_step_is_refused(pg):
    """The step's check compares a snapshot of the modules (their parameters and children) once it
    has walked the model; a parameter written straight into ``_parameters``, where no setattr hook
    sees it, still differs from the snapshot and is found."""
    sm = yashard.shard(build())
    opt = torch.optim.AdamW(sm.parameters(), lr=1e-3)
    for _ in range(2):
        _loss(sm).backward()
        opt.step()  # nothing added yet: steps (the second through the snapshot)
        opt.zero_grad()
    _loss(sm).backward()
    attn = sm.module.model.layers[1].self_attn
    attn._parameters["extra"] = nn.Parameter(torch.zeros(3))
    with pytest.raises(RuntimeError, match=r"model\.layers\.1\.self_attn\.extra \(shape \(3,\)\) is a parameter "
                                           r"of the sharded model that yashard\.shard did not shard"):
        opt.step()


def test_backward_with_create_graph_is_refused_and_the_next_step_is_clean(pg):
    """Gradients go into the flat buffers as data: a graph of them cannot be built, so
    backward(create_graph=True) raises at the first gradient (naming the fix), and the next
    micro-batch trains as if that backward never ran (the failed-backward reset)."""
    ref, sm = build(), yashard.shard(build())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(sm.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match=r"backward\(create_graph=True\) reached .*Call backward\(\) without create_graph"):
        _loss(sm, seed=1).backward(create_graph=True)
    opt.zero_grad()
    _loss(sm).backward()
    opt.step()
    _loss(ref).backward()
    ref_opt.step()
    torch.testing.assert_close(_loss(sm), _loss(ref), rtol=1e-5, atol=1e-6)


def test_step_check_flags_pack_into_words_and_back():
    """The per-parameter "got a gradient" flags travel in the step checks' all-gather as bits of int64
    words (62 per word): every pattern, across word boundaries, comes back as it went."""
    from yashard.guards import _pack_bits, _unpack_bits

    g = torch.Generator().manual_seed(0)
    for count in (0, 1, 61, 62, 63, 124, 200):
        rows = [torch.rand(count, generator=g) < 0.5 for _ in range(3)]
        rows[0][:] = True
        words = torch.stack([_pack_bits(r.tolist()) for r in rows])
        assert words.shape == (3, -(-count // 62)) and (words >= 0).all()
        assert torch.equal(_unpack_bits(words, count), torch.stack(rows))


def test_distributed_data_parallel_around_a_sharded_model_is_refused(pg):
    """DDP broadcasts rank 0's parameters (here its shards) over every rank's when it is built:
    at world 2 that changed the model by 0.13 without a word (what Accelerate's and HF Trainer's
    DDP wrapping would do). Refused, around the ShardedModel, its HF module or a module holding it;
    DDP of anything else is left alone."""
    sm = yashard.shard(build())

    class ValueHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm, self.head = sm, nn.Linear(4, 1)

    for module in (sm, sm.module, ValueHead()):
        with pytest.raises(RuntimeError, match=r"^DistributedDataParallel around (ShardedModel|LlamaForCausalLM|"
                                               r"ValueHead), which holds a yashard-sharded model: .* would overwrite "
                                               r"every rank's shards with rank 0's .* Train the sharded model without DDP"):
            torch.nn.parallel.DistributedDataParallel(module)
    torch.nn.parallel.DistributedDataParallel(nn.Linear(4, 4))
