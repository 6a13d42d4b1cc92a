"""The benchmark harness's pure parts (recipes/bench_*.py) and its collective counter.

The benchmark itself is a script that prints tables (recipes/benchmark.py); nothing here times
anything. What is tested: the counter sees every engine's collectives with the right sizes (DDP's
C++ reducer included), the byte conventions, the least-squares fits, the ZeRO++ volume accounting,
the tables and the command-line errors.
"""

from __future__ import annotations

import math
import shutil
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes"))

import bench_comm as bc  # noqa: E402
import bench_engines as be  # noqa: E402
import bench_report as br  # noqa: E402
import benchmark  # noqa: E402
from harness import run_distributed  # noqa: E402


# ---------------------------------------------------------------------------------------- counting
def test_counter_sees_python_cpp_and_functional_collectives_with_their_sizes():
    world = 2
    calls = run_distributed(_counted, world)[0]
    kinds = [(c[0], c[2], c[3]) for c in calls]
    assert kinds == [
        ("all_reduce", 400, 2),
        ("all_gather", 240 * world, 2),
        ("reduce_scatter", 100 * world, 2),
        ("all_to_all", 32 * world, 2),
        ("broadcast", 14, 2),
        ("all_reduce", 440, 2),    # DDP's reducer: one bucket, weight + bias, issued from C++
        ("all_reduce", 40, 2),     # functional collective
    ], calls


def _counted(rank, world):
    import bench_workers

    return bench_workers.count_known_collectives(rank, world)


@pytest.mark.parametrize("op, kind", [
    ("c10d::allreduce_", "all_reduce"), ("c10d::_allgather_base_", "all_gather"),
    ("c10d::allgather_into_tensor_coalesced_", "all_gather"), ("c10d::reduce_scatter_tensor_coalesced_", "reduce_scatter"),
    ("_c10d_functional::reduce_scatter_tensor", "reduce_scatter"), ("c10d::alltoall_base_", "all_to_all"),
    ("c10d::broadcast_", "broadcast"), ("c10d::barrier", "barrier"), ("_c10d_functional::wait_tensor", None),
    ("aten::mm", None),
])
def test_collective_kind(op, kind):
    assert bc.collective_kind(op) == kind


def test_payload_is_the_full_tensor():
    # all-gather: the output; reduce-scatter and all-to-all: the input; all-reduce: the tensor(s)
    assert bc.payload_bytes("all_gather", {"output_tensor": 800, "input_tensor": 400}, 2) == 800
    assert bc.payload_bytes("all_gather", {"output_tensors": 800, "input_tensors": 400}, 2) == 800
    assert bc.payload_bytes("all_gather", {"input": 400}, 4) == 1600   # functional: no output argument
    assert bc.payload_bytes("reduce_scatter", {"output_tensor": 100, "input_tensor": 400}, 4) == 400
    assert bc.payload_bytes("all_to_all", {"output": 64, "input": 64}, 2) == 64
    assert bc.payload_bytes("all_reduce", {"tensors": 44}, 2) == 44
    assert bc.payload_bytes("barrier", {"tensor": 4}, 2) == 0


def test_ring_bytes_and_summary():
    assert bc.ring_bytes_sent("all_gather", 1000, 4) == 750
    assert bc.ring_bytes_sent("reduce_scatter", 1000, 2) == 500
    assert bc.ring_bytes_sent("all_reduce", 1000, 4) == 1500
    assert bc.ring_bytes_sent("all_reduce", 1000, 1) == 0
    assert bc.ring_bytes_sent("p2p", 1000, 2) == 1000
    calls = [bc.Call("all_gather", "x", 1000, 2), bc.Call("reduce_scatter", "x", 2000, 2),
             bc.Call("barrier", "x", 0, 2), bc.Call("all_gather", "x", 1000, 2)]
    s = bc.summarize(calls, 2)
    assert s == {"count": 1.5, "payload": 2000.0, "ring_sent": 1000.0,
                 "by_kind": {"all_gather": [1.0, 1000.0], "reduce_scatter": [0.5, 1000.0]}}
    log = [("all_gather", "layer_0", 250, 1000, "world"), ("reduce_scatter", "layer_0", 500, 2000, "world"),
           ("all_gather", "layer_1", 250, 1000, "world")]
    assert bc.summarize_log(log, 2, {"world": 2}) == {**s, "count": 1.5}



