"""Communication modes on the fixed buffers: comm hooks, hybrid sharding, ZeRO++ (qwZ, hpZ, qgZ).

Exact modes (default hook, hybrid, hpZ) match the single-process reference like the plain runtime;
lossy modes (bf16 wire, qwZ, qgZ) stay within their documented bounds, and every mode's collective
log shows the traffic it promises (which group, how many bytes). On CPU, 4 processes act as
2 nodes x 2 ranks.
"""

from fractions import Fraction

import pytest
import torch

from harness import run_distributed
from models import build
from comm_hook_workers import run_hooked, simulate_qgz_seeded
from quant_checks import assert_bitwise, simulate_qgz
from workers import loss_rel_err, max_rel_err, rel_err, run_many, run_reference, scenario
from test_parity import check_fp32
from yashard import comm_hooks
from yashard.quant import mix_seed
from yashard.zeropp import qgz_fallback_reason

H44 = {"hidden_size": 44, "num_attention_heads": 2, "num_key_value_heads": 1}  # padding everywhere


def _bytes(log, phase=None, op=None, group=None, unit_prefix=None):
    return sum(r[4] for r in log if (phase is None or r[0] == phase) and (op is None or r[1] == op)
               and (group is None or r[5] == group) and (unit_prefix is None or r[2].startswith(unit_prefix)))


def test_exact_modes_match_the_reference_at_world_4():
    """Hybrid (2 shard groups of 2, or 4 of 1: replication), hpZ (secondary groups of 2), both, and
    the default hook registered explicitly: fp32 parity to 1e-5, and the traffic goes where it should.
    The default hook registered explicitly and hpZ (alone, with accumulation, inside hybrid) are
    bitwise the run without them; hybrid is not bitwise the default (see below)."""
    modes = {
        "default": dict(),
        "accum": dict(micro=1, accum=2),
        "hook": dict(hook="reduce_scatter"),
        "hybrid": dict(shard_kw={"shard_group_size": 2}),
        "hpz": dict(shard_kw={"secondary_group_size": 2}),
        # the step's post-hook gathers layers 0 and 1 for the next forward; under no_grad too, they
        # keep their secondary slices, so their backward re-gathers stay inside the node
        "hpz+no_grad_step": dict(shard_kw={"secondary_group_size": 2}, no_grad_step=True),
        "hybrid+hpz": dict(shard_kw={"shard_group_size": 2, "secondary_group_size": 1}),
        # same global batch in two micro-batches: the secondary shards stay valid across them
        "hpz+accum": dict(shard_kw={"secondary_group_size": 2}, micro=1, accum=2),
        # shard groups of one rank (pure replication): the gradient slot itself is all-reduced
        "replicate+accum": dict(shard_kw={"shard_group_size": 1}, micro=1, accum=2),
    }
    scenarios = [scenario(family="qwen2", overrides=H44, steps=4, log_step=1, **kw) for kw in modes.values()]
    results = run_distributed(run_many, 4, scenarios)
    ref = run_reference({**scenarios[0], "world": 4})
    for name, res in zip(modes, results[0]):
        check_fp32(res, ref)
        assert res["plan"] == res["allocated"], name  # the memory plan covers the secondary shards too
        assert all(p == res["ptrs"][0] for p in res["ptrs"]), name
    for rank_results in results:
        run = dict(zip(modes, rank_results))
        # hpZ only changes where the backward re-gathers the weights from (a copy inside the node,
        # same bits), and the reductions are those of the run without it: losses, clipped norms,
        # first-step gradients and final parameters are bitwise the same.
        for mode, same_as in (("hook", "default"), ("hpz", "default"), ("hpz+accum", "accum"),
                              ("hybrid+hpz", "hybrid"), ("hpz+no_grad_step", "hpz")):
            diff = _bitwise_diff(run[mode], run[same_as])
            assert diff == [], (mode, same_as, diff)
        # Hybrid is NOT bitwise the default (nor is replication), so nothing bitwise is asserted:
        # its SUM over the 4 ranks is a reduce-scatter inside the shard group, then an all-reduce
        # across the replicas, (a + b) + (c + d), where the default sums the 4 ranks' chunks in
        # rank order; fp32 rounds differently (measured: first-step gradients up to ~1e-7 relative,
        # parameters after 4 steps ~7e-5 on the tiny k_proj.bias). check_fp32 holds both to 1e-5.
        hook, hybrid, hpz, both, hpz_accum, replicate = (run[k]["log"] for k in (
            "hook", "hybrid", "hpz", "hybrid+hpz", "hpz+accum", "replicate+accum"))
        # replication: the one-rank shard groups gather locally, the gradients are all-reduced
        assert {r[5] for r in replicate if r[1] in ("all_gather", "reduce_scatter")} == {"shard"}
        assert _bytes(replicate, op="all_reduce", group="replica") > _bytes(hybrid, op="all_reduce", group="replica")
        # hybrid: gathers and reduce-scatters stay in the shard group; shards are all-reduced across it
        assert {r[5] for r in hybrid if r[1] in ("all_gather", "reduce_scatter")} == {"shard"}
        assert _bytes(hybrid, op="all_reduce", group="replica") > 0
        assert _bytes(hook, op="all_reduce") == 0
        # hpZ: forward gathers over the whole group, every backward re-gather inside the node
        assert _bytes(hpz, "fwd", "all_gather", "world") > 0 and _bytes(hpz, "bwd", "all_gather", "world") == 0
        no_grad_step = run["hpz+no_grad_step"]["log"]
        assert _bytes(no_grad_step, "bwd", "all_gather", "world") == 0
        assert _bytes(no_grad_step, "bwd", "all_gather", "secondary") == _bytes(hpz, "bwd", "all_gather", "secondary")
        assert _bytes(hpz, "bwd", "all_gather", "secondary") > 0
        assert _bytes(hpz, "bwd", "all_gather", "secondary") == _bytes(hook, "bwd", "all_gather", "world")
        # with accumulation too, including the layers the second forward found still in their slots
        assert _bytes(hpz_accum, "bwd", "all_gather", "world") == 0
        assert _bytes(hpz_accum, "bwd", "all_gather", "secondary") == 2 * _bytes(hpz, "bwd", "all_gather", "secondary")
        # secondary group of one rank: the backward re-gather is a local copy through a 1-rank group
        assert _bytes(both, "bwd", "all_gather", "shard") == 0
    # replicas hold identical shards and all ranks end with the same model
    for res in results[1:]:
        for a, b in zip(results[0], res):
            assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])


