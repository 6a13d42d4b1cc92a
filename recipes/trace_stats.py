"""Summaries of a torch.profiler Chrome trace: compute, communication, exposed communication, memory.

Pure functions over the exported trace (the JSON that Perfetto / chrome://tracing opens), so the
numbers in the summary are exactly what the trace shows. Used by recipes/profiling.py.

Every quantity is a length of a union of time intervals, clipped to the *step window*: the union
of the ``ProfilerStep#N`` ranges on the training thread (the profiler's active steps).

On CUDA (the trace holds GPU kernels):
  communication  union of NCCL kernel intervals (kernel name contains "nccl"), any stream.
  compute        union of every other GPU kernel, memcpy and memset interval, any stream.
  exposed comm   communication minus compute: time an NCCL kernel runs while no compute kernel does.

On CPU with gloo (no kernels):
  communication  union of the ``gloo:*`` ranges on any thread: collectives run on gloo's worker
                 threads, and the point-to-point sends and receives yashard's all-gathers (and
                 two-rank reduce-scatters) are made of are ranges on the training thread that last
                 until the message has gone; either way the time a transfer is in flight, including
                 the time it waits for the slowest rank.
  compute        union of the training thread's operator ranges (``cpu_op``), minus the time that
                 thread spends in communication: inside ``c10d::*`` ops (issuing a collective) and
                 in the runtime's issue/wait labels (``yashard::all_gather (UNIT)``,
                 ``yashard::reduce_scatter (UNIT)``, ``yashard::wait_collective``), where a
                 ``yashard::post_divide (UNIT)`` nested in a wait counts back as compute. Python time
                 between operators is neither.
  exposed comm   communication minus compute: time a collective is in flight while the training
                 thread computes nothing (blocked in a wait, issuing, or between operators).

Both: ``0 <= exposed <= communication <= wall`` and ``compute + exposed <= wall``, by construction.
Memory peak: the largest "Total Allocated" of the trace's ``[memory]`` events for the device
(CUDA: the caching allocator's allocated bytes; CPU: bytes the CPU allocator handed out since the
profiler started, so memory allocated before it is not counted), which the profiler records when
``profile_memory=True``.
"""

from __future__ import annotations

import json
from pathlib import Path

Interval = tuple[float, float]

# Labels the runtime puts around its communication on the training thread (issue and host waits).
# A per-unit label names its unit after the stage, as FSDP2's do (``yashard::all_gather
# (model.layers.3)``, ``yashard::reduce_scatter (norm group)``): these are the stages (:func:`stage`).
RUNTIME_COMM_LABELS = ("yashard::all_gather", "yashard::reduce_scatter", "yashard::wait_collective")
# Stages reported in the per-stage table, in loop order (recipe labels, then runtime labels); a
# runtime stage sums its labels over every unit.
STAGE_LABELS = (
    "yashard::data", "yashard::forward", "yashard::backward", "yashard::clip_grad_norm",
    "yashard::optimizer_step", "yashard::loss_all_reduce",
    "yashard::all_gather", "yashard::reduce_scatter", "yashard::post_divide", "yashard::wait_collective",
    "yashard::drain",
)
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


# --------------------------------------------------------------------------------------------
# Interval arithmetic (half-open [start, end) intervals, in microseconds)
# --------------------------------------------------------------------------------------------


def union(intervals) -> list[Interval]:
    """Sorted, disjoint intervals covering exactly the union of ``intervals`` (empty ones dropped)."""
    out: list[list[float]] = []
    for start, end in sorted((s, e) for s, e in intervals if e > s):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(s, e) for s, e in out]


def length(intervals) -> float:
    """Total length of the union of ``intervals``."""
    return sum(e - s for s, e in union(intervals))