def test_log_and_counter_comparison_checks_bytes_and_lists_both_counts():
    log = bc.summarize([bc.Call("reduce_scatter", "x", 2_000_000, 2), bc.Call("all_gather", "x", 1_000_000, 2)], 1)
    swap = [bc.Call("p2p", "send", 1_000_000, 2), bc.Call("p2p", "recv_", 1_000_000, 2), bc.Call("all_gather", "x", 1_000_000, 2)]
    check = [bc.Call("all_gather", "x", 8, 2)]
    same = bc.compare_with_log(log, bc.summarize(swap + check, 1))
    assert "same bytes" in same and "log all_gather 1, reduce_scatter 1" in same
    assert "counter all_gather 2, p2p 2" in same
    assert bc.summarize(swap, 1)["ring_sent"] == 1_000_000 + 500_000  # the send, and the gather's half
    lost = bc.compare_with_log(log, bc.summarize(swap[1:], 1))
    assert "DIFFERENT BYTES" in lost
    # a 4-rank gloo all-gather of 4 x 1 MB: 3 sends and 3 receives of one shard; the log has one
    # all-gather of 4 MB. Payloads differ (6 MB against 4 MB), the bytes sent (3 MB) do not.
    log4 = bc.summarize([bc.Call("all_gather", "x", 4_000_000, 4)], 1)
    p2p4 = [bc.Call("p2p", op, 1_000_000, 4) for op in ("send", "recv_") * 3]
    four = bc.compare_with_log(log4, bc.summarize(p2p4, 1))
    assert "same bytes" in four and "log 3.81 MiB, counter 5.72 MiB" in four
    assert "DIFFERENT BYTES" in bc.compare_with_log(log4, bc.summarize(p2p4[:4], 1))

# ---------------------------------------------------------------------------------------- statistics
def test_linear_fit_recovers_a_line_and_scores_noise():
    a, b, r2 = br.linear_fit([2, 4, 8], [3 + 0.5 * x for x in (2, 4, 8)])
    assert (round(a, 12), round(b, 12), round(r2, 12)) == (3.0, 0.5, 1.0)
    a, b, r2 = br.linear_fit([1, 2, 3, 4], [1.0, 3.0, 2.0, 4.0])
    assert b == pytest.approx(0.8) and a == pytest.approx(0.5) and r2 == pytest.approx(0.64)
    a, b, r2 = br.linear_fit([1, 2], [5.0, 5.0])
    assert (a, b, r2) == (5.0, 0.0, 1.0)
    a, b, r2 = br.linear_fit([3, 3], [1.0, 2.0])
    assert a == 1.5 and math.isnan(b) and math.isnan(r2)
    with pytest.raises(ValueError, match="as many xs as ys"):
        br.linear_fit([1, 2], [1.0])


def test_medians_spread_and_headroom_share():
    times = [[1.0, 3.0, 2.0], [2.2, 2.2, 2.2]]
    assert br.median_time(times) == 2.2
    assert br.repeat_spread(times) == pytest.approx(0.2 / 2.2)
    assert br.exposed_share(2.0, 1.5) == 0.25


def test_plan_gap_note_flags_a_steady_increment_well_above_the_plan():
    mib = 2**20
    assert benchmark.plan_gap_note(46 * mib, 48 * mib) == ""  # within 4 MiB
    assert benchmark.plan_gap_note(800 * mib, 830 * mib) == ""  # within 5%
    note = benchmark.plan_gap_note(46 * mib, 63 * mib)
    assert "17.0 MiB above the plan" in note and "prime()" in note


# ---------------------------------------------------------------------------------------- ZeRO++ accounting
def test_volume_terms_split_by_phase_op_and_group():
    recs = [("fwd", "all_gather", "layer_0", 0, 100, "world"), ("fwd", "all_gather", "embed", 0, 50, "world"),
            ("bwd", "all_gather", "layer_0", 0, 100, "secondary"), ("bwd", "reduce_scatter", "layer_0", 0, 8, "shard"),
            ("bwd", "all_to_all", "layer_0", 0, 25, "node"), ("bwd", "all_to_all", "layer_0", 0, 13, "cross_node"),
            ("opt", "all_reduce", "small", 0, 4, "world")]
    t = br.volume_terms(recs)
    assert t == {"fwd_gather": {"world": 100}, "bwd_gather": {"secondary": 100},
                 "gradient": {"shard": 8, "node": 25, "cross_node": 13}}
    assert br.cross_node(t["gradient"]) == 21 and br.cross_node(t["bwd_gather"]) == 0
    assert sum(br.PAPER_TERMS["plain"]) == 3 and sum(br.PAPER_TERMS["qwZ+hpZ+qgZ"]) == 0.75