def _bitwise_diff(a: dict, b: dict) -> list:
    """What differs bitwise between two runs: losses, norms, first-step gradients, final parameters."""
    diff = [k for k in ("losses", "norms") if a[k] != b[k]]
    diff += [f"grad {k}" for k in b["grads"][0] if not torch.equal(a["grads"][0][k], b["grads"][0][k])]
    return diff + [f"param {k}" for k in b["params"] if not torch.equal(a["params"][k], b["params"][k])]


def test_user_hooks_through_the_bucket_interface():
    """Hooks written by a user (tests/comm_hook_workers.py), with accumulation (2 backwards a step):
    a recording hook that delegates to reduce_scatter_hook sees, in every backward, buckets 0..n-1 in
    order, one per unit, the norm group last and only it flagged last, each in its documented slot
    with a buffer of shard_world x shard_numel elements; a hook returning a plain torch Future (from
    dist.all_to_all_single(..., async_op=True).get_future(), chained with .then) is accepted. Both
    train bitwise like the default hook. (gloo's reduce_scatter_tensor work has no get_future in
    torch 2.13: "Work::getFuture not implemented"; its all-to-all has one.)"""
    common = dict(steps=3, micro=1, accum=2, log_step=0)
    names = ["lm_head", "layer_3", "layer_2", "layer_1", "layer_0", "embed", "small"]
    slots = {"lm_head": "outer", "embed": "outer", "small": "small",
             **{f"layer_{i}": ("layer_even", "layer_odd")[i % 2] for i in range(4)}}
    results = run_distributed(run_hooked, 4, [scenario(**common), scenario(**common, hook="recording"),
                                              scenario(**common, hook="torch_future")])
    for rank_results in results:
        default, recording, torch_future = rank_results
        buckets = recording["buckets"]
        n = len(names)
        assert len(buckets) == 3 * 2 * n, [b["name"] for b in buckets]
        for first in range(0, len(buckets), n):  # one backward
            bwd = buckets[first:first + n]
            assert [b["index"] for b in bwd] == list(range(n))
            assert [b["last"] for b in bwd] == [False] * (n - 1) + [True] and bwd[-1]["name"] == "small"
            assert sorted(b["name"] for b in bwd) == sorted(names)  # every unit reduced exactly once
            assert all(b["slot"] == slots[b["name"]] for b in bwd), [(b["name"], b["slot"]) for b in bwd]
            assert all(b["numel"] == b["world"] * b["shard_numel"] and b["world"] == 4 for b in bwd)
        fut = torch_future["buckets"]
        assert len(fut) == 3 * 2 * n and all(b["future"] for b in fut)
        # the torch future reduced the gradients (the runtime's own reduce-scatter never ran) ...
        assert _bytes(default["log"], op="reduce_scatter") > 0 and _bytes(torch_future["log"], op="reduce_scatter") == 0
        # ... and, like the recording hook, bitwise as the default does
        for res in (recording, torch_future):
            diff = _bitwise_diff(res, default)
            assert diff == [], diff


