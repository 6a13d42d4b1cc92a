"""Loading without full copies: meta-device models initialised in place, HF folders read shard-wise.

* A model built on the meta device gets, through ``yashard.shard``, bitwise the weights (and
  buffers, and RNG state afterwards) of the same model built on the CPU with the same seed.
* ``weights=<HF folder>`` / ``yashard.from_pretrained`` read only each rank's rows and give the
  folder's weights exactly (sharded index or single file, bf16 or fp32 files).
* While the masters are filled, a rank's memory grows by its shards plus about one parameter, not
  by the full model.
"""

import os

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from harness import run_distributed
from loading_workers import folder_as_transformers_reads_it, loading_peak, shard_folder, shard_meta
from models import build, tiny_config

# transformers 4.x computes Falcon-H1's mamba.mup_vector in its model's constructor, which on the meta
# device leaves it unset with nothing to set it (yashard refuses, naming it: build such a model on the
# CPU); from 5 on the model's initialisation sets it
TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5
CASES = [("llama", {}), ("llama", {"tie_word_embeddings": True}), ("qwen2", {}),
         ("qwen3", {"tie_word_embeddings": True}), ("mistral", {})] + [("falcon_h1", {})] * TRANSFORMERS_5


def _cpu_reference(family, overrides, seed):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides))
    after = torch.rand(4)
    params = {k: v.detach() for k, v in model.named_parameters(remove_duplicate=False)}
    return params, after, dict(model.named_buffers())


@pytest.mark.parametrize("world", [1, 3])
def test_meta_init_is_bitwise_the_cpu_build(world):
    for family, overrides in CASES if world == 3 else CASES[:2]:
        results = run_distributed(shard_meta, world, family, overrides, 7)
        ref, ref_after, ref_buffers = _cpu_reference(family, overrides, 7)
        for r, res in enumerate(results):
            assert set(res["params"]) == set(ref), (family, sorted(set(res["params"]) ^ set(ref)))
            bad = [k for k in ref if not torch.equal(res["params"][k], ref[k])]
            assert not bad, (family, overrides, r, bad[:3])
            assert all(torch.equal(res["buffers"][k], v) for k, v in ref_buffers.items())
        # rank 0's RNG advanced exactly as building the model on the CPU advances it
        assert torch.equal(results[0]["after"], ref_after), family


def test_meta_init_gemma_style():
    """Gemma: tied embeddings and norms initialised by the model's own _init_weights."""
    from transformers import GemmaConfig

    cfg = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    torch.manual_seed(3)
    ref = AutoModelForCausalLM.from_config(GemmaConfig(**cfg))
    torch.manual_seed(3)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(GemmaConfig(**cfg))
    from yashard.init_replay import replay_initialisation

    names = {}
    for n, p in meta.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    got = {}
    replay_initialisation(meta, lambda m, v: got.update({n: v.clone() for n in names[id(m)]}))
    for n, p in ref.named_parameters(remove_duplicate=False):
        assert torch.equal(got[n], p.detach()), n


class _ZeroLinear(torch.nn.Linear):
    """A zero-initialised adapter (LoRA-B style): its own reset_parameters zeroes it."""

    def reset_parameters(self):
        torch.nn.init.zeros_(self.weight)