def test_render_volume_reports_units_of_m():
    rows = [dict(name="plain", terms={"fwd_gather": {"world": 200}, "bwd_gather": {"world": 100},
                                      "gradient": {"world": 200}}, other_bytes=0, count=3)]
    text = br.render_volume(rows, dict(model="small", layers=4, world=4, ranks_per_node=2, M=200))
    assert "| plain | 1.000 (world) | 0.500 (world) | 1.000 (world) | 2.500 | 3.00 (1 + 1 + 1) |" in text


# ---------------------------------------------------------------------------------------- tables
def _run(engines, skipped=None):
    meta = dict(model="small", layers=4, hidden=256, dtype="fp32", micro_batch=4, accum=1, world=2, backend="gloo",
                device="cpu", n_params=3_950_000, seq=256, global_batch=8, tokens=2048, lr=1e-3, wd=0.1, clip=1.0,
                warmup=1, steps=2, repeats=1, torch="x", threads=1, ref_loss=7.0, ref_norm=2.0, mem_kind="RSS")
    return dict(meta=meta, engines=engines, skipped=skipped or {}, footer=["a note"])


def _engine(name, t, **kw):
    comm = dict(count=3, payload=2**20, ring_sent=2**19, by_kind={"all_reduce": [3, 2**20]})
    return dict(dict(name=name, precision="fp32", notes=[], times=[[t, t]], build_peak=2**21, after_build=2**20,
                     steady=2**22, train_peak=2**23, end_drift=0, first_loss=7.0, first_norm=2.0, comm=comm), **kw)


def test_render_run_table_headroom_and_skipped_engines():
    text = br.render_run(_run([_engine("yashard", 1.0), _engine("ddp", 0.5), _engine("yashard-noop", 0.75)],
                              {"deepspeed": "not installed"}))
    assert "| yashard | fp32 | 1000.0 | 0% | 2.00x | 2,048 | 2.0 | 1.0 | 8.0 | 0.0 | +0.00e+00 | 0.0e+00 |" in text
    assert "| deepspeed | not installed |" in text
    assert "| yashard | 1000.0 | 750.0 | 25% | - | - |" in text and "| ddp | 500.0" not in text  # no ddp-noop ran
    text = br.render_run(_run([_engine("yashard", 1.0), _engine("yashard-nocomm", 0.6), _engine("ddp", 0.5),
                               _engine("ddp-noop", 0.45)]))
    assert "| yashard | 1000.0 | - | - | 600.0 | 40% |" in text and "| ddp | 500.0 | 450.0 | 10% | - | - |" in text
    assert "| ddp | 3 | 1.00 | 0.50 | all_reduce 3 x 1.00 |" in text
    assert "* a note" in text
    assert "NOT comparable" not in text  # the default allocator setting needs no warning


def test_glibc_malloc_run_says_its_memory_columns_do_not_compare():
    assert benchmark.parse_args([]).malloc == "returning"
    args = benchmark.parse_args(["--malloc", "glibc"])
    assert args.malloc == "glibc" and benchmark._common(args)[-2:] == ["--malloc", "glibc"]  # sweeps pass it on
    run = _run([_engine("yashard", 1.0)])
    run["meta"]["malloc"] = "glibc"
    assert "the RSS columns are NOT comparable between engines" in br.render_run(run)


def test_render_matrix_and_chart(tmp_path):
    runs = [_run([_engine("yashard", 1.0), _engine("ddp", 0.5)]), _run([_engine("ddp", 0.25)])]
    text = br.render_matrix(runs)
    assert "| small fp32 4x1 | 1000 (2.00x) | 500 (1.00x) |" in text and "| small fp32 4x1 | - | 250 (1.00x) |" in text
    br.plot_matrix(runs, str(tmp_path / "m.png"))
    assert (tmp_path / "m.png").read_bytes()[:4] == b"\x89PNG"