def test_compression_and_noop_hooks():
    scenarios = [scenario(steps=3, hook="bf16_compress", log_step=0),
                 scenario(steps=3, hook="fp16_compress"),
                 scenario(steps=3, hook="noop", log_step=0)]
    results = run_distributed(run_many, 2, scenarios)
    ref = run_reference({**scenarios[0], "world": 2})
    for res, unit_roundoff in zip(results[0][:2], (2**-8, 2**-11)):
        # 16-bit wire: first-step gradients within the documented bound, (W + 1) unit roundoffs
        # of the format (bf16: 8 bits of mantissa, fp16: 11) at W = 2
        err, name = max_rel_err(res["grads"][0], ref["grads"][0])
        assert err < 3 * unit_roundoff, (name, err)
        assert loss_rel_err(res["losses"], ref["losses"]) < 1e-3
    bf16 = results[0][0]["log"]
    rs = [r for r in bf16 if r[1] == "reduce_scatter"]
    assert rs and all(r[4] == 2 * r[3] for r in rs)  # 2 bytes per element on the wire
    # noop: no gradient leaves a rank, so the gradients are not the global ones (as documented)
    noop = [r[2] for r in results]
    assert all(_bytes(r["log"], op="reduce_scatter") == 0 for r in noop)
    assert max_rel_err(noop[0]["grads"][0], ref["grads"][0])[0] > 0.05


def test_qwz_int8_weights_stay_within_quantization_error():
    scenarios = [scenario(steps=4, dtype="bf16", shard_kw={"quantized_weights": 8, "quant_block": 64}, log_step=0),
                 scenario(steps=4, dtype="bf16", log_step=0)]
    results = run_distributed(run_many, 2, scenarios)[0]
    qwz, plain = results
    assert qwz["plan"] == qwz["allocated"] and qwz["plan"] > plain["plan"]  # codes workspace planned
    ref = run_reference({**scenarios[0], "world": 2})
    assert loss_rel_err(qwz["losses"], ref["losses"]) < 2e-2
    assert rel_err(torch.tensor(qwz["losses"]), torch.tensor(plain["losses"])) < 2e-2
    assert qwz["losses"] != plain["losses"]  # genuinely quantized
    # weight gathers of layers move int8 codes + one fp32 scale per 64 elements: ~0.53 of bf16
    q = _bytes(qwz["log"], op="all_gather", unit_prefix="layer")
    p = _bytes(plain["log"], op="all_gather", unit_prefix="layer")
    assert 0.5 < q / p < 0.56, q / p
    # the norm group is never quantized
    assert _bytes(qwz["log"], op="all_gather", unit_prefix="small") == _bytes(plain["log"], op="all_gather",
                                                                               unit_prefix="small")


