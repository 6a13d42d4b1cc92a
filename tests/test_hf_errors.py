"""yashard.hf's refusals, matched by message: without Accelerate (or TRL), a TRL fused LM head of a
version it does not know, FSDP / DeepSpeed / Megatron-LM asked of Accelerate, and TRL's reference-model
options it cannot honour.

Fast: subprocesses for the missing packages, this process (a one-rank group) for the fused head and
Accelerator's arguments, one rank started by the harness for what builds TrainingArguments (they set
up Accelerate's process-wide state)."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
import torch

import hf_workers
import models
from harness import run_distributed

pytest.importorskip("accelerate")
trl_utils = pytest.importorskip("trl.trainer.utils")

import yashard  # noqa: E402
from yashard.hf.trainer import FUSED_TRL_VERSION, _logits_fused_forward, replace_fused_lm_head  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


# ---------------------------------------------------------------------------------------------
# Missing packages (a fresh interpreter in which the package cannot be imported).


def test_yashard_hf_without_accelerate_names_the_extra():
    proc = _python("import sys\nsys.modules['accelerate'] = None  # (not installed)\n"
                   "import yashard\nprint('yashard imports')\nimport yashard.hf\n")
    assert proc.returncode != 0
    assert "yashard imports" in proc.stdout  # (import yashard does not need it)
    message = "ImportError: yashard.hf needs Hugging Face Accelerate: pip install 'yashard[hf]'"
    assert message in proc.stderr, proc.stderr


def test_sft_trainer_without_trl_names_the_extra():
    proc = _python("import sys\nsys.modules['trl'] = None  # (not installed)\n"
                   "import yashard.hf\nprint('yashard.hf imports')\nyashard.hf.SFTTrainer\n")
    assert proc.returncode != 0
    assert "yashard.hf imports" in proc.stdout
    assert "ImportError: yashard.hf.SFTTrainer needs TRL: pip install 'yashard[hf]'" in proc.stderr, proc.stderr


# ---------------------------------------------------------------------------------------------
# TRL's fused LM head (add_fused_lm_head) on a sharded model: replaced when it is TRL's own,
# refused when it takes, reads or computes what yashard's answer would ignore.


@pytest.fixture()
def sharded(pg):
    return yashard.shard(models.build("llama"))


def _fused_forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None,
                   **kwargs):
    """A fused forward that closes over nothing: its temperature is not where TRL's is."""
    raise AssertionError("never called")


def _later_trl_head(model, temperature=1.0, outputs=("log_probs",)):
    """add_fused_lm_head as a later TRL might write it: TRL 1.16's variables and one more (z_loss)."""
    original_forward, text_config = model.forward, model.config.get_text_config()
    backbone_attr, cast_lm_head_to_fp32, final_logit_softcapping, logit_scale = "base_model", False, None, 1.0
    z_loss = 1e-4

    def _fused_forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None,
                       **kwargs):
        raise AssertionError("never called", backbone_attr, cast_lm_head_to_fp32, final_logit_softcapping,
                             logit_scale, original_forward, outputs, temperature, text_config, z_loss)

    model.forward = types.MethodType(_fused_forward, model)


def test_trls_fused_head_is_answered_from_the_logits(sharded):
    trl_utils.add_fused_lm_head(sharded, temperature=0.7, outputs=("log_probs", "entropy"))
    replace_fused_lm_head(sharded)
    forward = sharded.__dict__["forward"]
    assert forward.__func__.func is _logits_fused_forward and forward.__func__.keywords == {"temperature": 0.7}
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(0))
    out = sharded(input_ids=ids, labels=ids, fused_lm_head=True)
    assert out.log_probs.shape == (2, 7) and torch.isfinite(out.loss)


@pytest.mark.parametrize("install, problem", [
    (lambda m: setattr(m, "forward", types.MethodType(_fused_forward, m)),
     "it reads no temperature; it reads no outputs tuple"),
    (lambda m: hf_workers._fused_head_with_chunk_size(trl_utils.add_fused_lm_head)(m), "it takes chunk_size="),
    (_later_trl_head, "it reads z_loss"),
    (lambda m: trl_utils.add_fused_lm_head(m, outputs=("log_probs", "top_k_log_probs")),
     "it computes 'top_k_log_probs'"),
    (lambda m: trl_utils.add_fused_lm_head(m, temperature=None), "its temperature is None, not a number"),
], ids=["no-closure", "extra-keyword", "extra-variable", "extra-output", "temperature-not-a-number"])
def test_an_unknown_fused_head_is_refused_naming_what_and_the_version(sharded, install, problem):
    install(sharded)
    with pytest.raises(NotImplementedError) as e:
        replace_fused_lm_head(sharded)
    message = str(e.value)
    assert "fused LM head (add_fused_lm_head) is of a version yashard.hf does not know: " in message
    assert problem in message, message
    assert f"Install trl=={FUSED_TRL_VERSION}.*" in message


