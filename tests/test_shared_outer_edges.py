"""``ShardConfig(share_outer_slot=True)`` on the paths around plain training: each run here is made
twice, with the outer slot shared and with one of its own, same seed and same data, and must be
bitwise the same (losses, every step's ``full_grads()``, other outputs, ``full_state_dict()``),
raise where the default raises and nowhere else, and hold what its memory plan says, in buffers
that never move.

The paths: 1, 2, 3 and 5 decoder layers, a vocabulary larger than both layer slots together (640)
and one smaller (96), fp32 and bf16, every layer checkpointed; a forward that raises part way
(inside a layer, in a pre-hook before and after yashard's, in the lm_head, with and without grad)
and a backward that raises, then training goes on; ``torch.autograd.grad`` and
``backward(inputs=...)`` to ``inputs_embeds``, ``retain_graph=True`` and a second backward;
evaluations between steps and between forward and backward, ``generate()``;
``output_hidden_states=True`` with a loss on the hidden states (and one that never reaches the
lm_head); ``inputs_embeds`` from ``sm.get_input_embeddings()``; a forward never backwarded; a step
with every master turned off (``requires_grad_(False)``); everything frozen but the norms, only the
lm_head or only the embedding trained, one layer frozen; accumulation over 3 micro-batches with
``zero_grad(set_to_none=False)``; ``save_checkpoint`` / ``load_checkpoint`` mid-run and across the
setting (saved with it off, loaded with it on, and the reverse); worlds 2, 3 and 4 (hpZ, hybrid).
Weights read through the modules after a forward, a backward and a step are either the master's
values or refused (a ``ShardedStub``), never another unit's."""

import os

import pytest
import torch
import torch.distributed as dist

import yashard
from harness import run_distributed
from models import build

# ------------------------------------------------------------------------------------------------
# One run: a config (model, ShardConfig fields, what is frozen) and a list of steps, each a named
# way of producing this step's gradients. Everything observable is returned.


def _model(c: dict):
    model = build("llama", seed=0, num_hidden_layers=c["n"], vocab_size=c["vocab"])
    freeze = c.get("freeze")
    for name, p in model.named_parameters():
        if freeze == "all but norms":
            p.requires_grad_("norm" in name)
        elif freeze == "only lm_head":
            p.requires_grad_(name.startswith("lm_head"))
        elif freeze == "only embedding":
            p.requires_grad_("embed_tokens" in name)
        elif freeze:
            p.requires_grad_(not any(f in name for f in freeze))
    return model


def _shard(c: dict, share: bool):
    config = yashard.ShardConfig(param_dtype=torch.bfloat16 if c.get("bf16") else torch.float32,
                                 checkpoint_layers=c["n"] if c.get("ckpt") else 0, share_outer_slot=share,
                                 **c.get("kw", {}))
    sm = yashard.shard(_model(c), config=config)
    return sm, torch.optim.AdamW(sm.param_groups(0.1), lr=1e-2)


def _raise_once(module, *, pre=True, prepend=False):
    """A hook on ``module`` that raises the first time it runs; its handle."""
    fired = []

    def hook(*args):
        if not fired:
            fired.append(True)
            raise ValueError("hook raised")
    if pre:
        return module.register_forward_pre_hook(hook, prepend=prepend)
    return module.register_forward_hook(hook)