def test_qgz_hook_at_2_nodes_x_2_ranks():
    """Every bucket qgz_hook reduced in 3 steps, on every rank, is bitwise the one-process simulation
    of the qgZ steps (tests/quant_checks.py) of the 4 ranks' recorded gradient buffers: int8 rounds to
    nearest, int4 stochastically with the seeds the hook documents (mix_seed(seed, calls, rank), calls
    counting quantized reductions since the state was made). The norm group and units qgZ would not
    shrink take the exact reduce-scatter (bitwise its rank-order sum) and are named, with the reason,
    in QgzState.fallbacks: at hidden size 64 the norm group alone (with fp32 gradients and the
    default shard_align=16 no unit can fall back for size: a chunk of >= 16 elements takes >= 64
    bytes, more than packed); with bf16 gradients and a 1-layer model of hidden size 8 the norm group
    (24 elements, a 16-element chunk per rank: 32 bytes, as many as packed) would fall back for size
    too, and no other unit does."""
    ov = {"hidden_size": 64, "intermediate_size": 128}
    tiny = dict(steps=1, reduce_dtype="bf16",
                overrides={"hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1})
    cases = [(8, dict(steps=3, overrides=ov)), (4, dict(steps=3, overrides=ov)), (8, tiny)]
    buckets_per_backward = [4 + 3, 4 + 3, 1 + 3]  # layers, embed, lm_head, norm group
    scenarios = [scenario(**kw, hook="qgz", log_step=0, hook_kw={"ranks_per_node": 2, "bits": bits, "block": 64})
                 for bits, kw in cases]
    results = run_distributed(run_hooked, 4, scenarios)
    for i, (bits, kw) in enumerate(cases):
        ranks = [rank_results[i]["buckets"] for rank_results in results]
        names = [b["name"] for b in ranks[0]]
        assert len(names) == kw["steps"] * buckets_per_backward[i], names
        calls, fallbacks = 0, {}
        for k, name in enumerate(names):
            bs = [r[k] for r in ranks]
            assert all(b["name"] == name for b in bs), (k, [b["name"] for b in bs])
            fulls = [b["full"] for b in bs]
            c = fulls[0].numel() // 4
            exact = torch.stack([f.view(4, c) for f in fulls]).sum(0)  # chunk g of the SUM, rank order
            reason = comm_hooks.NORM_GROUP_EXACT if name == "small" else qgz_fallback_reason(
                fulls[0].numel(), 4, 2, dtype=fulls[0].dtype, bits=bits, block=64)
            if reason is not None:
                fallbacks[name] = reason
                expected = list(exact)  # the exact reduce-scatter: bitwise its rank-order sum
            elif bits == 8:
                expected = simulate_qgz(fulls, 2, 2, bits, 64, out_dtype=fulls[0].dtype)  # nearest rounding
            else:
                seeds = [mix_seed(0, calls, g) for g in range(4)]
                expected = simulate_qgz_seeded(fulls, 2, 2, bits, 64, [(mix_seed(s, 1), mix_seed(s, 3)) for s in seeds])
                calls += 1
            if reason is None:  # genuinely quantized: a hook that reduced exactly would not match
                assert any(not torch.equal(expected[g], exact[g]) for g in range(4)), (bits, k, name)
            for g, b in enumerate(bs):
                assert_bitwise(b["out"], expected[g], f"int{bits} case {i} bucket {k} ({name}) rank {g}")
                assert b["fallbacks"] == fallbacks, (k, name, b["fallbacks"])
        assert set(fallbacks) == {"small"}, fallbacks
    int8 = results[0][0]
    ref = run_reference({**scenarios[0], "world": 4})
    assert loss_rel_err(int8["losses"], ref["losses"]) < 1e-3
    log = int8["log"]
    assert _bytes(log, "bwd", "all_to_all", "node") > 0 and _bytes(log, "bwd", "all_to_all", "cross_node") > 0
    # no gradient goes through a plain reduce-scatter but the norm group's
    for log in (int8["log"], results[0][2]["log"]):
        assert _bytes(log, "bwd", "reduce_scatter") == _bytes(log, "bwd", "reduce_scatter", "world", "small") > 0


def test_paper_volume_table_cross_node_bytes():
    """ZeRO++'s volume table, per rank, in units of M (the layers' bytes in bf16), counted the paper's
    way (a collective moves the size of its full tensor): ZeRO-3 moves 3M across nodes (forward
    gather, backward gather, gradient reduce-scatter); qwZ halves the forward gather (int8 codes),
    hpZ keeps the backward gather inside the node, and qgZ's cross-node hop carries int4 codes of
    gradients already reduced inside the node: 1/4 (int4 vs bf16) / 2 (ranks per node) of M. The
    paper counts the gradient term at M/4 (one-hop all-to-all): 0.75M; ours is lower still."""
    base = dict(steps=1, dtype="bf16", reduce_dtype="bf16", log_step=0,
                overrides={"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 6})
    zpp = dict(base, shard_kw={"quantized_weights": 8, "secondary_group_size": 2, "quant_block": 256},
               hook="qgz", hook_kw={"ranks_per_node": 2, "bits": 4, "block": 256})
    res = run_distributed(run_many, 4, [scenario(**base), scenario(**zpp)])[0]
    z3, zp = res[0]["log"], res[1]["log"]

    def terms(log):
        fwd = _bytes(log, "fwd", "all_gather", "world", "layer")
        bwd = _bytes(log, "bwd", "all_gather", "world", "layer")
        grad = (_bytes(log, "bwd", "reduce_scatter", "world", "layer")
                + _bytes(log, "bwd", "all_to_all", "cross_node", "layer"))
        return fwd, bwd, grad

    (f0, b0, g0), (f1, b1, g1) = terms(z3), terms(zp)
    # M from the model: the layers' matrices in bf16 (1-D parameters belong to the norm group)
    layers = build(**base["overrides"]).model.layers
    m = 2 * sum(p.numel() for layer in layers for p in layer.parameters() if p.dim() >= 2)
    assert f0 == m, (f0, m)      # every layer gathered once in forward, in bf16, unpadded
    assert g0 == m, (g0, m)      # the gradient reduce-scatter moves M too
    # ZeRO-3 totals M + (L-2)/L M + M = 8/3 M for L = 6 layers, not the paper's 3M: the backward
    # re-gathers all but the last 2 layers of the forward, still in their slots (docs/benchmarks.md)
    assert Fraction(f0 + b0 + g0, m) == 1 + Fraction(6 - 2, 6) + 1, Fraction(f0 + b0 + g0, m)
    assert b1 == 0               # hpZ: no backward gather crosses a node
    assert 0.5 <= f1 / m < 0.51, f1 / m            # int8 + one fp32 scale per 256
    assert 0.125 <= g1 / m < 0.13, g1 / m          # int4 + scales, after the in-node reduction
    assert (f1 + b1 + g1) / m < 0.75


def test_groups_not_every_rank_belongs_to_before_shard():
    from comm_hook_workers import groups_before_shard

    results = run_distributed(groups_before_shard, 4)
    for res in results[1:]:
        assert all(torch.equal(res["grads"][k], v) for k, v in results[0]["grads"].items())
    for rank, res in enumerate(results):
        assert res["subgroups"] is not None, rank
        assert res["subgroups"].startswith("the ranks of the data-parallel group ") and \
            "belong to different numbers of process groups (rank " in res["subgroups"], res["subgroups"]


def test_hybrid_and_hpz_inside_a_data_parallel_subgroup():
    """Two data-parallel groups of one job, each sharding its own model: hybrid sharding and hpZ
    create their subgroups among each group's members (before, both groups' subgroups were named by
    one job-wide counter, so a subgroup of one group could rendezvous with the other's: a hang), and
    give the plain sharding's gradients, bitwise."""
    from comm_hook_workers import subgroup_grads

    modes = [{}] + [{"shard_group_size": 1}, {"secondary_group_size": 1}] * 3
    results = run_distributed(subgroup_grads, 4, modes, timeout=120)

    def same(a, b):
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    for rank, res in enumerate(results):
        assert all(same(res[0], res[i]) for i in range(1, len(modes))), rank
    assert same(results[0][0], results[2][0]) and same(results[1][0], results[3][0])  # one gradient per group
    assert not same(results[0][0], results[1][0])  # the groups had different data


def test_hook_values_strided_or_in_another_dtype_under_hybrid_sharding():
    """A hook's value is the replica group's input as it is: a strided one was all-reduced wrongly by
    gloo (gradients off by up to 100%), a bf16 one summed in bf16. Now both are summed dense, in
    reduce_dtype (fp32): strided gives the default's gradients bitwise; bf16 gives sums of bf16-rounded
    values that bf16 itself could not hold."""
    from comm_hook_workers import hybrid_hook_values

    for res in run_distributed(hybrid_hook_values, 2):
        for k, g in res["default"].items():
            assert torch.equal(res["strided"][k], g), k
            assert (res["bf16"][k] - g).norm() <= 2**-8 * g.norm(), k  # each term rounded to bf16 once
        # x 2 undoes the post-divide exactly: the replica sum, which a bf16 sum would leave on the bf16 grid
        assert any(not torch.equal(t * 2, (t * 2).bfloat16().float()) for t in res["bf16"].values())


@pytest.mark.parametrize("case", ["hook", "qgz_settings"])
def test_a_hook_that_differs_between_ranks_is_refused(case):
    from comm_hook_workers import mismatched_hooks

    assert run_distributed(mismatched_hooks, 2, case) == ["refused", "refused"]


def test_a_plain_future_is_bounded_by_collective_timeout():
    from comm_hook_workers import stalled_future

    for res in run_distributed(stalled_future, 1, timeout=60):
        assert res.startswith("raised after") and float(res.split()[2][:-1]) < 10, res


@pytest.mark.parametrize("order", ["register_then_load", "load_then_register"])
def test_stochastic_qgz_resumes_bitwise(tmp_path, order):
    """QgzState's rounding position travels in the checkpoint: a resumed int4 qgZ run draws what the
    uninterrupted one drew (before, the draws started over and the runs parted by ~3e-2), whether
    the hook is registered before load_checkpoint or after it (before, the state of a hook registered
    after the load was silently dropped)."""
    from comm_hook_workers import qgz_resume

    for same, position, warned in run_distributed(qgz_resume, 2, str(tmp_path / "ckpt"), order):
        assert same and position > 0 and not warned, (position, warned)


@pytest.mark.parametrize("order", ["never_registered", "stateless_hook"])
def test_a_checkpoints_hook_state_that_nothing_takes_is_warned_about(tmp_path, order):
    """A qgZ run resumed without its hook (the default hook reduces) or with a hook whose state cannot
    load the saved one: the run differs from the uninterrupted one, and rank 0 says why."""
    from comm_hook_workers import qgz_resume

    hits = []
    for rank, (same, _, warned) in enumerate(run_distributed(qgz_resume, 2, str(tmp_path / "ckpt"), order)):
        assert not same
        hits.append([w for w in warned if "comm hook state" in w or "stateful comm hook" in w])
    assert len(hits[0]) == 1 and hits[1] == [], hits
    assert ("no hook was registered" if order == "never_registered" else "has no load_state_dict") in hits[0][0]


def test_hpz_over_the_whole_shard_group_is_warned_about():
    """secondary_group_size equal to the shard group re-gathers over the same ranks: a no-op that
    costs a layer slice per rank. Rank 0 says so; a smaller secondary group is not warned about."""
    from comm_hook_workers import shard_warnings

    said = "secondary_group_size=2 (hpZ) equals the shard group's size"
    warned = run_distributed(shard_warnings, 2, {"secondary_group_size": 2})
    assert [sum(said in w for w in ws) for ws in warned] == [1, 0], warned
    assert all(w == [] for w in run_distributed(shard_warnings, 2, {"secondary_group_size": 1}))


def test_a_hook_mixing_scratch_dtypes_keeps_memory_fixed():
    """One workspace per name and dtype: the default hook's fp32 scratch and bf16 compression's
    under one hook no longer reallocate each other's buffer at every bucket."""
    from comm_hook_workers import mixed_hook_buffers

    for seen in run_distributed(mixed_hook_buffers, 3):
        assert all(ptrs == seen[0][0] and planned for ptrs, planned in seen)
        assert any("[bfloat16]" in k or "bfloat16" in k for k in seen[0][0])


def test_hybrid_from_a_device_mesh():
    """FSDP2-style HSDP: a (replicate, shard) DeviceMesh sets the groups. Rows of consecutive ranks
    train bitwise like shard_group_size=2; the transposed layout (shard groups [0 2] and [1 3],
    replicas [0 1] and [2 3]), with and without hpZ inside it, and a 1-D mesh match the reference;
    the collectives run on the mesh's groups."""
    modes = {
        "size": dict(shard_kw={"shard_group_size": 2}),
        "rows": dict(mesh=[[0, 1], [2, 3]]),
        "cols": dict(mesh=[[0, 2], [1, 3]]),
        "cols+hpz": dict(mesh=[[0, 2], [1, 3]], shard_kw={"secondary_group_size": 1}),
        "1d": dict(mesh=[[0, 1, 2, 3]]),
    }
    scenarios = [scenario(family="qwen2", overrides=H44, steps=3, log_step=1, **kw) for kw in modes.values()]
    results = run_distributed(run_many, 4, scenarios)
    ref = run_reference({**scenarios[0], "world": 4})
    for rank, rank_results in enumerate(results):
        r = dict(zip(modes, rank_results))
        for name, res in r.items():
            check_fp32(res, ref)
            assert res["plan"] == res["allocated"], name
        assert r["rows"]["losses"] == r["size"]["losses"] and r["rows"]["norms"] == r["size"]["norms"]
        assert all(torch.equal(r["rows"]["params"][k], r["size"]["params"][k]) for k in r["size"]["params"])
        assert r["rows"]["groups"] == r["size"]["groups"] == {
            "shard": [rank // 2 * 2, rank // 2 * 2 + 1], "replica": [rank % 2, rank % 2 + 2], "secondary": None}
        assert r["cols"]["groups"] == {"shard": [rank % 2, rank % 2 + 2], "replica": [rank // 2 * 2, rank // 2 * 2 + 1],
                                       "secondary": None}
        assert r["cols+hpz"]["groups"]["secondary"] == [rank]
        assert r["1d"]["groups"] == {"shard": [0, 1, 2, 3], "replica": None, "secondary": None}
        for name in ("rows", "cols", "cols+hpz"):  # gathers and reductions in the shard group, replicas all-reduce
            log = r[name]["log"]
            groups = {"shard", "secondary"} if name == "cols+hpz" else {"shard"}
            assert {x[5] for x in log if x[1] in ("all_gather", "reduce_scatter")} == groups, name
            assert _bytes(log, op="all_reduce", group="replica") > 0, name
        assert _bytes(r["cols+hpz"]["log"], "bwd", "all_gather", "shard") == 0  # hpZ: backward gathers stay home
    for res in results[1:]:  # every rank ends with the same model
        for a, b in zip(results[0], res):
            assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])


def test_200_step_convergence_of_every_mode():
    """A tiny model trained 200 steps on real text (bytes of a standard-library module): with qwZ
    int8, qgZ int8, the 16-bit hooks, qgZ int4 (four seeds: stochastic rounding makes each run one
    draw) and qwZ + hpZ + qgZ int4, the final loss (mean of the last 10 steps) ends within 1% of the
    exact path's. int4 uses QgzState's default block (64).

    lr is 1e-3, where the exact path's loss still falls steadily. At 3e-3 any gradient noise acted
    as damping of a too-large step: int8 with stochastic rounding (16x less error than int4) moved
    the final loss by -0.25% to -1.46% over four seeds, so a 1% bound could not tell a good
    compressor from a bad one. At 1e-3 int8 stochastic moves it by 0.01-0.25%, and int4's effect is
    systematic: +0.63% to +1.35% with block 256, -0.46% to +0.25% with block 64 (docs/benchmarks.md)."""
    common = dict(steps=200, micro=2, seq=32, lr=1e-3, text=True,
                  overrides={"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64, "vocab_size": 256})
    modes = [  # hybrid and hpZ are exact: they match the reference at every step (tests above)
        dict(),
        dict(shard_kw={"quantized_weights": 8, "quant_block": 256}),
        dict(hook="qgz", hook_kw={"ranks_per_node": 2, "bits": 8, "block": 256}),
        dict(hook="bf16_compress"), dict(hook="fp16_compress"),
        dict(shard_kw={"quantized_weights": 8, "quant_block": 256, "secondary_group_size": 2},
             hook="qgz", hook_kw={"ranks_per_node": 2, "bits": 4}),
    ] + [dict(hook="qgz", hook_kw={"ranks_per_node": 2, "bits": 4, "seed": seed}) for seed in range(4)]
    results = run_distributed(run_many, 4, [scenario(**common, **m) for m in modes], timeout=900)[0]
    final = [sum(r["losses"][-10:]) / 10 for r in results]
    assert final[0] < 0.7 * results[0]["losses"][0], "the default did not learn"
    signed = [(f - final[0]) / final[0] for f in final]
    print("distance from the default:", [f"{d:+.2%}" for d in signed])
    for m, d in zip(modes[1:], signed[1:]):
        assert abs(d) < 0.01, (m, d)


@pytest.mark.parametrize("case", ["twice", "default_then_other", "after_forward", "not_callable", "bad_return",
                                  "bad_size", "bad_2d", "bad_int", "qgz_unsharded", "qgz_other_model", "qgz_block0"])
def test_comm_hook_errors(case):
    assert run_distributed(_hook_error, 1, case)[0] == "ok"


def _hook_error(rank, world, case):
    import re

    import yashard
    from models import build
    from yashard import comm_hooks

    sm = yashard.shard(build())
    ids = torch.randint(0, 96, (2, 8))
    patterns = {
        "twice": (RuntimeError, r"a comm hook \(noop_hook\) is already registered; register one hook, once, "
                                r"before the first forward"),
        "after_forward": (RuntimeError, r"register_comm_hook must be called before the first forward"),
        "not_callable": (TypeError, r"register_comm_hook needs a callable hook\(state, bucket\), got int"),
        "bad_return": (TypeError, r"comm hook 'bad' returned Tensor for lm_head; a hook returns a future"),
        "default_then_other": (RuntimeError, r"a comm hook \(reduce_scatter_hook\) is already registered"),
        "bad_size": (ValueError, r"comm hook 'short' gave a \(3,\) torch.float32 tensor for \w+; its future must "
                                 r"hold this rank's shard of the SUM: a 1-D floating tensor of \d+ elements"),
        "bad_2d": (ValueError, r"comm hook 'two_d' gave a \(2, \d+\) torch.float32 tensor for \w+; .* a 1-D floating"),
        "bad_int": (ValueError, r"comm hook 'ints' gave a \(\d+,\) torch.int32 tensor for \w+; .* a 1-D floating"),
        "qgz_unsharded": (TypeError, r"QgzState needs the model yashard.shard returned, got a LlamaForCausalLM that "
                                     r"is not sharded"),
        "qgz_other_model": (ValueError, r"qgz_hook: this QgzState was built for another sharded model"),
        "qgz_block0": (ValueError, r"block must be an int in \[1, 32768\], got 0; the default is 64"),
    }
    exc, pattern = patterns[case]

    def bad(state, bucket):
        return bucket.output()

    def short(state, bucket):
        return comm_hooks._done(bucket.output()[:3])

    def two_d(state, bucket):
        return comm_hooks._done(bucket.buffer().view(2, -1))

    def ints(state, bucket):
        return comm_hooks._done(bucket.buffer().int())

    try:
        if case == "twice":
            sm.register_comm_hook(None, comm_hooks.noop_hook)
            sm.register_comm_hook(None, comm_hooks.noop_hook)
        elif case == "default_then_other":
            sm.register_comm_hook(None, comm_hooks.reduce_scatter_hook)
            sm.register_comm_hook(None, comm_hooks.noop_hook)
        elif case == "qgz_unsharded":
            comm_hooks.QgzState(build(), 1)
        elif case == "qgz_other_model":
            sm.register_comm_hook(comm_hooks.QgzState(yashard.shard(build()), 1, bits=8), comm_hooks.qgz_hook)
            sm(input_ids=ids, labels=ids).loss.backward()
        elif case == "qgz_block0":
            comm_hooks.QgzState(sm, 1, block=0)
        elif case in ("bad_2d", "bad_int"):
            sm.register_comm_hook(None, two_d if case == "bad_2d" else ints)
            sm(input_ids=ids, labels=ids).loss.backward()
        elif case == "after_forward":
            sm(input_ids=ids, labels=ids).loss.backward()
            sm.register_comm_hook(None, comm_hooks.noop_hook)
        elif case == "not_callable":
            sm.register_comm_hook(None, 3)
        else:
            sm.register_comm_hook(None, bad if case == "bad_return" else short)
            sm(input_ids=ids, labels=ids).loss.backward()
    except exc as e:
        assert re.search(pattern, str(e)), str(e)
        return "ok"
    return "no error"


def test_qgz_under_hybrid_sharding_and_qwz_with_fp32_weights():
    """Combinations: qgZ inside each shard group of a hybrid layout (world 4 = 2 shard groups of 2,
    with one and with two ranks per node), and qwZ gathering fp32 weights as int8 and int4."""
    ov = {"hidden_size": 64, "intermediate_size": 128}
    qgz = [scenario(steps=3, overrides=ov, hook="qgz", hook_kw={"ranks_per_node": rpn, "bits": 8, "block": 64},
                    shard_kw={"shard_group_size": 2}, log_step=0) for rpn in (1, 2)]
    qwz = [scenario(steps=3, overrides=ov, shard_kw={"quantized_weights": bits, "quant_block": 64}) for bits in (8, 4)]
    results = run_distributed(run_many, 4, qgz + qwz)[0]
    for s, res, group in zip(qgz, results, ("cross_node", "node")):
        assert loss_rel_err(res["losses"], run_reference({**s, "world": 4})["losses"]) < 1e-3
        bwd = {(r[1], r[5]) for r in res["log"] if r[0] == "bwd"}
        # the gradients travel by qgZ's all-to-all inside the shard group, then across the replicas;
        # the norm group's by the exact reduce-scatter
        assert bwd == {("all_gather", "shard"), ("all_to_all", group), ("reduce_scatter", "shard"),
                       ("all_reduce", "replica")}, bwd
        assert {r[2] for r in res["log"] if r[0] == "bwd" and r[1] == "reduce_scatter"} == {"small"}
    for s, res, bound in zip(qwz, results[2:], (1e-4, 1e-2)):
        err = loss_rel_err(res["losses"], run_reference({**s, "world": 4})["losses"])
        assert 1e-6 < err < bound, err  # quantized (not the exact trajectory), within its error
        assert res["plan"] == res["allocated"]


def test_qgz_int8_default_blocks_keep_small_gradients():
    """int8 rounds to nearest: an element below half its block's step (absmax / 254) becomes zero, so
    a parameter with small gradients that shares a block with large ones loses them. With 4096-element
    blocks the q/k projections of a tiny Llama at init came out with relative errors near 1; the
    default block (256) keeps every parameter within 3% (1.5% seen). The norm weights (the norm
    group's bucket, never quantized) are exact in every format: quantized, one block here spanned 8
    norm weights of different layers, and int4 put single ones 130% off."""
    from comm_hook_workers import qgz_tensor_errors

    default = run_distributed(qgz_tensor_errors, 4, 8, None)[0]
    assert max(default.values()) < 0.03, sorted(default.items(), key=lambda kv: -kv[1])[:3]
    wide = run_distributed(qgz_tensor_errors, 4, 8, 4096)[0]
    assert max(wide.values()) > 0.5, sorted(wide.items(), key=lambda kv: -kv[1])[:3]  # what the default avoids
    int4 = run_distributed(qgz_tensor_errors, 4, 4, None)[0]
    for errors in (default, wide, int4):
        norms = {k: v for k, v in errors.items() if k.endswith("norm.weight")}
        assert len(norms) == 2 * 3 + 1 and all(v == 0 for v in norms.values()), norms
    assert max(int4.values()) > 0, "int4 quantized nothing"


@pytest.mark.parametrize("world", [1, 2, 3])
def test_built_in_hooks_plan_their_scratch_before_step_one(world):
    """A hook's workspace_plan is allocated at register_comm_hook: the plan printed before step one
    is what every built-in hook holds after training (gloo at 3 ranks: the reduce-scatter's receive
    buffers, in the 16-bit dtype for the compression hooks; one rank: the output the compression
    hooks write). A hook without a plan gets its scratch at its first call; one that asks for more
    than it planned gets it with a warning."""
    from comm_hook_workers import planned_hook_memory

    for res in run_distributed(planned_hook_memory, world):
        for name, r in res.items():
            assert r["after"] == r["held"], name
            if name not in ("no_plan", "underplanned"):
                assert r["before"] == r["after"], (name, r)
            if name != "underplanned":  # (fp16 on the wire without a loss scaler is warned about: not scratch)
                assert not [w for w in r["warnings"] if "without yashard.ShardedGradScaler" not in w], (name, r["warnings"])
        for name in ("bf16_compress", "fp16_compress"):
            tag = name.split("_")[0].replace("bf16", "bfloat16").replace("fp16", "float16")
            assert f"comm hook {tag}_compress.in" in res[name]["rows"] and "reduce-scatter out" in res[name]["rows"]
            assert ((f"comm hook reduce_scatter" in res[name]["rows"]) == (world == 3)), res[name]["rows"]
        assert ("comm hook qgz" in res["qgz"]["rows"]) == (world > 1)
        assert ("comm hook reduce_scatter" in res["default"]["rows"]) == (world == 3)
        assert res["no_plan"]["after"] > res["no_plan"]["before"]  # its bf16 copies came at the first backward
        assert res["underplanned"]["after"] >= res["underplanned"]["before"] + 32
        assert "workspace 'unplanned' of 8 torch.float32, more than its workspace_plan said" in \
            " ".join(res["underplanned"]["warnings"])
