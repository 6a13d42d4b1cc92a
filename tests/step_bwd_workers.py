"""Rank functions for tests/test_step_in_backward.py: the same training with the ordinary optimizer
step and with ``ShardConfig(step_in_backward=True)``, checkpoints across the two and across world
sizes, and the mode's refusals."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import yashard
from models import batches, build

LR, WD, SEQ, STEPS = 1e-2, 0.1, 8, 3


def _model(family: str, frozen: tuple = ()):
    if family == "lora":  # PEFT LoRA on q_proj and v_proj: the adapter group trains, the layers are frozen
        from peft_workers import lora_model
        return lora_model()
    model = build(family)
    for name, p in model.named_parameters():
        if any(f in name for f in frozen):
            p.requires_grad_(False)
    return model


def _optimizer(sm, step_in_backward: bool):
    if step_in_backward:
        return sm.optimizer_in_backward(torch.optim.AdamW, sm.param_groups(WD), lr=LR)
    return torch.optim.AdamW(sm.param_groups(WD), lr=LR)


def _train_steps(sm, opt, sched, rank, world, steps, start=0, global_batch=None, vocab=96):
    """Train ``steps`` steps of the fixed data stream from step ``start`` (global batches of
    ``global_batch`` rows, 2 per rank by default); after each step, the full weights (a
    collective), the loss over every rank, and the data pointers of every tensor the runtime holds."""
    out = {"params": [], "losses": [], "ptrs": []}
    data = batches(start + steps, global_batch or 2 * world, SEQ, vocab)[start:]
    for batch in data:
        x = batch.chunk(world)[rank]
        loss = sm(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        out["losses"].append(total.item() / world)
        out["params"].append(sm.full_state_dict())
        out["ptrs"].append({k: t.data_ptr() for k, t in sm.runtime.allocated_tensors().items()})
    return out


def parity(rank: int, world: int, cases: dict) -> dict:
    """Each case trained twice, the ordinary step then the step in backward, with an LR schedule;
    the plan, what the runtime holds, and whether the masters hold a ``.grad`` between steps."""
    res = {}
    for name, (kw, frozen, family) in cases.items():
        runs = {}
        for sib in (False, True):
            sm = yashard.shard(_model(family, frozen), config=yashard.ShardConfig(step_in_backward=sib, **kw))
            opt = _optimizer(sm, sib)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
            r = _train_steps(sm, opt, sched, rank, world, STEPS)
            r["plan"] = sm.memory_plan().total_bytes
            r["rows"] = [row.name for row in sm.memory_plan().rows]
            r["held"] = sum(t.numel() * t.element_size() for t in sm.runtime.allocated_tensors().values())
            r["grads"] = [p.grad is not None for p in sm.parameters()]
            r["lrs"] = [g["lr"] for g in opt.param_groups]
            r["inner_lrs"] = [g["lr"] for g in getattr(opt, "inner", opt).param_groups]
            runs[sib] = r
            del sm, opt, sched
        res[name] = runs
    return res


def checkpoints(rank: int, world: int, path: str, stage: str) -> dict:
    """``stage="save"``: 2 steps in backward, a yashard checkpoint and a DCP one (model and
    optimizer, the scheduler's state as extra), then 2 more steps. ``stage="resume"``: each
    checkpoint loaded at this world size, into the step in backward and into the ordinary step, then
    the same 2 steps."""
    import torch.distributed.checkpoint as dcp

    def fresh(sib):
        sm = yashard.shard(_model("llama"), config=yashard.ShardConfig(step_in_backward=sib))
        opt = _optimizer(sm, sib)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        return sm, opt, sched

    if stage == "save":
        sm, opt, sched = fresh(True)
        _train_steps(sm, opt, sched, rank, world, 2, global_batch=6)
        yashard.save_checkpoint(os.path.join(path, "ys"), sm, opt, extra={"sched": sched.state_dict()["last_epoch"]})
        dcp.save({"model": sm.sharded_state_dict(), "optim": sm.sharded_optim_state_dict(opt)},
                 checkpoint_id=os.path.join(path, "dcp"))
        torch.save(sched.state_dict(), os.path.join(path, f"sched{rank}.pt"))
        return _train_steps(sm, opt, sched, rank, world, 2, start=2, global_batch=6)
    out = {}
    for kind in ("ys", "dcp"):
        for sib in (True, False):
            sm, opt, sched = fresh(sib)
            if kind == "ys":
                yashard.load_checkpoint(os.path.join(path, "ys"), sm, opt)
            else:
                sd = {"model": sm.sharded_state_dict(), "optim": sm.sharded_optim_state_dict(opt)}
                dcp.load(sd, checkpoint_id=os.path.join(path, "dcp"))
                sm.load_sharded_optim_state_dict(opt, sd["optim"])
            sched.load_state_dict(torch.load(os.path.join(path, "sched0.pt"), weights_only=False))
            out[(kind, sib)] = _train_steps(sm, opt, sched, rank, world, 2, start=2, global_batch=6)
    return out


def _catch(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the message is what the test matches
        return f"{type(e).__name__}: {e}"
    return "no error"


def refusals(rank: int, world: int) -> dict:
    """Every refusal of the mode, by message, on one model (each leaves it usable for the next)."""
    out = {}
    cfg = yashard.ShardConfig(step_in_backward=True)
    sm = yashard.shard(_model("llama"), config=cfg)
    x = torch.randint(0, 96, (2, SEQ), generator=torch.Generator().manual_seed(3))

    def backward():
        sm(input_ids=x, labels=x).loss.backward()

    out["no optimizer"] = _catch(backward)  # raised at the backward's first hook: nothing stepped
    sm2 = yashard.shard(_model("llama"))
    out["not the mode"] = _catch(lambda: sm2.optimizer_in_backward(torch.optim.AdamW, lr=LR))
    out["missing"] = _catch(lambda: sm.optimizer_in_backward(torch.optim.AdamW, list(sm.parameters())[:1], lr=LR))
    out["foreign"] = _catch(lambda: sm.optimizer_in_backward(torch.optim.AdamW, [torch.nn.Parameter(torch.zeros(3))]))
    out["shape aware"] = _catch(lambda: sm.optimizer_in_backward(torch.optim.LBFGS, sm.parameters()))
    opt = sm.optimizer_in_backward(torch.optim.AdamW, sm.param_groups(WD), lr=LR)
    out["closure"] = _catch(lambda: opt.step(lambda: 0.0))
    out["add group"] = _catch(lambda: opt.add_param_group({"params": []}))
    out["clip"] = _catch(lambda: sm.clip_grad_norm_(1.0))
    out["no_sync"] = _catch(lambda: sm.no_sync().__enter__())
    out["scaler"] = _catch(lambda: yashard.ShardedGradScaler(sm))
    out["full_grads"] = _catch(sm.full_grads)
    out["comm hook"] = _catch(lambda: sm.register_comm_hook(None, yashard.comm_hooks.reduce_scatter_hook))
    other = torch.optim.AdamW(sm.parameters(), lr=LR)
    backward()
    out["second backward"] = _catch(backward)  # (the first stepped every unit)
    out["other optimizer"] = _catch(other.step)
    opt.step()
    before = [p.detach().clone() for p in sm.parameters()]
    out["other optimizer after step"] = _catch(other.step)
    out["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, sm.parameters()))
    with torch.no_grad():
        list(sm.parameters())[0].grad = torch.zeros_like(list(sm.parameters())[0])
    out["grad set"] = _catch(backward)
    list(sm.parameters())[0].grad = None
    penalty = list(sm.parameters())[0]
    out["penalty"] = _catch(lambda: (sm(input_ids=x, labels=x).loss + penalty.sum()).backward())
    penalty.grad = None  # (autograd may have accumulated the penalty's gradient before the refusal)
    backward()  # (the refused backward left no state: training goes on)
    opt.step()
    out["trains on"] = True
    for name, kw in (("bf16 reduce", {"reduce_dtype": torch.bfloat16}), ("skip", {"on_nonfinite": "skip"}),
                     ("not a bool", {"step_in_backward": 1})):
        out[name] = _catch(lambda kw=kw: yashard.ShardConfig(**{"step_in_backward": True, **kw}))
    # opt.state_dict() into a new optimizer_in_backward, which replaces the first
    sd = opt.state_dict()
    opt2 = sm.optimizer_in_backward(torch.optim.AdamW, sm.param_groups(WD), lr=LR)
    opt2.load_state_dict(sd)
    inner = opt2.inner
    out["state dict"] = (opt2.param_groups is inner.param_groups and opt2.state is inner.state
                         and all(torch.equal(opt.state[p]["exp_avg"], opt2.state[p]["exp_avg"])
                                 for p in sm.parameters() if p in opt.state)
                         and len(opt2.state) == len(opt.state) > 0)
    backward()
    out["replaced"] = _catch(opt.step)
    opt, opt2 = opt2, None
    opt.step()
    # a NaN gradient: the step ran in backward; opt.step()'s checks name it after the fact
    with torch.no_grad():
        sm.runtime.layers[1].master[:4] = float("nan")
    backward()
    out["nan"] = _catch(opt.step)
    out["after nan"] = _catch(backward)  # (the step that raised still ended the backward's: not "a second backward")
    return out


def unreached(rank: int, world: int) -> dict:
    """A loss on the first layer's output only: layers 1-3 and the lm_head ran forward, but no
    rank's loss reached them. The ordinary step skips them (their ``.grad`` goes back to None); so
    must the step in backward. Both runs' weights after 2 steps, and the initial ones."""
    out = {}
    for sib in (False, True):
        sm = yashard.shard(_model("llama"), config=yashard.ShardConfig(step_in_backward=sib))
        opt = _optimizer(sm, sib)
        out["init"] = sm.full_state_dict()
        for batch in batches(2, 2 * world, SEQ, 96):
            x = batch.chunk(world)[rank]
            hidden = sm(input_ids=x, output_hidden_states=True).hidden_states[1]
            hidden.pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        out[sib] = sm.full_state_dict()
    return out