def intersect(a, b) -> list[Interval]:
    """The union of ``a`` intersected with the union of ``b``."""
    a, b = union(a), union(b)
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if end > start:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a, b) -> list[Interval]:
    """The union of ``a`` with the union of ``b`` removed."""
    out = []
    b = union(b)
    for start, end in union(a):
        cursor = start
        for bs, be in b:
            if be <= cursor or bs >= end:
                continue
            if bs > cursor:
                out.append((cursor, bs))
            cursor = max(cursor, be)
            if cursor >= end:
                break
        if cursor < end:
            out.append((cursor, end))
    return out


# --------------------------------------------------------------------------------------------
# Trace summary
# --------------------------------------------------------------------------------------------


def _span(e: dict) -> Interval:
    return (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))


def stage(name: str) -> str:
    """The stage of a range's name: the name without the unit a runtime label names
    (``yashard::all_gather (model.layers.3)`` -> ``yashard::all_gather``)."""
    return name.split(" (", 1)[0] if name.startswith("yashard::") else name


def summarize_trace(trace: dict) -> dict:
    """Per-step times (ms), memory peak (MB) and the basis ("cuda" or "cpu") of one rank's trace.

    ``trace`` is a Chrome trace as exported by ``torch.profiler.profile.export_chrome_trace``; it
    must hold at least one ``ProfilerStep#N`` range (the profiler ran with a schedule and
    ``prof.step()`` was called). See the module docstring for the definitions.
    """
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    # Host ranges only: on CUDA the profiler mirrors labels onto the GPU timeline (gpu_user_annotation).
    steps = [e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")
             and not str(e.get("cat", "")).startswith("gpu_")]
    if not steps:
        raise ValueError("the trace has no ProfilerStep# ranges: profile with a schedule and call prof.step() each step")
    main = (steps[0]["pid"], steps[0]["tid"])  # the training thread
    window = union(_span(e) for e in steps)
    wall = length(window)

    def on_main(e):
        return (e["pid"], e["tid"]) == main

    gpu = [e for e in events if e.get("cat") in GPU_CATEGORIES]
    if any(e.get("cat") == "kernel" for e in gpu):
        basis = "cuda"
        comm = intersect([_span(e) for e in gpu if "nccl" in e["name"].lower()], window)
        compute = intersect([_span(e) for e in gpu if "nccl" not in e["name"].lower()], window)
    else:
        basis = "cpu"
        comm = intersect([_span(e) for e in events if e["name"].startswith("gloo:")], window)
        ops = [e for e in events if on_main(e) and e.get("cat") == "cpu_op"]
        host_comm = subtract(
            [_span(e) for e in ops if e["name"].startswith("c10d::")]
            + [_span(e) for e in events if on_main(e) and stage(e["name"]) in RUNTIME_COMM_LABELS],
            [_span(e) for e in events if on_main(e) and stage(e["name"]) == "yashard::post_divide"],
        )
        compute = intersect(subtract([_span(e) for e in ops if not e["name"].startswith("c10d::")], host_comm), window)
    exposed = subtract(comm, compute)

    device_type = 1 if basis == "cuda" else 0  # the profiler's c10 DeviceType: 0 CPU, 1 CUDA
    allocated = [e["args"]["Total Allocated"] for e in trace.get("traceEvents", [])
                 if e.get("name") == "[memory]" and e.get("args", {}).get("Device Type") == device_type
                 and "Total Allocated" in e["args"]]

    n = len(steps)
    spans: dict[str, list[Interval]] = {label: [] for label in STAGE_LABELS}
    for e in events:
        if on_main(e) and e["name"].startswith("yashard::") and stage(e["name"]) in spans:
            spans[stage(e["name"])].append(_span(e))
    stage_us = {label: length(intersect(spans[label], window)) for label in STAGE_LABELS}
    return {
        "basis": basis,
        "steps": n,
        "wall_ms": wall / n / 1e3,
        "compute_ms": length(compute) / n / 1e3,
        "comm_ms": length(comm) / n / 1e3,
        "exposed_comm_ms": length(exposed) / n / 1e3,
        "memory_peak_mb": max(allocated) / 2**20 if allocated else None,
        "stages_ms": {k: v / n / 1e3 for k, v in stage_us.items()},
    }


