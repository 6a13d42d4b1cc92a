"""Worker functions for tests/test_fused_head.py: the fused chunked loss on a sharded model against
the unsharded HF model, on W gloo ranks. Each rank computes the single-process reference itself
(the tiny model, every rank's batch) before sharding."""

from __future__ import annotations

import copy

import torch

import models
import yashard

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _batches(case: dict, world: int, vocab: int) -> list[list[dict]]:
    """Per micro-batch, per rank: the call's keyword arguments."""
    g = torch.Generator().manual_seed(7)
    out = []
    for m in range(case.get("accum", 1)):
        per_rank = []
        for r in range(world):
            x = torch.randint(3, vocab, (2, 10), generator=g)
            labels = x.clone()
            labels[0, : 2 + m + r] = -100
            kw = {"input_ids": x}
            how = case.get("call", "labels")
            if how == "labels":
                kw["labels"] = labels
            elif how == "num_items":
                kw["labels"] = labels
                kw["num_items_in_batch"] = torch.tensor(25)
            elif how == "shift_labels":  # (HF computes a loss only when labels are given too)
                shift = torch.randint(0, vocab, (2, 10), generator=g)
                shift[1, 6:] = -100
                kw.update(labels=labels, shift_labels=shift)
            elif how == "logits_to_keep":
                kw.update(labels=labels[:, -6:], logits_to_keep=6)
            per_rank.append(kw)
        out.append(per_rank)
    return out


def _run(model, batches_of_rank, accum):
    losses = []
    for kw in batches_of_rank:
        out = model(**kw)
        (out.loss / accum).backward()
        losses.append(out.loss.detach().float().item())
    return losses, out


def fused_case(rank: int, world: int, case: dict) -> dict:
    dtype = DTYPES[case.get("dtype", "fp32")]
    model = models.build(case.get("family", "llama"), **case.get("overrides", {}))
    vocab = model.config.vocab_size
    batches = _batches(case, world, vocab)
    accum = len(batches)
    ref_losses, ref_grads = None, None
    if case.get("reference", True):
        ref = copy.deepcopy(model).to(dtype)
        ref_losses = []
        for r in range(world):
            losses, _ = _run(ref, [b[r] for b in batches], accum * world)  # (the mean over ranks)
            ref_losses.append(losses)
        ref_grads = {k: p.grad.float().clone() for k, p in ref.named_parameters() if p.grad is not None}
    out = {"ref_losses": ref_losses, "ref_grads": ref_grads}
    for loss in case.get("losses", ("chunked",)):
        cfg = yashard.ShardConfig(param_dtype=dtype, loss=loss, loss_chunk_tokens=case.get("chunk", 4),
                                  **case.get("shard_kw", {}))
        sm = yashard.shard(copy.deepcopy(model), config=cfg)
        losses, last = _run(sm, [b[rank] for b in batches], accum)
        grads = sm.full_grads()
        out[loss] = {"losses": losses, "grads": grads, "fused": sm.runtime.fused_head.why_not is None,
                     "logits": type(last.logits).__name__}
        with torch.no_grad():  # an evaluation gets its logits
            ev = sm(**batches[0][rank])
        out[loss]["eval_logits"] = type(ev.logits).__name__
        out[loss]["eval_loss"] = ev.loss.float().item()
    return out


def errors_case(rank: int, world: int) -> dict:
    """What a fused call refuses, and what reading its logits says."""
    got = {}
    model = models.build("llama")
    sm = yashard.shard(model, config=yashard.ShardConfig(loss_chunk_tokens=3))
    x = torch.randint(0, 96, (2, 8))
    out = sm(input_ids=x, labels=x)
    for name, fn in (("argmax", lambda t: t.argmax(-1)), ("to", lambda t: t.to(torch.bfloat16)),
                     ("index", lambda t: t[:, -1])):
        try:
            fn(out.logits)
            got[name] = "no error"
        except RuntimeError as e:
            got[name] = str(e)
    got["shape"] = tuple(out.logits.shape)
    got["repr"] = repr(out.logits)
    out.loss.backward()
    # the lm_head's output changed in a way the loss did not assume: refused, never trained wrong
    sm.runtime.fused_head.softcap = 5.0
    try:
        sm(input_ids=x, labels=x)
        got["changed"] = "no error"
    except RuntimeError as e:
        got["changed"] = str(e)
    sm.runtime.fused_head.softcap = None
    # labels of another length than the positions the lm_head computes
    try:
        sm(input_ids=x, labels=x, logits_to_keep=3)
        got["keep"] = "no error"
    except ValueError as e:
        got["keep"] = str(e)
    # an lm_head of another size than the config's vocabulary
    fh = sm.runtime.fused_head
    fh.vocab_size = 95
    try:
        sm(input_ids=x, labels=x)
        got["vocab"] = "no error"
    except ValueError as e:
        got["vocab"] = str(e)
    fh.vocab_size = 96
    # a forward that computed the fused loss but never handed the lm_head's output to its loss
    from yashard.fused_head import _Call

    fh.call = _Call(x, None, None, -100, loss=torch.zeros(()))
    try:
        fh.post_forward(sm.module, (), {"logits": torch.zeros(1)})
        got["lost"] = "no error"
    except RuntimeError as e:
        got["lost"] = str(e)
    # a return_dict=False call: the tuple's logits are replaced too
    out = sm(input_ids=x, labels=x, return_dict=False)
    got["tuple"] = [type(v).__name__ for v in out[:2]]
    out[0].backward()
    # a family the fused loss does not follow runs the HF loss
    cohere = yashard.shard(models.build("cohere"))
    got["cohere"] = cohere.runtime.fused_head.why_not
    got["cohere_logits"] = type(cohere(input_ids=x, labels=x).logits).__name__
    return got


def fused_many(rank: int, world: int, cases: list) -> list:
    return [fused_case(rank, world, c) for c in cases]
