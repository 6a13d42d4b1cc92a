"""PEFT LoRA on yashard: ``yashard.shard(peft_model)`` trains only the adapters, step for step as the
same LoRA training on one process; the optimizer state is the adapter group's alone; the saved
adapter loads bitwise through ``PeftModel.from_pretrained``; ``export_hf`` merges; and what would be
silently wrong is refused, naming the fix."""

import pytest
import torch

pytest.importorskip("peft")

import yashard  # noqa: E402
from harness import run_distributed  # noqa: E402
from models import build  # noqa: E402
from peft_workers import LORA, adapter_shard, lora_model, run_lora, run_lora_configs, run_reference  # noqa: E402
from workers import loss_rel_err, max_rel_err  # noqa: E402


@pytest.fixture(scope="module")
def reference():
    return run_reference()


def _adapters(params: dict) -> dict:
    return {k: v for k, v in params.items() if ".lora_" in k}


def check_against_reference(res: dict, ref: dict, world: int) -> None:
    assert loss_rel_err(res["losses"], ref["losses"]) < 1e-5, (res["losses"], ref["losses"])
    assert loss_rel_err(res["norms"], ref["norms"]) < 1e-5, (res["norms"], ref["norms"])
    err, name = max_rel_err(_adapters(res["params"]), _adapters(ref["params"]))
    assert err < 1e-5, (name, err)
    for k, v in ref["params"].items():  # the base weights never move
        if ".lora_" not in k:
            assert torch.equal(res["params"][k], v), k
    # only the adapter group trains: one master with a gradient, in the decay group, and AdamW's
    # state is 8 * T/W bytes with T/W the adapter group's shard (not whole layers' shards)
    shard = adapter_shard(ref["model"], world)
    assert res["trained_units"] == ["adapters"]
    assert res["adapter_shard"] == shard
    assert res["opt_params"] == [(0.1, [shard])]
    assert res["opt_bytes"] == res["adamw_bytes"] == 8 * shard
    assert res["adamw_formula"].startswith(f"8 * T/W = 8 * {shard}")
    assert res["plan"] == res["allocated"] == res["planned"]