def summarize_trace_file(path: str | Path) -> dict:
    """:func:`summarize_trace` of a trace JSON file."""
    with open(path) as f:
        return summarize_trace(json.load(f))


# --------------------------------------------------------------------------------------------
# Table
# --------------------------------------------------------------------------------------------

FOOTNOTES = {
    "cuda": [
        "wall: the profiled steps (ProfilerStep# ranges on the training thread), per step.",
        "compute: union of non-NCCL GPU kernels, memcpys and memsets (any stream) inside the steps.",
        "comm: union of NCCL kernels (any stream) inside the steps.",
        "exposed: comm time during which no compute kernel runs.",
        "peak: largest 'Total Allocated' of the trace's CUDA [memory] events (caching allocator).",
    ],
    "cpu": [
        "wall: the profiled steps (ProfilerStep# ranges on the training thread), per step.",
        "compute: union of the training thread's operators, minus its time issuing collectives",
        "  (c10d::*, yashard::all_gather (UNIT), yashard::reduce_scatter (UNIT)) and waiting for them",
        "  (yashard::wait_collective; the yashard::post_divide (UNIT) inside a wait counts as compute).",
        "comm: union of gloo:* ranges, on gloo's threads and the training thread's sends/receives (in flight, peer waits included).",
        "exposed: comm time during which the training thread runs no compute operator.",
        "peak: largest 'Total Allocated' of the trace's CPU [memory] events (CPU allocator, counted from the "
        "profiler's start: memory held before it is not in it).",
    ],
}


def format_table(summaries: list[dict]) -> str:
    """A per-rank table (ms per step) with mean and max rows, a per-stage table and footnotes."""
    if not summaries:
        raise ValueError("no summaries to format")
    cols = [("wall", "wall_ms"), ("compute", "compute_ms"), ("comm", "comm_ms"), ("exposed", "exposed_comm_ms")]
    head = f"{'rank':>6} {'steps':>5} " + " ".join(f"{c:>9}" for c, _ in cols) + f" {'exposed%':>8} {'peak MB':>8}"
    lines = ["time per step (ms) and memory, per rank", head, "-" * len(head)]

    def pct(s):
        return 100 * s["exposed_comm_ms"] / s["wall_ms"] if s["wall_ms"] else 0.0

    def row(name, s):
        mem = f"{s['memory_peak_mb']:8.1f}" if s.get("memory_peak_mb") is not None else f"{'-':>8}"
        return (f"{name:>6} {s['steps']:>5} " + " ".join(f"{s[k]:9.2f}" for _, k in cols)
                + f" {s['exposed_pct']:8.1f} {mem}")

    for r, s in enumerate(summaries):
        lines.append(row(str(r), {**s, "exposed_pct": pct(s)}))
    if len(summaries) > 1:
        for name, agg in (("mean", lambda xs: sum(xs) / len(xs)), ("max", max)):
            merged = {k: agg([s[k] for s in summaries]) for _, k in cols}
            merged["exposed_pct"] = agg([pct(s) for s in summaries])
            merged["steps"] = summaries[0]["steps"]
            mems = [s["memory_peak_mb"] for s in summaries if s.get("memory_peak_mb") is not None]
            merged["memory_peak_mb"] = agg(mems) if mems else None
            lines.append(row(name, merged))

    lines += ["", "host time per step (ms) in each labelled range, training thread"]
    lines.append(f"{'range':<36}" + "".join(f"{'rank ' + str(r):>10}" for r in range(len(summaries))))
    for label in STAGE_LABELS:
        lines.append(f"{label:<36}" + "".join(f"{s['stages_ms'][label]:10.2f}" for s in summaries))

    basis = summaries[0]["basis"]
    lines += ["", f"definitions ({basis}):"] + [f"  {t}" for t in FOOTNOTES[basis]]
    return "\n".join(lines)
