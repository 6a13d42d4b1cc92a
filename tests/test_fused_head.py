"""The fused chunked loss (ShardConfig(loss="chunked"), yashard/fused_head.py) on W gloo ranks, against
the unsharded HF model: losses and gradients with accumulation, tied embeddings, soft-capping,
num_items_in_batch, shift_labels, logits_to_keep, share_outer_slot, qwZ; what output.logits says."""

import pytest
import torch

from fused_workers import errors_case, fused_many as _many
from harness import run_distributed


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


def check(res: dict, rank: int, loss_tol: float, grad_tol: float, key: str = "chunked"):
    got = res[key]
    assert got["fused"] == (key == "chunked")
    assert got["logits"] == ("LogitsNotComputed" if key == "chunked" else "Tensor")
    assert got["eval_logits"] == "Tensor"
    for a, b in zip(got["losses"], res["ref_losses"][rank]):
        assert abs(a - b) <= loss_tol * abs(b), (a, b)
    assert set(got["grads"]) >= set(res["ref_grads"])
    for k, ref in res["ref_grads"].items():
        assert rel(got["grads"][k], ref) < grad_tol, (k, rel(got["grads"][k], ref))


FP32 = [
    dict(family="llama", accum=2, chunk=5),
    dict(family="llama", accum=2, call="num_items", chunk=3),
    dict(family="gemma", chunk=3),  # tied embeddings
    dict(family="gemma2", chunk=4),  # final_logit_softcapping
]


def _cases(world):
    cases = list(FP32)
    if world == 2:
        cases += [dict(family="qwen3", call="shift_labels"), dict(family="qwen2", call="logits_to_keep"),
                  dict(family="llama", shard_kw={"share_outer_slot": True}, accum=2),
                  dict(family="llama", losses=("hf", "chunked"), accum=2)]
    return cases


@pytest.mark.parametrize("world", [1, 2, 3])
def test_fp32_equals_the_unsharded_hf_loss(world):
    cases = _cases(world)
    results = run_distributed(_many, world, cases)
    for rank, per_rank in enumerate(results):
        for case, res in zip(cases, per_rank):
            for key in case.get("losses", ("chunked",)):
                check(res, rank, 1e-6, 1e-6, key)


def test_bf16_within_bf16_tolerance_and_qwz_as_the_hf_loss():
    cases = [dict(family="llama", dtype="bf16", accum=2), dict(family="gemma2", dtype="bf16"),
             dict(family="llama", reference=False, losses=("hf", "chunked"), shard_kw={"quantized_weights": 8})]
    results = run_distributed(_many, 2, cases)
    for rank, per_rank in enumerate(results):
        bf16, capped, qwz = per_rank
        check(bf16, rank, 1e-2, 3e-2)
        check(capped, rank, 1e-2, 3e-2)
        # qwZ: the same quantized weights, the loss computed either way
        for a, b in zip(qwz["chunked"]["losses"], qwz["hf"]["losses"]):
            assert abs(a - b) <= 1e-6 * abs(b)
        for k, g in qwz["hf"]["grads"].items():
            assert rel(qwz["chunked"]["grads"][k], g) < 1e-6, k


def test_bf16_one_rank_adds_into_fp32_master_grads():
    (res,) = run_distributed(_many, 1, [dict(family="llama", dtype="bf16", accum=2)])[0]
    check(res, 0, 1e-2, 3e-2)


def test_logits_of_a_fused_call_raise_naming_the_switch():
    got = run_distributed(errors_case, 2)[0]
    for name in ("argmax", "to", "index"):
        assert "the logits were not computed" in got[name] and "ShardConfig(loss='hf')" in got[name], got[name]
    assert got["shape"] == (2, 8, 96)
    assert "LogitsNotComputed" in got["repr"] and "ShardConfig(loss='hf')" in got["repr"]
    assert "handed its loss_function logits changed otherwise than soft-capped" in got["changed"]
    assert "ShardConfig(loss='hf')" in got["changed"]
    assert "positions of hidden states but" in got["keep"]
    assert got["tuple"] == ["Tensor", "LogitsNotComputed"]
    assert "the lm_head has 96 outputs but the config's vocab_size is 95" in got["vocab"]
    assert "would be lost. Pass ShardConfig(loss='hf')" in got["lost"]
    assert "not one of the families" in got["cohere"]
    assert got["cohere_logits"] == "Tensor"


def test_config_refuses_bad_values():
    import yashard

    with pytest.raises(ValueError, match=r"ShardConfig.loss='fused'; use 'chunked'"):
        yashard.ShardConfig(loss="fused")
    with pytest.raises(ValueError, match="ShardConfig.loss_chunk_tokens must be a positive int"):
        yashard.ShardConfig(loss_chunk_tokens=0)
    assert yashard.ShardConfig().loss == "chunked"


def test_hf_trainer_trains_through_the_fused_loss_as_on_ddp(tmp_path):
    """No label smoothing, so Trainer passes labels and num_items_in_batch to the model: the fused loss
    computes the training loss (accumulation 2); its evaluations run the HF loss under no_grad."""
    import hf_workers

    kw = dict(gradient_accumulation_steps=2, eval_strategy="steps", eval_steps=2)
    want = run_distributed(hf_workers.trainer_run, 2, "ddp", str(tmp_path / "ddp"), kw)[0]
    got = run_distributed(hf_workers.trainer_run, 2, "yashard", str(tmp_path / "y"), kw)[0]
    assert len(got["steps"]) == len(want["steps"]) > 0
    for g, w in zip(got["steps"], want["steps"]):
        for key in ("loss", "grad_norm"):
            assert abs(g[key] - w[key]) <= 1e-5 * abs(w[key]), (key, g, w)
    assert [e["eval_loss"] for e in got["evals"]] == pytest.approx([e["eval_loss"] for e in want["evals"]], rel=1e-5)
    for name, w in want["full"].items():
        torch.testing.assert_close(got["full"][name], w, rtol=1e-5, atol=1e-6)


def test_use_liger_kernel_is_not_fused_twice(tmp_path):
    """Without liger-kernel installed, Trainer refuses use_liger_kernel=True with transformers' own
    ImportError at train(), as without yashard: nothing else fuses the loss on top of yashard's."""
    import hf_workers

    pytest.importorskip("transformers")
    try:
        import liger_kernel  # noqa: F401
        pytest.skip("liger-kernel is installed: transformers applies none of it to a ShardedModel (not run here)")
    except ImportError:
        pass
    with pytest.raises(RuntimeError, match="liger-kernel >= 0.3.0 is not available"):
        run_distributed(hf_workers.trainer_run, 1, "yashard", str(tmp_path), dict(use_liger_kernel=True))
