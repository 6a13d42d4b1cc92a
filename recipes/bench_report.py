"""Pure parts of the benchmark: statistics, least-squares fits, the ZeRO++ volume accounting and the
markdown tables (and the chart) built from the JSON results the benchmark workers write.

A run result (what ``benchmark.py --json`` writes) is a dict ``{"meta": {...}, "engines": [...],
"skipped": {name: reason}, "footer": [...]}``; each engine entry holds ``times`` (seconds, one list
per round-robin repeat, the slowest rank's time of each step), memory in bytes (``build_peak``,
``after_build``, ``train_peak``, ``end_drift``), ``first_loss`` / ``first_norm`` and ``comm``
(per-step ``count``, ``payload``, ``ring_sent``, ``by_kind``; see ``bench_comm``).
"""

from __future__ import annotations

import math
import statistics
from typing import Iterable, Sequence

MiB = 2**20


# ---------------------------------------------------------------------------------------- numbers
def _malloc_note(meta: dict) -> str:
    """The header's word on the CPU allocator setting (``--malloc``), empty for the default."""
    if meta.get("malloc") != "glibc":
        return ""
    return (" glibc's default malloc (--malloc glibc): freed blocks stay in the heap, so the RSS columns are NOT "
            "comparable between engines; times carry no page faults of fresh mmaps.")


def median_time(times: Sequence[Sequence[float]]) -> float:
    """Median over every timed step of every repeat (seconds)."""
    return statistics.median(t for block in times for t in block)


def repeat_spread(times: Sequence[Sequence[float]]) -> float:
    """(max - min) of the per-repeat medians over the overall median: how much the machine drifted
    between round-robin repeats (0 with a single repeat)."""
    per_repeat = [statistics.median(block) for block in times]
    return (max(per_repeat) - min(per_repeat)) / median_time(times)


def linear_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float]:
    """Least-squares ``y = a + b x``; returns ``(a, b, r2)``. ``r2`` is 1 - SS_res / SS_tot (1.0 when
    the ys are all equal and fitted exactly, nan with fewer than 2 distinct xs)."""
    n = len(xs)
    if n != len(ys) or n == 0:
        raise ValueError(f"linear_fit needs as many xs as ys (got {len(xs)} and {len(ys)}), at least one")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return my, float("nan"), float("nan")
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    a = my - b * mx
    ss_res = sum((y - a - b * x) ** 2 for x, y in zip(xs, ys))
    ss_tot = sum((y - my) ** 2 for y in ys)
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else float("nan"))
    return a, b, r2


def exposed_share(t_real: float, t_noop: float) -> float:
    """Share of a step that is exposed (not overlapped) communication: 1 - t(noop) / t(real)."""
    return 1.0 - t_noop / t_real


# ---------------------------------------------------------------------------------------- ZeRO++
# The paper's per-rank cross-node volume of one step, in M (the model's bytes in fp16/bf16), as
# (forward all-gather, backward all-gather, gradient reduce-scatter): ZeRO-3 3M, ZeRO++ 0.75M
# (ZeRO++, Wang et al. 2023). The paper states these two totals; single techniques get no number.
PAPER_TERMS = {
    "plain": (1.0, 1.0, 1.0),
    "qwZ+hpZ+qgZ": (0.5, 0.0, 0.25),
}
TERMS = ("fwd_gather", "bwd_gather", "gradient")
IN_NODE_GROUPS = {"secondary", "node"}  # at 2 nodes x 2 ranks: hpZ's secondary groups and qgZ's node groups


def volume_terms(records: Iterable[tuple], unit_prefix: str = "layer") -> dict[str, dict[str, int]]:
    """Bytes per term and group label from phased collective-log records
    ``(phase, op, unit, numel, nbytes, group)`` (phase "fwd" or "bwd"), counting the units whose
    name starts with ``unit_prefix``: ``fwd_gather`` = forward all-gathers, ``bwd_gather`` = backward
    all-gathers, ``gradient`` = backward reduce-scatters and all-to-alls (qgZ)."""
    out: dict[str, dict[str, int]] = {t: {} for t in TERMS}
    for phase, op, unit, _numel, nbytes, group in records:
        if not unit.startswith(unit_prefix):
            continue
        if op == "all_gather":
            term = "fwd_gather" if phase == "fwd" else "bwd_gather"
        elif op in ("reduce_scatter", "all_to_all") and phase == "bwd":
            term = "gradient"
        else:
            continue
        out[term][group] = out[term].get(group, 0) + nbytes
    return out


