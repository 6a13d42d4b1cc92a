"""HF folders that would load wrong are refused or reported, and HF model methods that do not fit
a sharded model say so (world 1, in-process)."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import yashard
from loading_workers import meta_model
from models import build


def _save(model, folder, **kw) -> str:
    model.save_pretrained(folder, **kw)
    return str(folder)


def _edit_config(folder, **changes) -> None:
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(path, "w") as f:
        json.dump(cfg, f)


def _edit_tensors(folder, fn) -> None:
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_quantized_folders_are_refused(pg, tmp_path):
    folder = _save(build(), tmp_path / "fp8")
    _edit_config(folder, quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    with pytest.raises(ValueError, match=r"holds quantized weights \(config.json quantization_config: fp8\); yashard "
                                         r"loads float weights only .* Dequantize first"):
        yashard.shard(meta_model("llama"), weights=folder)
    plain = _save(build(), tmp_path / "codes")  # float8 codes without a quantization_config
    _edit_tensors(plain, lambda t: t.__setitem__("model.layers.0.mlp.up_proj.weight",
                                                 t["model.layers.0.mlp.up_proj.weight"].to(torch.float8_e4m3fn)))
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.up_proj.weight is stored as torch.float8_e4m3fn; yashard "
                                         r"loads float weights only"):
        yashard.shard(meta_model("llama"), weights=plain)


def test_another_architecture_is_refused(pg, tmp_path):
    folder = _save(build("qwen2"), tmp_path / "qwen2")
    with pytest.raises(ValueError, match=r"is a qwen2 checkpoint \(config.json model_type\) and the model is a llama"):
        yashard.shard(meta_model("llama"), weights=folder)


def test_a_tied_model_and_a_folder_with_its_own_lm_head(pg, tmp_path):
    """transformers 5 keeps the two untied when they differ; yashard refuses rather than drop one,
    and loads a folder whose two tensors are equal."""
    folder = _save(build(), tmp_path / "untied")
    with pytest.raises(ValueError, match=r"stores model.embed_tokens.weight and lm_head.weight with different values, "
                                         r"but the model ties them"):
        yashard.shard(meta_model("llama", tie_word_embeddings=True), weights=folder)
    _edit_tensors(folder, lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"].clone()))
    sm = yashard.shard(meta_model("llama", tie_word_embeddings=True), weights=folder)
    assert torch.equal(sm.full_state_dict()["lm_head.weight"], load_file(f"{folder}/model.safetensors")["lm_head.weight"])


def test_a_broken_index_names_the_file(pg, tmp_path):
    folder = _save(build(), tmp_path / "sharded", max_shard_size="20KB")
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        index = json.load(f)
    files = sorted(set(index["weight_map"].values()))
    name = "model.layers.1.self_attn.q_proj.weight"
    right = index["weight_map"][name]
    other = next(f for f in files if f != right)
    index["weight_map"][name] = other
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    with pytest.raises(ValueError, match=rf"places {name} in {other}, which does not hold it"):
        yashard.shard(meta_model("llama"), weights=folder)
    index["weight_map"][name] = right
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    os.remove(os.path.join(folder, files[-1]))
    with pytest.raises(FileNotFoundError, match=rf"lists {files[-1]}, which is not in the folder"):
        yashard.shard(meta_model("llama"), weights=folder)


def test_leftover_tensors_and_config_differences_are_logged(pg, tmp_path, caplog):
    folder = _save(build(num_hidden_layers=6), tmp_path / "six")
    with caplog.at_level(logging.WARNING, logger="yashard"):
        sm = yashard.shard(meta_model("llama", rms_norm_eps=1e-2), weights=folder)
    text = caplog.text
    assert "18 tensor(s) in" in text and "model.layers.4.input_layernorm.weight" in text
    assert "num_hidden_layers: 6 -> 4" in text and "rms_norm_eps: 1e-06 -> 0.01" in text
    assert sm.full_state_dict()["model.layers.3.mlp.up_proj.weight"].shape == (64, 32)


def test_a_low_precision_model_computes_in_its_dtype(pg, tmp_path, caplog):
    ids = torch.randint(0, 96, (2, 8))
    sm = yashard.shard(build().to(torch.bfloat16))
    assert sm.runtime.config.param_dtype == torch.bfloat16 and sm.module.dtype == torch.bfloat16
    assert sm(input_ids=ids).logits.dtype == torch.bfloat16
    with caplog.at_level(logging.WARNING, logger="yashard"):
        sm = yashard.shard(build().to(torch.bfloat16), config=yashard.ShardConfig(reshard_after_forward=False))
    assert sm.runtime.config.param_dtype == torch.float32
    assert "the model's parameters are torch.bfloat16 but ShardConfig.param_dtype is torch.float32" in caplog.text
    folder = _save(build(), tmp_path / "fp32")
    sm = yashard.from_pretrained(folder, dtype=torch.bfloat16)
    assert sm.runtime.config.param_dtype == torch.bfloat16 and sm.runtime.units[0].master.dtype == torch.float32
    assert yashard.from_pretrained(folder).runtime.config.param_dtype == torch.float32
    # no dtype: transformers' from_pretrained default, the folder's own dtype ("auto") from 5.0 on
    import transformers

    bf16 = _save(build().to(torch.bfloat16), tmp_path / "bf16")
    want = torch.bfloat16 if int(transformers.__version__.split(".")[0]) >= 5 else torch.float32
    assert yashard.from_pretrained(bf16).runtime.config.param_dtype == want
    assert yashard.from_pretrained(bf16, dtype="auto").runtime.config.param_dtype == torch.bfloat16
    assert yashard.from_pretrained(bf16, dtype=torch.float32).runtime.config.param_dtype == torch.float32
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="yashard"):  # a config names the dtype: nothing to warn about
        sm = yashard.from_pretrained(bf16, config=yashard.ShardConfig(checkpoint_layers=1))
    assert sm.runtime.config.param_dtype == torch.float32 and "param_dtype" not in caplog.text


def test_tie_weights_is_a_no_op_and_resizing_is_refused(pg):
    sm = yashard.shard(build(tie_word_embeddings=True))
    ids = torch.randint(0, 96, (2, 8))
    before = sm(input_ids=ids).logits
    assert sm.module.tie_weights() is None
    assert torch.equal(sm(input_ids=ids).logits, before)
    with pytest.raises(ValueError, match=r"resize_token_embeddings on a yashard-sharded model.*resize the HF model "
                                         r"before yashard.shard"):
        sm.module.resize_token_embeddings(128)


def test_names_stored_under_another_layout_are_named(pg, tmp_path):
    """A folder whose names transformers would convert on loading (Mixtral's experts, say) is
    refused naming one stored name the model lacks, and what to do instead."""
    folder = _save(build(), tmp_path / "renamed")
    _edit_tensors(folder, lambda t: t.__setitem__("model.layers.0.mlp.w3.weight",
                                                  t.pop("model.layers.0.mlp.up_proj.weight")))
    with pytest.raises(ValueError, match=r"1 parameter\(s\) of the model are not in the folder "
                                         r"\(model.layers.0.mlp.up_proj.weight\).* The folder stores names the model "
                                         r"does not have \(e.g. model.layers.0.mlp.w3.weight\).*pass that model to "
                                         r"yashard.shard"):
        yashard.shard(meta_model("llama"), weights=folder)


def test_a_custom_code_folder_loads_with_trust_remote_code(pg, tmp_path):
    """from_pretrained(folder, trust_remote_code=True) passes the flag to the folder's config too
    (it was refused with transformers' advice to pass that very flag), and the config comparison
    reads config.json with the model's own config class (no second trust prompt)."""
    folder = tmp_path / "custom_llama"
    model = build()
    model.save_pretrained(folder)
    (folder / "configuration_my.py").write_text(
        "from transformers import LlamaConfig\n\nclass MyConfig(LlamaConfig):\n    model_type = 'myllama'\n")
    (folder / "modeling_my.py").write_text(
        "from transformers import LlamaForCausalLM\nfrom .configuration_my import MyConfig\n\n"
        "class MyForCausalLM(LlamaForCausalLM):\n    config_class = MyConfig\n")
    _edit_config(folder, model_type="myllama", architectures=["MyForCausalLM"],
                 auto_map={"AutoConfig": "configuration_my.MyConfig",
                           "AutoModelForCausalLM": "modeling_my.MyForCausalLM"})
    sm = yashard.from_pretrained(folder, trust_remote_code=True)
    assert type(sm.module).__name__ == "MyForCausalLM"
    full = sm.full_state_dict()
    assert all(torch.equal(full[k], v.detach()) for k, v in model.named_parameters())


def test_a_base_model_folder_loads_into_the_causal_lm(pg, tmp_path):
    """A folder saved by the base model (LlamaModel: no 'model.' prefix) is read into the causal LM
    as transformers reads it; without a tied head it is refused naming the base model and the
    way out (it was refused advising yashard.from_pretrained, the call that failed)."""
    from transformers import AutoModelForCausalLM
    from transformers import LlamaModel

    from models import tiny_config

    torch.manual_seed(0)
    tied = _save(LlamaModel(tiny_config("llama", tie_word_embeddings=True)), tmp_path / "base_tied")
    assert not any(k.startswith("model.") for k in load_file(f"{tied}/model.safetensors"))
    ref = AutoModelForCausalLM.from_pretrained(tied)
    sm = yashard.from_pretrained(tied)
    full = sm.full_state_dict()
    assert all(torch.equal(full[k], v) for k, v in ref.state_dict().items())
    untied = _save(LlamaModel(tiny_config("llama")), tmp_path / "base_untied")
    with pytest.raises(ValueError, match=r"not in the folder \(lm_head.weight\)\. The folder holds a base model "
                                         r"\(LlamaModel, names without 'model\.'\), which has no output head: tie"):
        yashard.from_pretrained(untied)


def test_a_stored_buffer_of_another_shape_is_refused(pg, tmp_path):
    """A persistent buffer the folder stores with another shape was read into the model's
    (its first numbers, or an out-of-range error naming flat offsets)."""
    model = build()
    model.model.layers[0].register_buffer("stat", torch.arange(8.0))
    folder = _save(model, tmp_path / "buf")
    for n in (4, 16):
        target = meta_model("llama")
        target.model.layers[0].register_buffer("stat", torch.zeros(n, device="meta"))
        with pytest.raises(ValueError, match=rf"stores buffer model.layers.0.stat with shape \[8\] and the model's "
                                             rf"is \[{n}\]"):
            yashard.shard(target, weights=folder)
    target = meta_model("llama")
    target.model.layers[0].register_buffer("stat", torch.zeros(8, device="meta"))
    assert torch.equal(yashard.shard(target, weights=folder).module.model.layers[0].stat, torch.arange(8.0))


def test_from_pretrained_names_what_it_cannot_do(pg, tmp_path, caplog):
    """transformers' from_pretrained arguments that mean nothing here were a raw TypeError from the
    model's __init__ (device_map, revision) and dtype=float64 computed in fp32 without a word; a
    missing folder or one without config.json got transformers' Hub errors."""
    folder = _save(build(), tmp_path / "fp32")
    with pytest.raises(ValueError, match=r"from_pretrained\(dtype=torch.float64\): yashard computes in float32, "
                                         r"bfloat16 or float16"):
        yashard.from_pretrained(folder, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"from_pretrained\(device_map=...\): in transformers it places weights on "
                                        r"devices; yashard puts every rank's shards on ShardConfig\(device=...\)"):
        yashard.from_pretrained(folder, device_map="cpu")
    with pytest.raises(TypeError, match=r"from_pretrained\(revision=...\): in transformers it finds files on the Hub"):
        yashard.from_pretrained(folder, revision="main")
    with pytest.raises(ValueError, match=r"use_safetensors=False\): yashard reads safetensors files only"):
        yashard.from_pretrained(folder, use_safetensors=False)
    from transformers import AutoConfig

    with pytest.raises(TypeError, match=r"from_pretrained\(config=...\) takes a yashard.ShardConfig, got LlamaConfig"):
        yashard.from_pretrained(folder, config=AutoConfig.from_pretrained(folder))
    # what yashard always does anyway is accepted
    sm = yashard.from_pretrained(folder, low_cpu_mem_usage=True, local_files_only=True, use_safetensors=True,
                                 dtype="bfloat16")
    assert sm.dtype == torch.bfloat16
    with pytest.raises(FileNotFoundError, match=r"reads a local checkpoint folder and '.*nowhere' is not a directory; "
                                                r"for a Hub model, download it first"):
        yashard.from_pretrained(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty has no config.json \(found: nothing\)"):
        yashard.from_pretrained(tmp_path / "empty")
    with caplog.at_level(logging.WARNING, logger="yashard"):
        yashard.shard(build().double())
    assert "parameter(s) are float64 (model.embed_tokens.weight, ...); yashard keeps fp32 master weights" in caplog.text
    # a float64 folder loaded with the default dtype ("auto": transformers would compute in float64)
    wide = build().double()
    folder64 = _save(wide, tmp_path / "fp64")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="yashard"):
        sm = yashard.from_pretrained(folder64)
    assert sm.dtype == torch.float32
    warned = f"{folder64} names dtype torch.float64, which yashard does not compute in; it computes in torch.float32"
    # transformers 4.x's default is fp32 whatever the folder holds: nothing to warn about there
    import transformers

    assert (warned in caplog.text) == (int(transformers.__version__.split(".")[0]) >= 5)
    assert torch.equal(sm.full_state_dict()["model.embed_tokens.weight"], wide.model.embed_tokens.weight.float())
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="yashard"):
        yashard.from_pretrained(folder64, dtype=torch.float32)
    assert "does not compute in" not in caplog.text


def test_config_differences_that_matter_only_sometimes():
    """max_position_embeddings changes nothing under plain, linear or Llama 3 RoPE and the
    frequencies under dynamic NTK, YaRN or LongRoPE; pad_token_id is the embedding's padding_idx, whose row never trains.
    Both were left out of the comparison whatever the config."""
    from types import SimpleNamespace

    from yashard.config_compare import config_dict as _config_dict, config_diff
    from models import tiny_config

    def cfg(**kw):
        return _config_dict(SimpleNamespace(config=tiny_config("llama", **kw)))

    assert config_diff(cfg(max_position_embeddings=64), cfg(max_position_embeddings=128)) == []
    dynamic = {"rope_type": "dynamic", "factor": 2.0}
    assert config_diff(cfg(max_position_embeddings=64, rope_scaling=dynamic),
                       cfg(max_position_embeddings=128, rope_scaling=dynamic)) == ["max_position_embeddings: 64 -> 128"]
    for linear in ({"rope_type": "linear", "factor": 2.0},
                   {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 32}):  # these do not read it
        assert config_diff(cfg(max_position_embeddings=64, rope_scaling=linear),
                           cfg(max_position_embeddings=128, rope_scaling=linear)) == []
    assert config_diff(cfg(pad_token_id=0), cfg(pad_token_id=5)) == ["pad_token_id: 0 -> 5"]


@pytest.mark.skipif(int(__import__("transformers").__version__.split(".")[0]) < 5,
                    reason="transformers 4.x holds the experts as stored")
def test_a_moe_folder_with_other_shapes_names_them(pg, tmp_path):
    """A Mixtral folder with 6 experts for a 4-expert model: the stored names convert, the shapes
    do not fit; the error named 12 parameters as missing and blamed the names."""
    folder = _save(build("mixtral", num_experts=6, num_local_experts=6), tmp_path / "six")
    with pytest.raises(ValueError, match=r"do not fit the model: 4 have other shapes \(model.layers.0.block_sparse_moe."
                                         r"gate.weight: folder \[6, 32\], model \[4, 32\]"):
        yashard.shard(meta_model("mixtral"), weights=folder)
