"""yashard.hf's answer to TRL's fused LM head (``model(..., fused_lm_head=True)``) equals TRL's own
kernel, field for field, at temperature 1 and below; one process, no sharding."""

from __future__ import annotations

import copy
import types

import pytest
import torch

import models

trl_utils = pytest.importorskip("trl.trainer.utils")

from yashard.hf.trainer import _logits_fused_forward, fused_lm_head_settings  # noqa: E402

FIELDS = ("loss", "log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logits_answer_equals_trls_fused_head(temperature):
    model = models.build("llama", seed=0)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[0, :5] = -100  # (a prompt: no loss there)
    trl_model = copy.deepcopy(model)
    outputs = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
    trl_utils.add_fused_lm_head(trl_model, temperature=temperature, outputs=outputs)
    settings = fused_lm_head_settings(trl_model.forward)
    assert settings["temperature"] == temperature and settings["outputs"] == outputs
    assert fused_lm_head_settings(model.forward) is None  # (a model's own forward)
    want = trl_model(input_ids=ids, labels=labels, fused_lm_head=True)
    got = types.MethodType(_logits_fused_forward, model)(input_ids=ids, labels=labels, fused_lm_head=True,
                                                          temperature=temperature)
    for field in FIELDS:
        a, b = getattr(got, field), getattr(want, field)
        if a.dtype == torch.bool:
            assert torch.equal(a, b), field
        else:
            torch.testing.assert_close(a.float(), b.float(), rtol=1e-5, atol=1e-5, msg=field)
    got.loss.backward()
    want.loss.backward()
    for (name, p), q in zip(model.named_parameters(), trl_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