def cross_node(term: dict[str, int]) -> int:
    """Bytes of a term's groups that cross nodes (everything but the in-node groups)."""
    return sum(b for g, b in term.items() if g not in IN_NODE_GROUPS)


# ---------------------------------------------------------------------------------------- tables
def mib(b: float) -> str:
    return f"{b / MiB:.1f}"


def _engine_rows(run: dict) -> list[str]:
    meta = run["meta"]
    engines = run["engines"]
    medians = {e["name"]: median_time(e["times"]) for e in engines}
    rows = []
    for e in engines:
        med = medians[e["name"]]
        ratio = f"{med / medians['ddp']:.2f}x" if "ddp" in medians else "-"
        precision = e["precision"] + "".join(f"; {n}" for n in e["notes"])
        rows.append(
            f"| {e['name']} | {precision} | {med * 1e3:.1f} | {repeat_spread(e['times']):.0%} | {ratio} "
            f"| {meta['tokens'] / med:,.0f} | {mib(e['build_peak'])} | {mib(e['after_build'])} "
            f"| {mib(e['train_peak'])} | {mib(e['end_drift'])} "
            f"| {e['first_loss'] - meta['ref_loss']:+.2e} | {abs(e['first_norm'] - meta['ref_norm']) / meta['ref_norm']:.1e} |"
        )
    for name, why in run.get("skipped", {}).items():
        rows.append(f"| {name} | {why} | - | - | - | - | - | - | - | - | - | - |")
    return rows


def render_run(run: dict) -> str:
    """The markdown of one run: header, the per-engine table, the communication table, the
    headroom table (when the noop engines ran) and the footer notes."""
    meta = run["meta"]
    kind = meta["mem_kind"]
    lines = [
        f"## {meta['model']} Llama ({meta['n_params'] / 1e6:.2f}M params, {meta['layers']} layers, hidden "
        f"{meta['hidden']}), {meta['dtype']}, {meta['micro_batch']}x{meta['accum']} per rank, world {meta['world']} "
        f"({meta['backend']}, {meta['device']})",
        "",
        f"global batch {meta['global_batch']} x seq {meta['seq']} = {meta['tokens']} tokens/step (per rank "
        f"{meta['micro_batch']} x {meta['accum']} accum); AdamW ({meta.get('optimizer', 'adamw')}) lr {meta['lr']} wd {meta['wd']}, clip {meta['clip']}; "
        f"{meta['warmup']} warm-up, {meta['steps']} timed steps x {meta['repeats']} round-robin repeats; "
        f"torch {meta['torch']}, threads/rank {meta['threads']}. Reference: fp32 unsharded, loss "
        f"{meta['ref_loss']:.6f}, grad norm {meta['ref_norm']:.6f}. Memory: each engine's increment of process "
        f"{kind} (max over ranks)." + _malloc_note(meta),
        "",
        f"| engine | precision | step ms (median) | repeat spread | vs DDP | tokens/s | {kind} build peak MiB "
        f"| {kind} after build MiB | {kind} training peak MiB | end-of-step drift MiB | step-1 loss - ref "
        f"| step-1 grad-norm rel diff |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *_engine_rows(run),
        "",
        "Communication per optimizer step and rank (every engine counted the same way: a dispatch mode "
        "records each c10d collective with its tensors; payload = full tensor, ring estimate = bytes one "
        "rank sends with ring algorithms):",
        "",
        "| engine | collectives/step | payload MiB/step | ring-est. sent MiB/step | by kind (count x, MiB) |",
        "|---|---:|---:|---:|---|",
    ]
    for e in run["engines"]:
        c = e["comm"]
        kinds = ", ".join(f"{k} {n:g} x {b / MiB:.2f}" for k, (n, b) in c["by_kind"].items()) or "none"
        lines.append(f"| {e['name']} | {c['count']:g} | {c['payload'] / MiB:.2f} | {c['ring_sent'] / MiB:.2f} | {kinds} |")
    head = headroom_rows(run)
    if head:
        lines += ["", "Headroom (same engine without gradient communication; yashard-nocomm: without any):", "",
                  "| engine | step ms | with noop_hook ms | exposed gradient-communication share "
                  "| with no communication ms | exposed communication share |",
                  "|---|---:|---:|---:|---:|---:|", *head]
    over = plain_rows(run)
    if over:
        lines += ["", "Overhead against the unwrapped model trained on the same process (world 1):", "",
                  "| engine | step ms | plain ms | overhead |", "|---|---:|---:|---:|", *over]
    return "\n".join(lines + [""] + [f"* {f}" for f in run.get("footer", [])]) + "\n"


