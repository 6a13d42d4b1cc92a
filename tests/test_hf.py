"""yashard.hf: HF Trainer, Accelerate and TRL's SFTTrainer on yashard match their DDP runs.

Two gloo ranks on CPU, a tiny Llama, in-memory data; workers in tests/hf_workers.py."""

from __future__ import annotations

import math
import os

import pytest
import torch

import hf_workers
from harness import run_distributed

pytestmark = pytest.mark.slow


def close(a: float, b: float, tol: float = 1e-5) -> bool:
    return math.isclose(a, b, rel_tol=tol, abs_tol=tol)


def assert_same_steps(got: list[dict], want: list[dict], keys=("loss", "grad_norm", "learning_rate"), tol=1e-5):
    assert len(got) == len(want) and got, (got, want)
    for g, w in zip(got, want):
        assert g["step"] == w["step"]
        for k in keys:
            assert close(g[k], w[k], tol), (k, g, w)


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    """The reference: transformers.Trainer on DDP, gradient accumulation 2, eval every 2 steps."""
    out = str(tmp_path_factory.mktemp("ddp"))
    return run_distributed(hf_workers.trainer_run, 2, "ddp", out,
                           dict(gradient_accumulation_steps=2, eval_strategy="steps", eval_steps=2,
                                label_smoothing_factor=0.1))[0]


@pytest.fixture(scope="module")
def yashard_run(tmp_path_factory):
    """yashard.hf.Trainer with the same arguments, saving every 2 steps (2 kept), then save_model."""
    out = tmp_path_factory.mktemp("yashard")
    result = run_distributed(hf_workers.trainer_run, 2, "yashard", str(out),
                             dict(gradient_accumulation_steps=2, eval_strategy="steps", eval_steps=2,
                                  label_smoothing_factor=0.1, save_strategy="steps", save_steps=1,
                                  save_total_limit=2),
                             None, str(out / "final"))[0]
    return out, result


def test_trainer_matches_ddp_step_for_step_with_accumulation(ddp_run, yashard_run):
    """Label smoothing included: Trainer shifts the labels for it only for a model it knows as a causal LM."""
    _, got = yashard_run
    assert_same_steps(got["steps"], ddp_run["steps"])
    assert got["n_trainable"] == ddp_run["n_trainable"]  # (the model's count, not one rank's shards)
    assert [e["step"] for e in got["evals"]] == [2, 4], (got["evals"], ddp_run["evals"])
    for g, w in zip(got["evals"], ddp_run["evals"]):
        assert close(g["eval_loss"], w["eval_loss"])
    for name, w in ddp_run["full"].items():
        torch.testing.assert_close(got["full"][name], w, rtol=1e-5, atol=1e-6)


def test_trainer_checkpoints_are_sharded_checkpoints_beside_trainers_files(yashard_run):
    out, _ = yashard_run
    kept = sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-"))
    assert kept == ["checkpoint-3", "checkpoint-4"]  # save_total_limit=2
    files = set(os.listdir(out / "checkpoint-4"))
    assert {"yashard", "scheduler.pt", "trainer_state.json", "training_args.bin", "rng_state_0.pth",
            "rng_state_1.pth", "tokenizer.json"} <= files, files
    assert "optimizer.pt" not in files and "model.safetensors" not in files


