"""Exports of PEFT models trained through yashard.hf.Trainer (2 ranks, tiny Qwen3 with tied
embeddings): the folder reloads with AutoModelForCausalLM.from_pretrained to the trained model's
logits, or the export is refused naming the cause and the fix. Nothing is written silently wrong."""

import json

import pytest
import torch

pytest.importorskip("peft")

from harness import run_distributed  # noqa: E402
from peft_trial_workers import IDS, export_cases  # noqa: E402


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("peft_export")
    res = run_distributed(export_cases, 2, str(out))
    return out, res


def _reload(folder):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched key: nothing re-initialised
    with torch.no_grad():
        return model, model(input_ids=IDS).logits


def test_lora_on_a_tied_lm_head_exports_merged_and_untied(exported):
    out, res = exported
    model, logits = _reload(out / "tied")
    torch.testing.assert_close(logits, res[0]["tied"], rtol=0, atol=1e-5)
    # the merge changes the output embedding only: the folder is untied, the input embedding as trained
    assert json.loads((out / "tied" / "config.json").read_text())["tie_word_embeddings"] is False
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_disabled_adapters_export_the_base_model(exported):
    out, res = exported
    _, logits = _reload(out / "disabled")
    torch.testing.assert_close(logits, res[0]["disabled"], rtol=0, atol=1e-5)
    torch.testing.assert_close(logits, res[0]["base"], rtol=0, atol=1e-5)
    assert json.loads((out / "disabled" / "config.json").read_text())["tie_word_embeddings"] is True


def test_modules_to_save_on_a_tied_lm_head_exports_the_trained_copy(exported):
    out, res = exported
    _, logits = _reload(out / "mts")
    torch.testing.assert_close(logits, res[0]["mts"], rtol=0, atol=1e-5)
    assert json.loads((out / "mts" / "config.json").read_text())["tie_word_embeddings"] is False


def test_unload_after_shard_is_refused_by_export_hf(exported):
    out, res = exported
    for r in res:  # every rank, and nothing written
        assert r["unload export"].startswith("CheckpointError: export_hf: the sharded weights hold the PEFT name "), r
        assert "unload() or merge_and_unload() was called after yashard.shard" in r["unload export"]
        assert "with model.module.disable_adapter():" in r["unload export"]
    assert not (out / "unload").exists()


def test_merge_and_unload_after_shard_stops_before_changing_anything(exported):
    out, res = exported
    for r in res:  # peft's merge reads the adapters' values: refused at its first matmul, naming them
        assert r["merge_and_unload"].startswith("RuntimeError: "), r
        assert "is sharded by yashard" in r["merge_and_unload"] and "yashard.export_hf" in r["merge_and_unload"]
        assert r["merge_and_unload export"] == "no error"
    # the modules kept their LoRA layers: export_hf then merges, as it does for a PEFT model
    _, logits = _reload(out / "merge_and_unload")
    torch.testing.assert_close(logits, res[0]["merge_and_unload logits"], rtol=0, atol=1e-5)