def plain_rows(run: dict) -> list[str]:
    """``| engine | t | t(plain) | t/t(plain) - 1 |`` for every engine but plain, when plain ran."""
    medians = {e["name"]: median_time(e["times"]) for e in run["engines"]}
    if "plain" not in medians:
        return []
    base = medians["plain"]
    return [f"| {n} | {t * 1e3:.1f} | {base * 1e3:.1f} | {t / base - 1:+.1%} |" for n, t in medians.items() if n != "plain"]


def headroom_rows(run: dict) -> list[str]:
    """``| engine | t | t(noop) | 1 - t(noop)/t | t(nocomm) | 1 - t(nocomm)/t |`` for each engine
    whose ``-noop`` or ``-nocomm`` twin ran ("-" where one did not)."""
    medians = {e["name"]: median_time(e["times"]) for e in run["engines"]}
    rows = []
    for name in ("yashard", "ddp"):
        if name not in medians:
            continue
        t, cells = medians[name], []
        for twin in ("noop", "nocomm"):
            t0 = medians.get(f"{name}-{twin}")
            cells += ["-", "-"] if t0 is None else [f"{t0 * 1e3:.1f}", f"{exposed_share(t, t0):.0%}"]
        if cells != ["-"] * 4:
            rows.append(f"| {name} | {t * 1e3:.1f} | " + " | ".join(cells) + " |")
    return rows


def config_label(meta: dict) -> str:
    return f"{meta['model']} {meta['dtype']} {meta['micro_batch']}x{meta['accum']}"


