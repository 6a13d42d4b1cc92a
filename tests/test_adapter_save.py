"""Adapter saves of PEFT models on yashard, as peft saves them: ``modules_to_save`` through
yashard.hf.Trainer (its checkpoints and ``save_model``; 2 ranks, tiny Mistral) reloads with
``PeftModel.from_pretrained`` to the trained logits; a second, inactive adapter under a bf16
``param_dtype`` saves its fp32 values; PEFT methods and calls yashard cannot shard are refused
before any compute, naming the fix."""

import pytest
import torch

pytest.importorskip("peft")

import yashard  # noqa: E402
from harness import run_distributed  # noqa: E402
from models import build  # noqa: E402
from peft_trial_workers import IDS, adapter_cases, peft_model  # noqa: E402


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = tmp_path_factory.mktemp("adapter_save")
    return out, run_distributed(adapter_cases, 2, str(out))


def test_modules_to_save_saves_as_peft_and_reloads_to_the_trained_logits(saved):
    from peft import PeftModel
    from safetensors.torch import load_file

    out, res = saved
    assert res[0]["checkpoints"] == ["checkpoint-1", "checkpoint-2"]  # (it crashed at the first one)
    for folder in (out / "adapter", out / "run" / "checkpoint-2"):
        loaded = PeftModel.from_pretrained(build("mistral", seed=0), folder)
        with torch.no_grad():
            torch.testing.assert_close(loaded(input_ids=IDS).logits, res[0]["mts"], rtol=0, atol=1e-5)
    # the keys peft itself writes for the same configuration
    reference = out / "peft_reference"
    peft_model("mistral", target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"]).save_pretrained(reference)
    assert set(load_file(out / "adapter" / "adapter_model.safetensors")) == \
        set(load_file(reference / "adapter_model.safetensors"))
    assert "base_model.model.lm_head.weight" in load_file(out / "adapter" / "adapter_model.safetensors")


def test_an_inactive_adapter_saves_its_fp32_values_under_bf16_compute(saved):
    from safetensors.torch import load_file

    out, res = saved
    peft_saved = load_file(out / "peft_bf16" / "second" / "adapter_model.safetensors")
    ours = load_file(out / "bf16" / "second" / "adapter_model.safetensors")
    assert ours.keys() == peft_saved.keys()
    for k, v in peft_saved.items():  # never trained: bitwise what peft saved before shard()
        assert ours[k].dtype == torch.float32 and torch.equal(ours[k], v), k
    trained = load_file(out / "bf16" / "adapter_model.safetensors")
    full = res[0]["bf16 full"]
    for k, v in trained.items():  # the trained adapter: its fp32 masters, bitwise
        name = k.removeprefix("base_model.model.").replace(".weight", ".default.weight")
        assert torch.equal(v, full[name]), k


def test_vera_and_adalora_are_refused_at_shard(pg):
    from peft import AdaLoraConfig, VeraConfig, get_peft_model

    vera = get_peft_model(build("qwen3"), VeraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with pytest.raises(NotImplementedError, match=r"yashard\.shard does not support the PEFT method VERA \(adapter "
                       r"'default'\): VeRA's shared random projections .* Fix: train with LoraConfig"):
        yashard.shard(vera)
    ada = get_peft_model(build("qwen3"), AdaLoraConfig(r=4, target_modules=["q_proj", "v_proj"], total_step=10))
    with pytest.raises(NotImplementedError, match=r"does not support the PEFT method ADALORA .*AdaLoraModel\.forward "
                       r"calls the HF model's forward itself.* Fix: train with LoraConfig"):
        yashard.shard(ada)


def test_set_adapter_after_shard_is_refused_at_a_forward_with_gradients(pg):
    from peft import LoraConfig

    pm = peft_model("qwen3")
    pm.add_adapter("other", LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    sm = yashard.shard(pm)
    ids = IDS[:, :6]
    sm.module.set_adapter("other")
    with torch.no_grad():  # a reference forward of another adapter runs (TRL's use_adapter)
        other = sm(input_ids=ids).logits
    with pytest.raises(RuntimeError, match=r"a forward of adapter 'other' with gradients on, after "
                       r"set_adapter\('other'\) following yashard\.shard: the adapter that trains is 'default', .* "
                       r"call set_adapter\('other'\) on the PeftModel before yashard\.shard; to run it without "
                       r"training \(a reference forward\), run it under torch\.no_grad\(\)"):
        sm(input_ids=ids, labels=ids)
    sm.module.set_adapter("default")
    out = sm(input_ids=ids, labels=ids)
    out.loss.backward()  # the trained adapter still trains
    with torch.no_grad():  # (a call with labels returns no logits under the fused loss: read them without)
        mine = sm(input_ids=ids).logits
    assert not torch.equal(mine, other)