def test_scaling_fits_recover_the_generating_coefficients():
    runs = []
    for w in (1, 2, 4):
        r = _run([_engine("yashard", 0.1 * w, steady=(10 + 40 / w) * br.MiB, train_peak=(20 + 40 / w) * br.MiB)])
        r["meta"]["world"] = w
        runs.append(r)
    text = br.render_scaling(br.scaling_points(runs, "world"))
    assert "| world | yashard | steady MiB | a + b / world | 10 | 40 | 1 |" in text
    assert "| world | yashard | training peak MiB | a + b / world | 20 | 40 | 1 |" in text


# ---------------------------------------------------------------------------------------- setup
def test_model_shapes_and_sizes():
    def params(shape):
        with torch.device("meta"):
            return sum(p.numel() for p in be.build_model(shape, 0).parameters())

    assert params(be.model_shape("small")) == pytest.approx(3.95e6, rel=0.01)
    assert params(be.model_shape("wide")) == pytest.approx(67.1e6, rel=0.01)
    s = be.model_shape("small", layers=8, hidden=512)
    assert (s["num_hidden_layers"], s["hidden_size"], s["intermediate_size"]) == (8, 512, 1376)
    with pytest.raises(ValueError, match=r"--hidden 100 must be a positive multiple of 16"):
        be.model_shape("small", hidden=100)


def test_deepspeed_config_matches_the_other_engines():
    class A:
        micro_batch, accum, dtype = 2, 2, "bf16"

    cfg = be.deepspeed_config(A, 2)
    assert cfg["train_batch_size"] == 8 and cfg["gradient_accumulation_steps"] == 2
    assert cfg["gradient_clipping"] == be.CLIP and cfg["zero_optimization"]["stage"] == 3
    assert cfg["bf16"] == {"enabled": True} and cfg["communication_data_type"] == "fp32"
    A.dtype = "fp32"
    assert "bf16" not in be.deepspeed_config(A, 2)


def test_deepspeed_missing_is_reported_not_raised(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert be.deepspeed_missing() == "not installed"


@pytest.mark.parametrize("argv, message", [
    (["--engines", "ddp,megatron"], r"--engines: unknown \['megatron'\]"),
    (["--warmup", "0"], r"--warmup must be >= 1"),
    (["--accum", "0"], r"must be >= 1"),
    (["--sweep", "all", "--zeropp"], r"--sweep \(the driver\) and --zeropp \(a worker\) exclude each other"),
    (["--hidden", "100"], r"--hidden 100 must be a positive multiple of 16"),
    (["--scaling-worlds", "1,x"], r"expected a comma list of integers"),
    (["--scaling-engines", "yashard,zero9"], r"--scaling-engines: unknown \['zero9'\]"),
    (["--dtypes", "fp32,fp8"], r"--dtypes: unknown \['fp8'\]"),
])
def test_cli_errors(argv, message, capsys):
    with pytest.raises(SystemExit):
        benchmark.parse_args(argv)
    assert __import__("re").search(message, capsys.readouterr().err)



# ---------------------------------------------------------------------------------------- world 1
def test_render_overhead_against_plain():
    text = br.render_run(_run([_engine("plain", 0.5), _engine("yashard", 0.52), _engine("ddp", 0.55)]))
    assert "| yashard | 520.0 | 500.0 | +4.0% |" in text and "| ddp | 550.0 | 500.0 | +10.0% |" in text
    assert "| plain | 500.0 | 500.0 |" not in text
    assert "Overhead against" not in br.render_run(_run([_engine("yashard", 1.0)]))
    assert "plain" not in benchmark.parse_args([]).engines  # the default list leaves it out (world 1 only)


def _bench(nproc: int, *args: str) -> str:
    import os
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                           "--master_port", str(port), str(ROOT / "recipes" / "benchmark.py"), "--model", "small",
                           "--layers", "2", "--hidden", "64", "--steps", "1", "--warmup", "1", "--repeats", "1", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_plain_engine_at_world_1_and_its_error_beyond():
    """At world 1 the plain engine (the unwrapped model) is the baseline of an overhead table and
    matches the fp32 reference exactly; at world 2 it is reported as not run, with the fix."""
    import re

    out = _bench(1, "--engines", "plain,yashard")
    assert re.search(r"\| plain \| fp32 \| [\d.]+ \| 0% \| - \| [\d,]+ \|.*\| \+0\.00e\+00 \| 0\.0e\+00 \|", out), out
    assert re.search(r"\| yashard \| [\d.]+ \| [\d.]+ \| [+-][\d.]+% \|", out), out
    out = _bench(2, "--engines", "plain,ddp")
    assert ("| plain | not run: ValueError: the plain engine trains the unwrapped model on one process, but the "
            "world has 2 ranks: run it with torchrun --nproc_per_node 1 |") in out, out


def test_nocomm_engine_communicates_no_weights_or_gradients():
    """yashard-nocomm (headroom of all communication) dispatches no collective but the step's
    small all-reduce, still trains (a finite loss), and gets its column in the headroom table; it is
    asked for by name only."""
    import re

    assert "yashard-nocomm" not in benchmark.parse_args([]).engines
    out = _bench(2, "--engines", "yashard,yashard-nocomm")
    assert re.search(r"\| yashard-nocomm \| 1 \| 0\.00 \| 0\.00 \| all_reduce 1 x 0\.00 \|", out), out
    row = next(line for line in out.splitlines() if line.startswith("| yashard-nocomm | fp32"))
    assert "all-gathers that copy the own shard only" in row and math.isfinite(float(row.split("|")[-3])), row
    assert re.search(r"\| yashard \| [\d.]+ \| - \| - \| [\d.]+ \| -?\d+% \|", out), out


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="inductor on CPU needs a C++ compiler")
def test_compile_puts_every_engines_layers_under_torch_compile():
    """--compile: every engine's decoder layers run compiled (its note says so) and still match the
    reference at step 1; DeepSpeed, which compiles its own way, is reported as not run."""
    import re

    out = _bench(2, "--engines", "yashard,ddp,deepspeed", "--compile")
    for name in ("yashard", "ddp"):
        row = next(line for line in out.splitlines() if line.startswith(f"| {name} |"))
        assert "decoder layers under torch.compile (inductor)" in row, row
        loss_diff = float(row.split("|")[-3])
        assert abs(loss_diff) < 1e-4, row
    assert re.search(r"\| deepspeed \| (not run: --compile: DeepSpeed ZeRO-3 compiles through "
                     r"engine\.compile\(\)|.*not installed)", out), out