def test_save_model_writes_an_hf_folder_that_from_pretrained_loads(yashard_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, got = yashard_run
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    state = model.state_dict()
    for name, w in got["full"].items():
        assert torch.equal(state[name], w), name
    tok = AutoTokenizer.from_pretrained(out / "final")
    assert tok("w5 w6")["input_ids"] == [5, 6]


@pytest.mark.parametrize("world", [2, 1])
def test_resume_continues_as_the_uninterrupted_run(yashard_run, tmp_path, world):
    """Resume from checkpoint-3 (written at 2 ranks) on 2 ranks, and on 1 rank with twice the
    per-device batch (the same global batch): step 4 is the uninterrupted run's step 4."""
    out, full = yashard_run
    overrides = dict(gradient_accumulation_steps=2, output_dir=str(out), label_smoothing_factor=0.1,
                     per_device_train_batch_size=2 * 2 // world)
    got = run_distributed(hf_workers.trainer_run, world, "yashard", str(out), overrides,
                          str(out / "checkpoint-3"))[0]
    # (steps 1-3 come from the checkpoint's trainer_state.json; step 4 is trained after the resume)
    assert [s["step"] for s in got["steps"]] == [1, 2, 3, 4]
    assert_same_steps(got["steps"][3:], full["steps"][3:], tol=1e-5 if world == 2 else 1e-4)


def test_bf16_and_gradient_checkpointing_come_from_the_arguments(tmp_path):
    got = run_distributed(hf_workers.trainer_run, 2, "yashard", str(tmp_path),
                          dict(bf16=True, gradient_checkpointing=True, max_steps=2), None, None, True)[0]
    assert got["dtype"] == "torch.bfloat16"
    assert got["checkpoint_layers"] == 4
    assert got["user_args_checkpointing"] is True  # (the caller's TrainingArguments are left as they were)
    assert all(math.isfinite(s["loss"]) for s in got["steps"])


def test_accelerate_loop_matches_ddp_and_save_state_round_trips(tmp_path):
    want = run_distributed(hf_workers.accelerate_run, 2, "ddp", str(tmp_path / "ddp"))[0]
    got = run_distributed(hf_workers.accelerate_run, 2, "yashard", str(tmp_path / "y"), 4, 2, 2)[0]
    assert len(got["norms"]) == 4
    for g, w in zip(got["losses"] + got["norms"], want["losses"] + want["norms"]):
        assert close(g, w), (got, want)
    # what save_state wrote at 2 ranks loads at 1: the same weights, schedule and optimizer state
    loaded = run_distributed(hf_workers.accelerate_load, 1, str(tmp_path / "y" / "state"))[0]
    assert loaded["full"].keys() == got["at_save"].keys()
    for name, w in got["at_save"].items():
        assert torch.equal(loaded["full"][name], w), name
    assert loaded["lr"] == got["lr_at_save"] and loaded["lr"][0] < 1e-3 and loaded["moments"] > 0


def test_sft_trainer_matches_ddp_with_its_metrics(tmp_path):
    overrides = dict(bf16=False)  # (fp32 for a tight comparison; TRL's default bf16 is the next test)
    want = run_distributed(hf_workers.sft_run, 2, "ddp", str(tmp_path / "ddp"), overrides)[0]
    got = run_distributed(hf_workers.sft_run, 2, "yashard", str(tmp_path / "y"), overrides)[0]
    assert got["checkpoint_layers"] == 4  # TRL's default gradient_checkpointing=True
    assert_same_steps(got["steps"], want["steps"], keys=("loss", "grad_norm", "mean_token_accuracy", "entropy"))


def test_sft_trainer_defaults_compute_in_bf16(tmp_path):
    got = run_distributed(hf_workers.sft_run, 2, "yashard", str(tmp_path), {})[0]
    assert got["dtype"] == "torch.bfloat16"
    assert all(math.isfinite(s["loss"]) and 0 <= s["mean_token_accuracy"] <= 1 for s in got["steps"])


def adapters(folder) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(folder, "adapter_model.safetensors"))


def test_trainer_trains_a_lora_model_as_ddp_and_saves_its_adapter(tmp_path):
    """A PEFT LoRA model through yashard.hf.Trainer: the DDP run's losses and grad norms, AdamW's
    state on the adapters only, and save_model writes the adapter PeftModel.from_pretrained loads."""
    overrides = dict(gradient_accumulation_steps=2, save_strategy="steps", save_steps=4)
    want = run_distributed(hf_workers.trainer_run, 2, "ddp", str(tmp_path / "ddp"), overrides, None,
                           str(tmp_path / "ddp" / "final"), False, True)[0]
    got = run_distributed(hf_workers.trainer_run, 2, "yashard", str(tmp_path / "y"), overrides, None,
                          str(tmp_path / "y" / "final"), False, True)[0]
    assert_same_steps(got["steps"], want["steps"])
    a, b = adapters(tmp_path / "y" / "final"), adapters(tmp_path / "ddp" / "final")
    assert a.keys() == b.keys() and a
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
    assert (tmp_path / "y" / "final" / "adapter_config.json").is_file()
    # (a checkpoint holds the adapter too, as a DDP checkpoint of a PEFT model does)
    assert (tmp_path / "y" / "checkpoint-4" / "adapter_model.safetensors").is_file()


def test_sft_trainer_with_peft_config_matches_ddp(tmp_path):
    overrides = dict(bf16=False)
    want = run_distributed(hf_workers.sft_run, 2, "ddp", str(tmp_path / "ddp"), overrides, True)[0]
    got = run_distributed(hf_workers.sft_run, 2, "yashard", str(tmp_path / "y"), overrides, True,
                          str(tmp_path / "y" / "final"))[0]
    assert_same_steps(got["steps"], want["steps"], keys=("loss", "grad_norm", "mean_token_accuracy"))
    assert (tmp_path / "y" / "final" / "adapter_model.safetensors").is_file()


def test_misuse_is_refused_naming_the_fix(tmp_path):
    got = run_distributed(hf_workers.refusals, 2, str(tmp_path))[0]
    assert "set bf16=True instead" in got["fp16"]
    assert "param_dtype=torch.bfloat16" in got["bf16_on_fp32"]
    assert "checkpoint_layers" in got["checkpointing"]
    assert "needs args" in got["no_args"]
    assert "Prepare the model first" in got["optimizer_first"]
    assert "optimizer_cls_and_kwargs" in got["optimizers"]
    assert "leave fsdp and fsdp_config out" in got["fsdp"]
    assert "model_init with yashard.hf: pass the model itself" in got["model_init"]
    assert "every_n_layers or offload" in got["every_n_layers"]
    assert "apply get_peft_model before yashard.shard" in got["peft_config_sharded"]
    assert "is not a checkpoint of a yashard trainer" in got["resume_other"]
    assert "was not written by yashard.hf.Accelerator.save_state" in got["load_state_other"]
    assert "saves one trained model per Accelerator" in got["two_models"]


def test_sharded_trainer_binds_arguments_by_name(tmp_path):
    got = run_distributed(hf_workers.ref_trainer_run, 2, str(tmp_path))[0]
    assert got["ref_model"] == "a reference" and len(got["steps"]) == 2


def test_accelerate_automatic_checkpoint_naming_beside_a_frozen_teacher(tmp_path):
    got = run_distributed(hf_workers.accelerate_auto, 2, str(tmp_path))[0]
    assert got["folders"] == ["checkpoint_1", "checkpoint_2"] and got["same"]


def test_recipe_trains_the_embedded_default_through_trainer_and_resumes(tmp_path):
    from transformers import AutoModelForCausalLM

    from test_recipes import run_recipe

    args = ["--seq-len", "32", "--max-bytes", "100000", "--micro-batch", "2", "--save-steps", "2",
            "--out-dir", str(tmp_path)]
    out = run_recipe("hf_trainer.py", "--steps", "2", *args)
    assert "yashard memory plan" in out and "held-out loss" in out
    assert (tmp_path / "checkpoint-2" / "yashard").is_dir()
    out = run_recipe("hf_trainer.py", "--steps", "3", "--resume", *args)
    assert "held-out loss" in out
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "final").config.vocab_size == 259