def test_cast_lm_head_to_fp32_is_refused_on_a_bf16_model(pg):
    sharded = yashard.shard(models.build("llama"), config=yashard.ShardConfig(param_dtype=torch.bfloat16))
    trl_utils.add_fused_lm_head(sharded, cast_lm_head_to_fp32=True)
    with pytest.raises(NotImplementedError, match=r"cast_lm_head_to_fp32=True with yashard\.hf: a sharded lm_head "
                                                  r"computes in ShardConfig\.param_dtype \(torch\.bfloat16\)"):
        replace_fused_lm_head(sharded)


# ---------------------------------------------------------------------------------------------
# FSDP, DeepSpeed and Megatron-LM asked of yashard.hf.Accelerator: refused before Accelerate reads
# them (it would set its variable in the environment, and on a CPU it drops the plugin silently).


def _plugin(name):
    import accelerate
    from accelerate.utils import MegatronLMPlugin

    return {"fsdp_plugin": lambda: accelerate.FullyShardedDataParallelPlugin(),
            "fsdp2": lambda: accelerate.FullyShardedDataParallelPlugin(fsdp_version=2),
            "deepspeed_plugin": lambda: accelerate.DeepSpeedPlugin(zero_stage=3),
            "megatron_lm_plugin": lambda: MegatronLMPlugin()}[name]()


@pytest.mark.parametrize("name", ["fsdp_plugin", "fsdp2", "deepspeed_plugin", "megatron_lm_plugin"])
def test_accelerator_refuses_another_sharding_plugin(name, monkeypatch):
    import yashard.hf

    arg = "fsdp_plugin" if name == "fsdp2" else name
    for var in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_MEGATRON_LM"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match=rf"yashard\.hf\.Accelerator\({arg}=\.\.\.\): .* would wrap the model that "
                                         r"yashard shards; leave the plugin out"):
        yashard.hf.Accelerator(cpu=True, **{arg: _plugin(name)})
    assert not any(os.environ.get(v) for v in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED",
                                               "ACCELERATE_USE_MEGATRON_LM"))  # (refused before Accelerate sets it)


@pytest.mark.parametrize("var, name", [("ACCELERATE_USE_FSDP", "FSDP"), ("ACCELERATE_USE_DEEPSPEED", "DeepSpeed"),
                                       ("ACCELERATE_USE_MEGATRON_LM", "Megatron-LM")])
def test_accelerator_refuses_what_accelerate_launch_sets(var, name, monkeypatch):
    import yashard.hf

    monkeypatch.setenv(var, "true")
    with pytest.raises(ValueError, match=rf"yashard\.hf with {var}=true in the environment, which `accelerate launch` "
                                         rf"sets for {name} .*yashard shards the model in {name}'s place\. Launch with "
                                         r"torchrun, or with an accelerate config whose distributed_type is MULTI_GPU"):
        yashard.hf.Accelerator(cpu=True)


# ---------------------------------------------------------------------------------------------
# The trainers (one rank of its own: TrainingArguments set up Accelerate's process-wide state).


@pytest.fixture(scope="module")
def trainer_messages(tmp_path_factory):
    return run_distributed(hf_workers.trainer_refusals, 1, str(tmp_path_factory.mktemp("refusals")))[0]


def test_trainer_refuses_accelerate_launchs_fsdp(trainer_messages):
    assert "yashard.hf with ACCELERATE_USE_FSDP=true in the environment" in trainer_messages["fsdp_env"]


def test_sft_trainer_refuses_a_fused_head_of_another_trl_version(trainer_messages):
    message = trainer_messages["fused_head"]
    assert "is of a version yashard.hf does not know: it takes chunk_size=" in message
    assert f"Install trl=={FUSED_TRL_VERSION}.*" in message


def test_dpo_refuses_a_peft_model_without_ref_model(trainer_messages):
    message = trainer_messages["dpo_peft_model"]
    assert ("DPOTrainer with a PEFT model and no ref_model: TRL's reference would be a copy of the model's "
            "adapter") in message
    assert "Pass the base model with peft_config=" in message and "or pass ref_model=" in message


@pytest.mark.parametrize("name, why", [
    ("sync_ref_model", "a sharded policy's parameters are flat shards; leave it off"),
    ("precompute_ref_log_probs", "a hash of the model's state_dict, which a sharded model does not have; leave it off"),
])
def test_dpo_refuses_reference_options_it_cannot_honour(trainer_messages, name, why):
    message = trainer_messages[name]
    assert message.startswith(f"TrainingArguments({name}=...) with yashard.hf: ") and why in message, message