def test_every_engine_gets_the_optimizer_asked_for():
    from types import SimpleNamespace

    p = [torch.nn.Parameter(torch.zeros(4, 4))]
    assert be.make_adamw(p, SimpleNamespace()).defaults["fused"] is None  # torch's default implementation
    assert be.make_adamw(p, SimpleNamespace(optimizer="adamw-fused")).defaults["fused"] is True
    assert be.make_adamw(p, SimpleNamespace(optimizer="adamw-foreach")).defaults["foreach"] is True
    with pytest.raises(ValueError, match=r"unknown optimizer 'sgd'; choose from adamw, adamw-foreach, adamw-fused"):
        be.make_adamw(p, SimpleNamespace(optimizer="sgd"))
    args = benchmark.parse_args(["--optimizer", "adamw-fused"])
    assert benchmark._common(args)[-4:-2] == ["--optimizer", "adamw-fused"]  # the sweeps pass it on


# ---------------------------------------------------------------------------------- host overhead
def test_host_overhead_fit_recovers_a_line():
    import host_overhead
    a, b = host_overhead.fit([4, 8, 16], [1.0 + 0.25 * x for x in (4, 8, 16)])
    assert a == pytest.approx(1.0) and b == pytest.approx(0.25)
    assert host_overhead.fit([8], [3.0]) == (3.0, 0.0)


def test_host_overhead_prints_both_engines_and_counts_each_hook_once_per_unit():
    """A short run of recipes/host_overhead.py on one process: the table has a row per layer count,
    and the breakdown counts the hooks per step as the runtime calls them (one pre-forward per
    embedding, layer and head; one reduction per unit, the norm group's included)."""
    import os
    import subprocess
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, "host_overhead.py", "--layers", "1,2", "--steps", "2", "--repeats", "1",
                           "--breakdown"], cwd=ROOT / "recipes", env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line for line in proc.stdout.splitlines() if line.startswith("| ")}
    assert {"1", "2"} <= rows.keys() and "fitted overhead:" in proc.stdout
    calls = {k: float(v.split("|")[3]) for k, v in rows.items() if "." in k}
    assert calls["ForwardSchedule.pre_forward"] == 2 + 2  # embedding, 2 layers, head
    assert calls["BackwardSchedule.on_unit_grads_complete"] == 2 + 3  # ... and the norm group
    assert calls["Runtime.clip_grad_norm_"] == 1 and calls["guards.step_checks"] == 1