def render_matrix(runs: list[dict]) -> str:
    """One summary table (median step ms per engine per configuration, ratio to DDP) followed by
    every run's own tables."""
    names: list[str] = []
    for r in runs:
        for e in r["engines"]:
            if e["name"] not in names:
                names.append(e["name"])
    lines = ["# Benchmark matrix", "",
             "Median step time in ms (ratio to DDP) per configuration; `-`: not run (see the run's notes).", "",
             "| configuration | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for r in runs:
        med = {e["name"]: median_time(e["times"]) for e in r["engines"]}
        cells = []
        for n in names:
            if n not in med:
                cells.append("-")
            elif "ddp" in med:
                cells.append(f"{med[n] * 1e3:.0f} ({med[n] / med['ddp']:.2f}x)")
            else:
                cells.append(f"{med[n] * 1e3:.0f}")
        lines.append(f"| {config_label(r['meta'])} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\n" + "\n".join(render_run(r) for r in runs)


def plot_matrix(runs: list[dict], path: str) -> None:
    """A grouped bar chart of median step time per engine per configuration, written to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names: list[str] = []
    for r in runs:
        for e in r["engines"]:
            if e["name"] not in names:
                names.append(e["name"])
    labels = [config_label(r["meta"]) for r in runs]
    width = 0.8 / max(len(names), 1)
    fig, ax = plt.subplots(figsize=(max(8, 1.4 * len(runs)), 4.5))
    for i, n in enumerate(names):
        xs, ys = [], []
        for j, r in enumerate(runs):
            med = {e["name"]: median_time(e["times"]) for e in r["engines"]}
            if n in med:
                xs.append(j + (i - (len(names) - 1) / 2) * width)
                ys.append(med[n] * 1e3)
        ax.bar(xs, ys, width, label=n)
    ax.set_xticks(range(len(runs)), labels, rotation=20, ha="right")
    ax.set_ylabel("median step time (ms)")
    ax.set_yscale("log")
    meta = runs[0]["meta"] if runs else {}
    ax.set_title(f"step time per engine, world {meta.get('world', '?')} ({meta.get('backend', '?')}, "
                 f"{meta.get('device', '?')})")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _fmt_coef(v: float) -> str:
    return "nan" if math.isnan(v) else f"{v:.4g}"


def scaling_points(runs: list[dict], sweep: str) -> list[dict]:
    """Flat rows (one per run and engine) of a scaling sweep: layers, hidden, world, params, step
    seconds, steady and training-peak bytes, and yashard's planned bytes."""
    pts = []
    for r in runs:
        m = r["meta"]
        for e in r["engines"]:
            pts.append(dict(sweep=sweep, engine=e["name"], layers=m["layers"], hidden=m["hidden"], world=m["world"],
                            params=m["n_params"], step=median_time(e["times"]), steady=e["steady"],
                            peak=e["train_peak"], plan=e.get("plan_bytes", 0) + e.get("adamw_bytes", 0)))
    return pts


# sweep -> (x of a point, the model written in the table, the quantities fitted). Step time over
# world size is not fitted: with a fixed per-rank batch it depends on the interconnect and, on one
# CPU host, on how many cores the ranks share; the table lists it.
_QUANTITIES = {"step ms": ("step", 1e3), "steady MiB": ("steady", 1 / MiB), "training peak MiB": ("peak", 1 / MiB)}
SCALING_X = {
    "layers": (lambda p: p["layers"], "a + b * layers", ("step ms", "steady MiB", "training peak MiB")),
    "hidden": (lambda p: p["params"] / 1e6, "a + b * params[M]", ("step ms", "steady MiB", "training peak MiB")),
    "world": (lambda p: 1.0 / p["world"], "a + b / world", ("steady MiB", "training peak MiB")),
}


def render_scaling(points: list[dict]) -> str:
    """The scaling tables: every point, then per sweep, engine and quantity the least-squares fit
    (step ms over layers and parameters; steady and training-peak MiB over all three) with its
    coefficients and R^2."""
    lines = ["# Scaling", "",
             "| sweep | engine | layers | hidden | world | params M | step ms | steady MiB | training peak MiB "
             "| yashard plan + AdamW MiB |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in points:
        plan = mib(p["plan"]) if p["plan"] else "-"
        lines.append(f"| {p['sweep']} | {p['engine']} | {p['layers']} | {p['hidden']} | {p['world']} "
                     f"| {p['params'] / 1e6:.2f} | {p['step'] * 1e3:.1f} | {mib(p['steady'])} | {mib(p['peak'])} | {plan} |")
    lines += ["", "Least-squares fits (time in ms, memory in MiB):", "",
              "| sweep | engine | quantity | model | a | b | R^2 |", "|---|---|---|---|---:|---:|---:|"]
    for sweep, (xf, model, quantities) in SCALING_X.items():
        for engine in sorted({p["engine"] for p in points if p["sweep"] == sweep}):
            pts = [p for p in points if p["sweep"] == sweep and p["engine"] == engine]
            if len({xf(p) for p in pts}) < 2:
                continue
            xs = [xf(p) for p in pts]
            for q in quantities:
                key, scale = _QUANTITIES[q]
                a, b, r2 = linear_fit(xs, [p[key] * scale for p in pts])
                lines.append(f"| {sweep} | {engine} | {q} | {model} | {_fmt_coef(a)} | {_fmt_coef(b)} | {_fmt_coef(r2)} |")
    return "\n".join(lines) + "\n"


def render_volume(rows: list[dict], meta: dict) -> str:
    """The ZeRO++ volume table: per configuration, bytes per step and rank of the decoder layers'
    forward gathers, backward gathers and gradient reduction, by group, in units of M, next to the
    paper's cross-node numbers."""
    m = meta["M"]

    def cell(term: dict[str, int]) -> str:
        return ", ".join(f"{b / m:.3f} ({g})" for g, b in sorted(term.items())) or "0"

    lines = [
        f"# ZeRO++ communication volume, world {meta['world']} as {meta['world'] // meta['ranks_per_node']} nodes "
        f"x {meta['ranks_per_node']} ranks",
        "",
        f"{meta['model']} Llama, {meta['layers']} layers, bf16 params and gradients (reduce_dtype bf16); "
        f"M = the decoder layers' bytes in bf16 = {m / MiB:.2f} MiB. Per rank and optimizer step, counted the "
        f"paper's way (a collective counts the size of its full tensor); group labels from yashard's collective "
        f"log (world = all ranks, crosses nodes; secondary / node = inside a node; cross_node = one rank per node).",
        "",
        "| configuration | forward gather (M) | backward gather (M) | gradient (M) | cross-node total (M) "
        "| paper cross-node (M) | other units MiB | collectives/step |",
        "|---|---|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        t = r["terms"]
        total = sum(cross_node(t[k]) for k in TERMS) / m
        paper = PAPER_TERMS.get(r["name"])
        paper_s = f"{sum(paper):.2f} ({' + '.join(f'{x:g}' for x in paper)})" if paper else "-"
        lines.append(f"| {r['name']} | {cell(t['fwd_gather'])} | {cell(t['bwd_gather'])} | {cell(t['gradient'])} "
                     f"| {total:.3f} | {paper_s} | {mib(r['other_bytes'])} | {r['count']:g} |")
    return "\n".join(lines) + "\n"
