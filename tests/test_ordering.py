"""Hook and collective ordering, observed on real runs.

* GateGradFlow: layer i's backward-complete hook runs after every weight gradient of layer i was
  written and before any backward op of layer i-1.
* Prefetch: the gather of layer i+1 is issued before layer i computes (forward), and in backward the
  gather of layer i-1 is issued before the reduce-scatter of layer i, so the gather compute needs
  next is never queued behind a reduce-scatter.
* Every rank issues the same collectives in the same order.
"""

import pytest
import torch

import yashard
from harness import run_distributed
from models import batches, build


def _as_keyword(module, args, kwargs):
    """Forward pre-hook: pass the layer's hidden states as ``hidden_states=`` instead of positionally."""
    return args[1:], {"hidden_states": args[0], **kwargs} if args else kwargs


def _record_run(rank, world, ckpt, keyword=False):
    from yashard.collectives import Comm
    from yashard.unit import Unit

    events = []
    orig_write, orig_gate = Unit.write_grad, Unit.on_grads_complete
    orig_ag, orig_rs = Comm.all_gather, Comm.reduce_scatter

    def write_grad(self, index, grad):
        events.append(("write", self.name))
        return orig_write(self, index, grad)

    def gate(self):
        events.append(("gate", self.name))
        return orig_gate(self)

    def ag(self, out, shard, unit, *args, **kwargs):
        events.append(("AG", unit))
        return orig_ag(self, out, shard, unit, *args, **kwargs)

    def rs(self, out, full, unit, *args, **kwargs):
        events.append(("RS", unit))
        return orig_rs(self, out, full, unit, *args, **kwargs)

    Unit.write_grad, Unit.on_grads_complete = write_grad, gate
    Comm.all_gather, Comm.reduce_scatter = ag, rs

    model = build("llama", num_hidden_layers=6)
    if keyword:  # registered before yashard's hooks, so they see (and must gate) a keyword input
        for layer in model.model.layers:
            layer.register_forward_pre_hook(_as_keyword, with_kwargs=True)
    sm = yashard.shard(model, config=yashard.ShardConfig(checkpoint_layers=ckpt))
    opt = torch.optim.SGD(sm.parameters(), lr=0.0)  # its step changes the masters' versions
    for i, layer in enumerate(model.model.layers):
        for mod in layer.modules():
            if isinstance(mod, torch.nn.Linear):
                def fwd_hook(m, a, out, i=i):
                    events.append(("fwd", f"layer_{i}"))
                    if out.requires_grad:
                        out.register_hook(lambda g, i=i: events.append(("bwd", f"layer_{i}")))
                mod.register_forward_hook(fwd_hook)
    ids = batches(1, 2 * world, 16, 96)[0].chunk(world)[rank]
    sm(input_ids=ids, labels=ids).loss.backward()
    events.clear()
    opt.step()  # its post-hook gathers the next forward's first units: recorded as part of that forward
    opt.zero_grad()
    out = sm(input_ids=ids, labels=ids)  # one micro-batch per step: every layer is gathered again
    events.append(("backward", ""))
    out.loss.backward()
    return events


def _check(events, n_layers):
    split = events.index(("backward", ""))
    fwd, bwd = events[:split], events[split:]
    pos = {e: i for i, e in enumerate(fwd) if e[0] == "AG"}
    for i in range(n_layers - 1):
        first_compute = next(k for k, e in enumerate(fwd) if e == ("fwd", f"layer_{i}"))
        assert pos[("AG", f"layer_{i + 1}")] < first_compute, f"layer_{i + 1} was not prefetched before layer_{i} ran"
    for i in range(n_layers - 1, 0, -1):
        me, prev = f"layer_{i}", f"layer_{i - 1}"
        gate = bwd.index(("gate", me))
        writes = [k for k, e in enumerate(bwd) if e == ("write", me)]
        ops_prev = [k for k, e in enumerate(bwd) if e == ("bwd", prev)]
        ops_me = [k for k, e in enumerate(bwd) if e == ("bwd", me)]
        assert writes and max(writes) < gate, f"{me}: a weight gradient was written after its gate"
        assert ops_me and max(ops_me) < gate, f"{me}: a backward op ran after its gate"
        assert ops_prev and gate < min(ops_prev), f"{me}: {prev} started backward before {me}'s gate"
        assert bwd.count(("gate", me)) == 1
        rs = bwd.index(("RS", me))
        assert gate < rs, f"{me}: reduce-scatter issued before its gradients were complete"
        if ("AG", prev) in bwd:  # the last two layers stay resident from the forward
            assert bwd.index(("AG", prev)) < rs, f"gather of {prev} queued behind reduce-scatter of {me}"
    # the last two layers are not gathered again in backward, all the others are
    assert ("AG", f"layer_{n_layers - 1}") not in bwd and ("AG", f"layer_{n_layers - 2}") not in bwd
    assert all(("AG", f"layer_{i}") in bwd for i in range(n_layers - 2))


@pytest.mark.parametrize("keyword", [False, True], ids=["positional", "keyword"])
def test_gate_prefetch_and_collective_order(keyword):
    for ckpt in (0, 6):
        results = run_distributed(_record_run, 2, ckpt, keyword)
        for events in results:
            _check(events, 6)
        coll = [[e for e in ev if e[0] in ("AG", "RS")] for ev in results]
        assert coll[0] == coll[1], "ranks issued different collective sequences"