def _step(sm, how: str, ids, extra: list, c: dict):
    """This step's forwards and backwards, as ``how`` says; returns the loss it reports."""
    n = c["n"]
    layer = sm.model.layers[min(1, n - 1)]
    if how == "eval between":  # evaluations ahead of the forward and between forward and backward
        with torch.no_grad():
            extra.append(sm(input_ids=ids.flip(0)).logits)
        loss = sm(input_ids=ids, labels=ids).loss
        for _ in range(2):
            with torch.no_grad():
                extra.append(sm(input_ids=ids.flip(1), labels=ids).loss)
        loss.backward()
        return loss
    if how == "autograd.grad":  # inputs_embeds from the input embedding; grad to them, then backward
        embeds = sm.get_input_embeddings()(ids)
        if not embeds.requires_grad:  # (a frozen embedding)
            embeds = embeds.detach().requires_grad_(True)
        loss = sm(inputs_embeds=embeds, labels=ids).loss
        extra.append(torch.autograd.grad(loss, embeds, retain_graph=True)[0])
        loss.backward()
        return loss
    if how == "backward(inputs=)":
        embeds = sm.get_input_embeddings()(ids).detach().requires_grad_(True)
        loss = sm(inputs_embeds=embeds, labels=ids).loss
        loss.backward(inputs=[embeds], retain_graph=True)
        extra.append(embeds.grad)
        loss.backward()
        return loss
    if how == "retain_graph":
        loss = sm(input_ids=ids, labels=ids).loss
        loss.backward(retain_graph=True)
        loss.backward()
        return loss
    if how == "hidden states":  # every hidden state in the loss, the embedding's output included
        out = sm(input_ids=ids, labels=ids, output_hidden_states=True)
        loss = out.loss + 0.01 * sum(h.float().pow(2).mean() for h in out.hidden_states)
        loss.backward()
        return loss
    if how == "hidden state only":  # the lm_head ran with grad, but the loss does not reach it
        out = sm(input_ids=ids, output_hidden_states=True)
        loss = out.hidden_states[1].float().pow(2).mean()
        loss.backward()
        return loss
    if how.startswith("raise"):  # a forward raises part way; yashard recovers at the next one
        where = how.split(" ", 1)[1]
        handle = {"inside layer": lambda: _raise_once(layer.mlp),
                  "layer pre-hook": lambda: _raise_once(layer),
                  "layer pre-hook first": lambda: _raise_once(layer, prepend=True),
                  "layer post-hook": lambda: _raise_once(layer, pre=False),
                  "lm_head": lambda: _raise_once(sm.lm_head),
                  "no grad": lambda: _raise_once(layer.mlp)}[where]()
        try:
            with torch.no_grad() if where == "no grad" else torch.enable_grad():
                sm(input_ids=ids, labels=ids)
        except ValueError as e:
            extra.append(str(e))
        handle.remove()
        loss = sm(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss
    if how == "backward raises":  # a backward raises after the lm_head's and layer 1's; the batch is lost
        out = sm(input_ids=ids, labels=ids, output_hidden_states=True)
        out.hidden_states[1].register_hook(lambda g: (_ for _ in ()).throw(ValueError("backward hook raised")))
        try:
            out.loss.backward()
        except ValueError as e:
            extra.append(str(e))
        with torch.no_grad():
            extra.append(sm(input_ids=ids).logits)
        loss = sm(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss
    if how == "discarded forward":  # a grad-enabled forward whose backward never runs
        sm(input_ids=ids.flip(1), labels=ids)
        loss = sm(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss
    if how == "all masters off":  # a leaf inputs_embeds trains alone for a step
        with torch.no_grad():
            embeds = sm.get_input_embeddings()(ids)
        embeds.requires_grad_(True)
        sm.requires_grad_(False)
        loss = sm(inputs_embeds=embeds, labels=ids).loss
        loss.backward()
        sm.requires_grad_(True)
        extra.append(embeds.grad)
        return loss
    if how == "eval mode":  # a grad-enabled forward in eval mode (checkpointing then off)
        sm.eval()
        loss = sm(input_ids=ids, labels=ids).loss
        sm.train()
        loss.backward()
        return loss
    if how == "accumulate 3":
        g = torch.Generator().manual_seed(int(ids.sum()))
        total = 0.0
        for i in range(3):
            x = ids if i == 0 else torch.randint(0, c["vocab"], ids.shape, generator=g)
            loss = sm(input_ids=x, labels=x).loss
            if i == 1:
                with torch.no_grad():
                    extra.append(sm(input_ids=x.flip(1)).logits)
            (loss / 3).backward()
            total = total + loss.detach() / 3
        return total
    assert how == "plain", how
    loss = sm(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss


def _train(rank: int, world: int, c: dict, share: bool) -> dict:
    sm, opt = _shard(c, share)
    g = torch.Generator().manual_seed(100 + rank)
    out = {"losses": [], "grads": [], "extra": [], "ptrs": set()}
    for how in c["steps"]:
        ids = torch.randint(0, c["vocab"], (2, 10), generator=g)
        out["losses"].append(_step(sm, how, ids, out["extra"], c).detach())
        out["grads"].append(sm.full_grads())
        out["extra"].append(sm.clip_grad_norm_(1.0))
        opt.step()
        opt.zero_grad(set_to_none=c.get("zero_grad_none", True))
        out["ptrs"].add(tuple(t.data_ptr() for t in sm.runtime.allocated_tensors().values()))
    if c.get("generate"):
        out["extra"].append(sm.generate(torch.randint(0, c["vocab"], (1, 4), generator=g), max_new_tokens=4,
                                        do_sample=False))
    out["params"] = sm.full_state_dict()
    out["plan"] = sm.memory_plan().total_bytes
    out["allocated"] = sum(t.numel() * t.element_size() for t in sm.runtime.allocated_tensors().values())
    return out


def _both(rank: int, world: int, configs: list) -> list:
    return [{share: _train(rank, world, c, share) for share in (False, True)} for c in configs]


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _check(results: list, configs: list) -> None:
    for rank_results in results:
        for c, r in zip(configs, rank_results):
            own, shared = r[False], r[True]
            raised = [x for x in own["extra"] if isinstance(x, str)]  # (each raising step did raise)
            assert raised == ["backward hook raised" if how == "backward raises" else "hook raised"
                              for how in c["steps"] if "raise" in how], (c, raised)
            for key in ("losses", "grads", "extra", "params"):
                assert _same(shared[key], own[key]), (c, key)
            assert shared["plan"] == shared["allocated"] < own["plan"], c  # the plan is what is held, and less
            assert len(shared["ptrs"]) == 1, c  # and it never moves


# The step kinds, over the model shapes: 1, 2, 3 and 5 layers, each with a vocabulary smaller and one
# larger than both layer slots, fp32 and bf16, every layer checkpointed or none.
ALL_STEPS = ["eval between", "autograd.grad", "backward(inputs=)", "retain_graph", "hidden states",
             "hidden state only", "raise inside layer", "raise layer pre-hook", "raise layer pre-hook first",
             "raise layer post-hook", "raise lm_head", "raise no grad", "backward raises", "discarded forward",
             "all masters off", "eval mode", "accumulate 3", "plain"]
SHAPES = [dict(n=1, vocab=96, bf16=True, ckpt=True), dict(n=1, vocab=640),
          dict(n=2, vocab=96, ckpt=True), dict(n=2, vocab=640, bf16=True),
          dict(n=3, vocab=96, bf16=True), dict(n=3, vocab=640, ckpt=True),
          dict(n=5, vocab=96, ckpt=True, zero_grad_none=False), dict(n=5, vocab=640, bf16=True, ckpt=True)]


def test_every_step_kind_over_every_shape_is_bitwise_the_outer_slots():
    # (each step kind on 2 or 3 of the shapes, of different layer counts: a third of them per shape)
    configs = [dict(shape, steps=[how for j, how in enumerate(ALL_STEPS) if (i + j) % 3 == 0] + ["plain"],
                    generate=i % 2 == 0) for i, shape in enumerate(SHAPES)]
    _check(run_distributed(_both, 2, configs), configs)


FROZEN = ["all but norms", "only lm_head", "only embedding", ("layers.1.",), ("layers.0.", "embed_tokens")]


def test_frozen_units_and_accumulation_are_bitwise_the_outer_slots():
    steps = ["eval between", "accumulate 3", "autograd.grad", "plain"]
    configs = [dict(n=2, vocab=640, bf16=True, ckpt=True, freeze=f, steps=steps) for f in FROZEN]
    configs += [dict(n=3, vocab=96, freeze=f, zero_grad_none=False, steps=steps) for f in FROZEN]
    _check(run_distributed(_both, 2, configs), configs)


@pytest.mark.parametrize("world", [3, 4])
def test_other_worlds_hpz_and_hybrid_are_bitwise_the_outer_slots(world):
    steps = ["eval between", "autograd.grad", "raise inside layer", "backward raises", "accumulate 3", "plain"]
    shapes = [dict(n=2, vocab=640, bf16=True, ckpt=True), dict(n=3, vocab=96), dict(n=5, vocab=640)]
    kws = [{}] if world == 3 else [{"secondary_group_size": 2}, {"shard_group_size": 2}]
    # (at world 4, two of the shapes for each of hpZ and hybrid)
    configs = [dict(shape, kw=kw, steps=steps, generate=True) for i, kw in enumerate(kws)
               for j, shape in enumerate(shapes) if world == 3 or i != j]
    configs += [dict(n=3, vocab=640, kw=kw, freeze="only embedding", steps=steps[:2]) for kw in kws]
    _check(run_distributed(_both, world, configs), configs)


# ------------------------------------------------------------------------------------------------
# Checkpoints: saved with one setting, loaded with either, and loaded back into the running model.


def _resume(rank: int, world: int, root: str, c: dict) -> dict:
    """Train 4 steps saving after step 1 (with each setting, into its own folder); then, for each
    setting, a fresh model loads each save and trains steps 2-3 again, and the running model loads
    its own save back and trains steps 2-3 again."""
    data = [torch.randint(0, c["vocab"], (2, 10), generator=torch.Generator().manual_seed(10 * s + rank))
            for s in range(4)]

    def steps(sm, opt, which):
        losses = []
        for s in which:
            loss = sm(input_ids=data[s], labels=data[s]).loss
            loss.backward()
            losses.append(loss.detach())
            opt.step()
            opt.zero_grad()
        return losses

    out = {}
    running = {}
    for share in (False, True):
        sm, opt = _shard(c, share)
        first = steps(sm, opt, [0, 1])
        yashard.save_checkpoint(os.path.join(root, f"share={share}"), sm, opt, extra={"step": 2})
        out[("uninterrupted", share)] = (first + steps(sm, opt, [2, 3]), sm.full_state_dict())
        running[share] = (sm, opt)
    dist.barrier()
    for share in (False, True):
        for saved in (False, True):
            sm, opt = _shard(c, share)
            assert yashard.load_checkpoint(os.path.join(root, f"share={saved}"), sm, opt) == {"step": 2}
            out[("loaded", saved, share)] = (steps(sm, opt, [2, 3]), sm.full_state_dict())
        sm, opt = running[share]  # (its optimizer holds step 4's moments: loaded back to step 2's)
        yashard.load_checkpoint(os.path.join(root, f"share={share}"), sm, opt)
        out[("reloaded", share)] = (steps(sm, opt, [2, 3]), sm.full_state_dict())
    return out


@pytest.mark.parametrize("shape", [dict(n=2, vocab=640, bf16=True, ckpt=True), dict(n=3, vocab=96)],
                         ids=["2 layers, large vocabulary", "3 layers, small vocabulary"])
def test_checkpoints_load_across_the_setting_and_mid_run(tmp_path, shape):
    for out in run_distributed(_resume, 2, str(tmp_path), shape):
        want = out[("uninterrupted", False)]
        assert _same(out[("uninterrupted", True)], want)
        resumed = [v for k, v in out.items() if k[0] != "uninterrupted"]
        assert len(resumed) == 6
        for got in resumed:  # steps 2-3 again from the save: the same losses and weights
            assert _same(got[0], want[0][2:]) and _same(got[1], want[1])


# ------------------------------------------------------------------------------------------------
# Weights read through the modules: the master's values, or refused; never another unit's.


def _reads(rank: int, world: int, n: int, vocab: int, share: bool) -> dict:
    sm, opt = _shard(dict(n=n, vocab=vocab, ckpt=True), share)
    names = ["lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"] + [
        f"model.layers.{i}.{p}" for i in range(n) for p in ("mlp.up_proj.weight", "self_attn.q_proj.weight")]
    seen = {}

    def read(when):
        full = sm.full_state_dict()
        for name in names:
            module = sm
            for part in name.split(".")[:-1]:
                module = module[int(part)] if part.isdigit() else getattr(module, part)
            try:
                same = torch.equal(getattr(module, name.rsplit(".", 1)[1]).detach().float(), full[name])
            except RuntimeError:  # (a ShardedStub: "lm_head.weight is sharded by yashard ...")
                seen[(when, name)] = "refused"
                continue
            seen[(when, name)] = "master" if same else "OTHER VALUES"

    ids = torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(rank))
    loss = sm(input_ids=ids, labels=ids).loss
    read("after forward")
    loss.backward()
    read("after backward")
    opt.step()
    read("after step")
    with torch.no_grad():
        sm(input_ids=ids)
    read("after evaluation")
    # a forward that raised in the last layer's MLP left that layer's views on its modules; the
    # embedding's next gather (called ahead of a forward) writes over their memory
    hook = sm.model.layers[n - 1].mlp.register_forward_pre_hook(lambda *a: 1 / 0)
    try:
        sm(input_ids=ids)
    except ZeroDivisionError:
        pass
    hook.remove()
    with torch.no_grad():
        sm.get_input_embeddings()(ids)
    read("after a raised forward")
    return seen


def test_weights_read_after_a_pass_are_the_masters_or_refused():
    """(The default's layers of a model of 1 or 2 layers have their slot to themselves: their
    weights stay readable between forwards. Shared with the outer units, they are refused.)"""
    for n, vocab in ((1, 96), (2, 640), (3, 96)):
        for share in (False, True):
            for seen in run_distributed(_reads, 2, n, vocab, share):
                assert set(seen.values()) <= {"master", "refused"}, (n, vocab, share, seen)
                assert seen[("after forward", "lm_head.weight")] == "refused"
                assert seen[("after step", "model.norm.weight")] == "master"