def test_meta_init_of_modules_added_after_from_config():
    """Modules added to (or put in place of one in) an HF model after from_config were constructed,
    on the CPU, after the whole model's initialisation, which never touched them: the replay draws
    them last, by their own reset_parameters, and every other parameter keeps its value (before,
    HF's _init_weights reinitialised the adapters in the middle of the draws: the zero adapter came
    out random and 31 of 40 parameters differed)."""
    from yashard.init_replay import added_modules, replay_initialisation

    def build(device):
        torch.manual_seed(5)
        with torch.device(device):
            m = AutoModelForCausalLM.from_config(tiny_config("llama"))
            m.model.layers[0].mlp.adapter = _ZeroLinear(32, 32, bias=False)
            m.model.layers[1].self_attn.o_proj = torch.nn.Linear(32, 32, bias=True)  # replaced
            m.model.layers[1].extra = torch.nn.Sequential(torch.nn.Linear(32, 8), torch.nn.Linear(8, 32))
        return m

    ref = build("cpu")
    ref_after = torch.rand(4)
    meta = build("meta")
    added = [(n, type(m), type(r)) for n, m, r in added_modules(meta)]
    assert added == [("model.layers.0.mlp.adapter", _ZeroLinear, type(None)),
                     ("model.layers.1.self_attn.o_proj", torch.nn.Linear, torch.nn.Linear),
                     ("model.layers.1.extra", torch.nn.Sequential, type(None))], added
    names = {}
    for n, p in meta.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    got = {}
    torch.manual_seed(5)
    replay_initialisation(meta, lambda m, v: got.update({n: v.clone() for n in names[id(m)]}))
    assert torch.equal(torch.rand(4), ref_after)  # the RNG advanced as the CPU build advanced it
    for n, p in ref.named_parameters(remove_duplicate=False):
        assert torch.equal(got[n], p.detach()), n
    assert not got["model.layers.0.mlp.adapter.weight"].any()
    assert added_modules(AutoModelForCausalLM.from_config(tiny_config("llama"))) == []


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    """An HF folder written by save_pretrained: sharded (index.json) fp32, and a single bf16 file."""
    root = tmp_path_factory.mktemp("hf")
    model = build("qwen2", seed=11, tie_word_embeddings=True)
    sharded = root / "sharded"
    model.save_pretrained(sharded, max_shard_size="20KB")
    single = root / "bf16"
    model.to(torch.bfloat16).save_pretrained(single)
    return model, str(sharded), str(single)


def test_folder_loading_reads_the_folders_weights(hf_folders):
    _, sharded, single = hf_folders
    assert os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(sharded) if f.endswith(".safetensors")]) > 3
    ref_model = AutoModelForCausalLM.from_pretrained(sharded)
    ref = {k: v.detach() for k, v in ref_model.named_parameters(remove_duplicate=False)}
    ids = torch.arange(12).reshape(2, 6) % 90
    with torch.no_grad():
        ref_logits = ref_model(input_ids=ids).logits
    for world, use_fp in ((2, False), (3, True)):
        for res in run_distributed(shard_folder, world, sharded, use_fp):
            assert all(torch.equal(res["params"][k], ref[k]) for k in ref)
            torch.testing.assert_close(res["logits"], ref_logits, rtol=1e-5, atol=1e-5)
    # bf16 files: the fp32 masters hold exactly the bf16 values
    res = run_distributed(shard_folder, 2, single, True)[0]
    assert all(torch.equal(res["params"][k], ref[k].bfloat16().float()) for k in ref)


@pytest.mark.skipif(not TRANSFORMERS_5, reason="transformers 4.x sets mup_vector in the constructor (see CASES)")
def test_a_folder_whose_buffers_the_model_initialises(tmp_path):
    """Falcon-H1 stores no mamba.mup_vector (a non-persistent buffer its model's initialisation sets in
    every layer): loading its folder computes it as transformers' from_pretrained does."""
    build("falcon_h1", seed=2).save_pretrained(tmp_path / "falcon")
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "falcon")
    ids = torch.arange(12).reshape(2, 6) % 90
    with torch.no_grad():
        ref_logits = ref(input_ids=ids).logits
    res = run_distributed(shard_folder, 2, str(tmp_path / "falcon"), True)[0]
    torch.testing.assert_close(res["logits"], ref_logits, rtol=1e-5, atol=1e-5)