def test_lora_on_two_ranks_matches_one_process_and_the_adapter_round_trips(reference, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    adapter, export = str(tmp_path / "adapter"), str(tmp_path / "export")
    res = run_distributed(run_lora, 2, adapter, export)[0]
    check_against_reference(res, reference, world=2)
    assert reference["trainable"] == 1792 and res["opt_bytes"] == 2 * 896 * 4

    # the adapter folder: peft loads it, bitwise the trained adapters
    loaded = PeftModel.from_pretrained(build("llama", seed=0), adapter)
    got = {k: p.detach() for k, p in loaded.get_base_model().named_parameters() if ".lora_" in k}
    trained = _adapters(res["params"])
    assert set(got) == set(trained)
    for k, v in trained.items():
        assert torch.equal(got[k], v), k
    stored = load_file(f"{adapter}/adapter_model.safetensors")
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in stored and len(stored) == len(trained)

    # export_hf merges the adapters: the plain model's folder, bitwise peft's merge_and_unload
    merged = loaded.merge_and_unload().state_dict()
    exported, info = AutoModelForCausalLM.from_pretrained(export, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched key
    for k, v in exported.state_dict().items():
        assert torch.equal(v, merged[k]), k
    torch.testing.assert_close(exported(input_ids=torch.zeros(1, 1, dtype=torch.long) + 5).logits,
                               loaded(input_ids=torch.zeros(1, 1, dtype=torch.long) + 5).logits, rtol=1e-5, atol=1e-5)


def test_lora_with_checkpointed_layers_and_own_slots(reference):
    configs = [dict(checkpoint_layers=2), dict(reshard_after_forward=False)]
    for res in run_distributed(run_lora_configs, 2, configs)[0]:
        check_against_reference(res, reference, world=2)


def test_lora_on_one_rank(pg, reference):
    check_against_reference(run_lora(0, 1), reference, world=1)


def test_get_peft_model_after_shard_is_refused_at_the_next_forward(pg):
    from peft import LoraConfig, get_peft_model

    sm = yashard.shard(build("llama", seed=0))
    get_peft_model(sm.module, LoraConfig(**LORA))
    ids = torch.randint(0, 96, (2, 8))
    with pytest.raises(RuntimeError, match=r"lora_A\.default\.weight \(shape \(4, 32\)\) is a parameter of the sharded "
                                           r"model that yashard\.shard did not shard.*get_peft_model.*Apply it before "
                                           r"sharding: yashard\.shard\(get_peft_model\(model, lora_config\)\)"):
        sm(input_ids=ids, labels=ids)


def test_what_export_hf_cannot_merge_is_refused(pg, tmp_path):
    sm = yashard.shard(lora_model(use_dora=True))
    with pytest.raises(NotImplementedError, match=r"q_proj has a DoRA or bias adapter \('default'\)\. Save the adapter "
                                                  r"with yashard\.save_adapter\(model, path\)"):
        yashard.export_hf(sm, tmp_path / "export")
    assert not (tmp_path / "export").exists()


def test_the_hf_model_inside_a_peft_model_exports_merged_and_saves_no_adapter(pg, tmp_path):
    """Sharding the PeftModel's base model (``peft_model.base_model.model``) also puts the adapters in
    a unit of their own; export_hf merges them (it used to write base_layer/lora_A names, which
    from_pretrained silently re-initialised); save_adapter needs the PeftModel, and says so."""
    from transformers import AutoModelForCausalLM

    pm = lora_model()
    inner = pm.get_base_model()
    sm = yashard.shard(inner)
    assert [u.name for u in sm.runtime.units if u.master.requires_grad] == ["adapters"]
    yashard.export_hf(sm, tmp_path / "export")
    _, info = AutoModelForCausalLM.from_pretrained(tmp_path / "export", output_loading_info=True)
    assert not any(info.values()), info
    with pytest.raises(TypeError, match=r"yashard\.save_adapter needs a sharded peft\.PeftModel, and this model is a "
                                        r"plain LlamaForCausalLM: apply get_peft_model before sharding and shard the "
                                        r"PeftModel itself"):
        yashard.save_adapter(sm, tmp_path / "adapter")


def test_the_adapter_group_decays_and_peft_save_pretrained_names_save_adapter(pg, tmp_path):
    """The adapters are matrices: param_groups and HF Trainer's name-based rule put the adapter group
    in the decay group (the norm group is the no-decay one). peft counts the unsharded parameters.
    PeftModel.save_pretrained would read state_dict(): refused, naming save_adapter."""
    from transformers import Trainer

    sm = yashard.shard(lora_model())
    assert sm.param_groups(0.1) == [{"params": [sm.runtime.adapters.master], "weight_decay": 0.1}]
    assert [p for p in sm.parameters() if p.requires_grad] == [sm.runtime.adapters.master]
    assert sorted(n for n, _ in sm.named_parameters()) == sorted(
        f"shards.{u}" for u in ("embed", "layer_0", "layer_1", "layer_2", "layer_3", "lm_head", "adapters",
                                "norms_and_biases"))
    # peft's counts (print_trainable_parameters) are the unsharded model's
    assert sm.module.get_nb_trainable_parameters() == lora_model().get_nb_trainable_parameters() == (1792, 45088)
    names = Trainer.get_decay_parameter_names(None, sm)
    assert "shards.adapters" in names and "shards.norms_and_biases" not in names
    with pytest.raises(RuntimeError, match=r"a PEFT adapter: yashard\.save_adapter\(model, path\)"):
        sm.save_pretrained(tmp_path / "adapter")


def test_peft_parameters_outside_the_hf_model_are_refused(pg):
    """Prompt tuning keeps its trainable prompt encoder in the PeftModel, outside the HF model that
    yashard shards: it would train unreduced on every rank. Refused at shard()."""
    from peft import PromptTuningConfig, get_peft_model

    pm = get_peft_model(build("llama", seed=0), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    with pytest.raises(ValueError, match=r"prompt_encoder\.default\.embedding\.weight is a parameter of the "
                                         r"PeftModelForCausalLM outside its HF model \(LlamaForCausalLM\).*prompt "
                                         r"learning methods \(prompt tuning, prefix tuning, p-tuning\) are not supported"):
        yashard.shard(pm)