def test_a_folder_is_read_as_transformers_reads_it(tmp_path):
    """A sharded save_pretrained followed by a single-file one into the same folder leaves the old
    index behind (transformers deletes the old shard files only when their names clash: here they are
    kept, as a copy of an older checkpoint would be): transformers loads model.safetensors, and so
    must yashard, not the index's older weights. generation_config.json (several EOS ids, sampling)
    is the model's, as from_pretrained gives it, and export_hf writes it back."""
    from transformers import GenerationConfig

    folder = tmp_path / "model"
    model = build("llama", seed=5)
    model.save_pretrained(folder, max_shard_size="20KB")
    old_files = {f: (folder / f).read_bytes() for f in os.listdir(folder) if f.startswith("model-")}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=[2, 7], do_sample=True,
                                               temperature=0.6, top_p=0.9)
    model.save_pretrained(folder)
    for f, data in old_files.items():  # (whether or not save_pretrained removed them: the worst case)
        (folder / f).write_bytes(data)
    assert (folder / "model.safetensors").exists() and (folder / "model.safetensors.index.json").exists()
    ref = AutoModelForCausalLM.from_pretrained(folder)
    new = {k: v.detach() for k, v in ref.named_parameters(remove_duplicate=False)}
    assert torch.equal(new["model.norm.weight"], model.model.norm.weight)  # transformers: the single file
    assert ref.generation_config.eos_token_id == [2, 7]
    out = tmp_path / "export"
    results = run_distributed(folder_as_transformers_reads_it, 2, str(folder), str(out))
    for r, res in enumerate(results):
        bad = [k for k in new if not torch.equal(res["params"][k], new[k])]
        assert not bad, (r, bad[:3])
        assert (res["eos"], res["do_sample"], res["temperature"]) == ([2, 7], True, 0.6)
    assert any("model.safetensors.index.json" in m and "reading model.safetensors" in m for m in results[0]["said"])
    exported = GenerationConfig.from_pretrained(out)
    assert (exported.eos_token_id, exported.do_sample, exported.top_p) == ([2, 7], True, 0.9)


@pytest.mark.skipif(not TRANSFORMERS_5, reason="transformers 4.x holds the experts as stored")
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "minimax_m2"])
def test_a_moe_folder_is_converted_as_transformers_converts_it(tmp_path, family):
    """transformers 5 holds a MoE layer's experts fused (experts.gate_up_proj, 3-D) and its
    checkpoints store one tensor per expert and projection: yashard reads such a folder as
    from_pretrained does (it was refused: names not in the folder), and export_hf writes the stored
    form back as save_pretrained does (it wrote the fused names, which other readers lack). MiniMax-M2's
    router bias, a persistent buffer, is stored renamed too (it came back zero)."""
    from safetensors import safe_open
    from transformers import CONFIG_MAPPING

    if family not in CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {family}")
    folder, out = tmp_path / "saved", tmp_path / "export"
    model = build(family, seed=4)
    with torch.no_grad():
        for i, (name, b) in enumerate(sorted(model.named_buffers())):
            if b.is_floating_point() and "rotary" not in name:
                b.copy_(torch.arange(b.numel(), dtype=b.dtype).view(b.shape) + 10 * i)
    model.save_pretrained(folder)
    ref = AutoModelForCausalLM.from_pretrained(folder)
    new = {k: v.detach() for k, v in ref.named_parameters(remove_duplicate=False)}
    assert any(v.dim() == 3 for v in new.values())  # fused in memory
    held = {k: b for k, b in ref.state_dict().items() if k not in new}  # its persistent buffers
    assert (family == "minimax_m2") == any(b.abs().sum() > 0 for b in held.values())
    results = run_distributed(folder_as_transformers_reads_it, 2, str(folder), str(out))
    for r, res in enumerate(results):
        bad = [k for k in new if not torch.equal(res["params"][k], new[k])]
        bad += [k for k in held if not torch.equal(res["buffers"][k], held[k])]
        assert not bad, (r, bad[:3])
        assert not any("have no place in the model" in m for m in res["said"]), res["said"]

    def stored(path):
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}

    saved, exported = stored(folder), stored(out)
    assert sorted(exported) == sorted(saved) and any(".experts.0." in k for k in saved)
    assert all(torch.equal(exported[k], saved[k]) for k in saved)


def test_loading_peak_memory_is_shards_plus_one_parameter(tmp_path):
    """Meta init and folder loading never hold the full model (~150 MB here) on a rank."""
    shape = dict(vocab_size=4096, hidden_size=768, intermediate_size=2048, num_hidden_layers=6,
                 num_attention_heads=12, num_key_value_heads=4)
    folder = tmp_path / "big"
    build("llama", seed=0, **shape).save_pretrained(folder)
    for source in (None, str(folder)):
        for res in run_distributed(loading_peak, 2, "llama", shape, source):
            allowed = res["masters"] + 2 * res["largest"] + 8 * 2**20  # measured: masters + ~1.5 largest
            assert res["peak"] <= allowed, (source, res)
            assert res["peak"] < 0.75 * res["full"], (source, res)
