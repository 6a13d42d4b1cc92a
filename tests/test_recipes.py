"""The recipes end to end (pretrain, fine-tune, profile: 2 processes, CPU, gloo) and their pure parts.

Each recipe runs once per module (torchrun in a subprocess, a few steps of a tiny model); several
tests read the outputs of one run. The pretrain run's checkpoint is the fine-tune run's --model.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes"))

import data  # noqa: E402
import finetune  # noqa: E402
import pretrain  # noqa: E402
import profiling  # noqa: E402
import trace_stats as ts  # noqa: E402
import train  # noqa: E402

# A tiny Llama with tied embeddings and a vocabulary larger than the byte tokenizer's 259 ids.
TINY_CONFIG = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 64,
    "intermediate_size": 160, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 256, "tie_word_embeddings": True,
    "bos_token_id": 257, "eos_token_id": 258, "pad_token_id": 256,
}
COMMON = ["--seq-len", "64", "--max-bytes", "300000", "--micro-batch", "4"]
# pretraining accumulates two micro-batches per step: accumulation runs end to end in a recipe
PRETRAIN_ARGS = [*COMMON, "--accum-steps", "2"]
PRETRAIN_STEPS, SFT_STEPS = 16, 10


# --------------------------------------------------------------------------------------------
# Running a recipe
# --------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(script: Path, args, env_extra=None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(_free_port()), str(script), *args]
    pythonpath = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(pythonpath), "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def run_recipe(script: str, *args: str, stderr_to: Path | None = None) -> str:
    """torchrun --nproc_per_node 2 recipes/<script> args...; returns stdout (stderr goes to
    ``stderr_to`` when given), fails with its output."""
    proc = _torchrun(ROOT / "recipes" / script, args)
    assert proc.returncode == 0, f"{script} {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    if stderr_to is not None:
        stderr_to.write_text(proc.stderr)
    return proc.stdout


def read_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def pretrain_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pretrain")
    (tmp / "config.json").write_text(json.dumps(TINY_CONFIG))
    out = tmp / "out"
    stdout = run_recipe("pretrain.py", "--config", str(tmp / "config.json"), "--steps", str(PRETRAIN_STEPS),
                        "--eval-every", "8", "--out-dir", str(out), *PRETRAIN_ARGS, stderr_to=tmp / "stderr.txt")
    return out, stdout


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory, pretrain_run):
    tmp = tmp_path_factory.mktemp("sft")
    lines = [json.dumps({"prompt": f"Q: {i} + 1 = ?\nA:", "response": f" {i + 1}"}) for i in range(40)]
    (tmp / "sft.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp / "out"
    stdout = run_recipe("finetune.py", "--model", str(pretrain_run[0] / "final"), "--data", str(tmp / "sft.jsonl"),
                        "--steps", str(SFT_STEPS), "--eval-fraction", "0.1", "--eval-every", "5",
                        "--eval-batches", "2", "--out-dir", str(out), *COMMON)
    return out, stdout


@pytest.fixture(scope="module")
def profile_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("profile") / "out"
    stdout = run_recipe("profiling.py", "--wait", "1", "--warmup", "1", "--active", "2",
                        "--out-dir", str(out), *COMMON)
    return out, stdout


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _check_png(path: Path) -> None:
    if _has_matplotlib():
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert not path.exists()


# --------------------------------------------------------------------------------------------
# Pretrain (random init from a config.json) and fine-tune (SFT from the pretrained checkpoint)
# --------------------------------------------------------------------------------------------


def test_pretrain_log_and_loss_trend(pretrain_run):
    out, stdout = pretrain_run
    log = read_log(out / "log.jsonl")
    assert [r["step"] for r in log] == list(range(1, PRETRAIN_STEPS + 1))
    assert [r["step"] for r in log if "eval_loss" in r] == [8, 16]
    assert all(math.isfinite(r["loss"]) and r["tokens_per_s"] > 0 for r in log)
    first, last = [r["loss"] for r in log[:4]], [r["loss"] for r in log[-4:]]
    assert sum(last) / 4 < sum(first) / 4 - 0.3, [r["loss"] for r in log]
    assert log[-1]["eval_loss"] < log[7]["eval_loss"]
    assert "random init from" in stdout and "global batch 16 x 64 = 1,024 tokens/step" in stdout
    _check_png(out / "loss.png")
    # byte-level: final/ says so, so --model <final/> trains on bytes again (the SFT run does)
    assert json.loads((out / "final" / train.BYTE_TOKENIZER_FILE).read_text())["tokenizer"] == "byte-level"
    assert not (out / "final" / "tokenizer.json").exists()


def test_pretrain_checkpoint_reproduces_the_final_eval_loss(pretrain_run):
    """final/ loads with from_pretrained and scores the held-out batches as the run did: global
    batches of the run's micro-batch x accumulation x world sequences, every token scored."""
    from transformers import AutoModelForCausalLM

    out, _ = pretrain_run
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    assert model.config.tie_word_embeddings and model.config.vocab_size == 300
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    cfg = pretrain.parse_config(PRETRAIN_ARGS)  # the run's data, batch and eval options
    _, held_out, _ = data.build_datasets(None, data.ByteTokenizer(), cfg.seq_len, cfg.eval_fraction, cfg.max_bytes)
    global_batch = cfg.micro_batch * cfg.accum_steps * 2  # (world 2)
    losses = []
    with torch.no_grad():
        for i in range(cfg.eval_batches):  # (equal token counts: the mean of the batch means is the token mean)
            batch = held_out.global_batch(cfg.seed, i, global_batch, stream=data.EVAL_STREAM)
            losses.append(model(**batch).loss.item())
    reported = read_log(out / "log.jsonl")[-1]["eval_loss"]
    assert sum(losses) / len(losses) == pytest.approx(reported, rel=1e-4, abs=1e-4)


def test_stop_and_resume_reproduce_the_uninterrupted_run_bitwise(pretrain_run, tmp_path):
    """--stop-at 10 saves a sharded checkpoint (even with --save-every 0) and ends; --resume continues at step 11 and logs
    exactly the losses, grad norms and eval losses of the uninterrupted 16-step run."""
    full_out, _ = pretrain_run
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    out = tmp_path / "out"
    args = ["--config", str(tmp_path / "config.json"), "--steps", str(PRETRAIN_STEPS), "--eval-every", "8",
            "--out-dir", str(out), *PRETRAIN_ARGS]
    stdout = run_recipe("pretrain.py", *args, "--stop-at", "10", "--save-every", "0")  # --stop-at always saves
    assert "stopped after step 10 of 16: checkpoint in" in stdout
    assert (out / "checkpoint" / "LATEST").exists() and not (out / "final").exists()
    assert [r["step"] for r in read_log(out / "log.jsonl")] == list(range(1, 11))
    stdout = run_recipe("pretrain.py", *args, "--resume", "true")
    assert "resumed from" in stdout and "after step 10" in stdout and "WARNING" not in stdout
    assert "--weight-decay" not in stdout  # unchanged: no note
    keys = ("step", "loss", "lr", "grad_norm", "eval_loss")
    resumed = [{k: r.get(k) for k in keys} for r in read_log(out / "log.jsonl")]
    uninterrupted = [{k: r.get(k) for k in keys} for r in read_log(full_out / "log.jsonl")]
    assert resumed == uninterrupted
    elapsed = [r["elapsed"] for r in read_log(out / "log.jsonl")]
    assert elapsed == sorted(elapsed) and elapsed[10] > elapsed[9]  # training seconds count on over the resume
    assert f"loss {resumed[0]['loss']:.4f} -> {resumed[-1]['loss']:.4f}," in stdout, stdout  # the whole run's
    _check_png(out / "loss.png")
    from safetensors.torch import load_file

    def weights(folder):
        return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}

    a, b = weights(out / "final"), weights(full_out / "final")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b)


def test_a_resumed_run_with_dropout_draws_what_the_uninterrupted_one_drew(tmp_path):
    """Dropout's random draws come from (seed, step, rank), like the data: --stop-at 2 then --resume
    logs bitwise what the uninterrupted 4-step run logs (before, the resumed run restarted the
    generator that seeded the model's initialisation)."""
    (tmp_path / "config.json").write_text(json.dumps({**TINY_CONFIG, "attention_dropout": 0.2}))
    args = ["--config", str(tmp_path / "config.json"), "--steps", "4", "--eval-every", "0", "--save-every", "0",
            "--seq-len", "32", "--max-bytes", "100000", "--micro-batch", "2"]
    run_recipe("pretrain.py", *args, "--out-dir", str(tmp_path / "full"))
    run_recipe("pretrain.py", *args, "--out-dir", str(tmp_path / "cut"), "--stop-at", "2")
    run_recipe("pretrain.py", *args, "--out-dir", str(tmp_path / "cut"), "--resume", "true")
    keys = ("step", "loss", "grad_norm", "eval_loss")
    got, want = ([{k: r.get(k) for k in keys} for r in read_log(tmp_path / d / "log.jsonl")] for d in ("cut", "full"))
    assert got == want and len(want) == 4


def test_pretrain_without_resharding_follows_the_default_run(pretrain_run, tmp_path):
    """--reshard-after-forward false (per-unit buffers; the first of the two micro-batches runs under
    no_sync) logs the losses and grad norms of the default run: only the order of the fp32
    additions differs (micro-batches summed before the reduction instead of after)."""
    full_out, _ = pretrain_run
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    out = tmp_path / "out"
    stdout = run_recipe("pretrain.py", "--config", str(tmp_path / "config.json"), "--steps", str(PRETRAIN_STEPS),
                        "--eval-every", "8", "--save-every", "0", "--out-dir", str(out),
                        "--reshard-after-forward", "false", *PRETRAIN_ARGS)
    assert "slot layer_1 " in stdout and "slot layer_even" not in stdout  # a slot per unit in the plan
    got, want = read_log(out / "log.jsonl"), read_log(full_out / "log.jsonl")
    assert [r["step"] for r in got] == list(range(1, PRETRAIN_STEPS + 1))
    for key in ("loss", "grad_norm", "eval_loss"):
        a, b = [r.get(key) for r in got if key in r], [r.get(key) for r in want if key in r]
        assert a == pytest.approx(b, rel=1e-4), (key, a, b)


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="inductor on CPU needs a C++ compiler")
def test_pretrain_with_compiled_layers_follows_the_default_run(pretrain_run, tmp_path):
    """--compile true: every decoder layer under torch.compile (inductor) logs the default run's
    losses, grad norms and eval losses, to the rounding inductor's fused kernels change."""
    full_out, _ = pretrain_run
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    out = tmp_path / "out"
    run_recipe("pretrain.py", "--config", str(tmp_path / "config.json"), "--steps", str(PRETRAIN_STEPS),
               "--eval-every", "8", "--save-every", "0", "--out-dir", str(out), "--compile", "true", *PRETRAIN_ARGS)
    got, want = read_log(out / "log.jsonl"), read_log(full_out / "log.jsonl")
    assert [r["step"] for r in got] == list(range(1, PRETRAIN_STEPS + 1))
    for key in ("loss", "grad_norm", "eval_loss"):
        a, b = [r.get(key) for r in got if key in r], [r.get(key) for r in want if key in r]
        assert a and a == pytest.approx(b, rel=1e-3), (key, a, b)


def test_soak_refuses_a_world_of_zero(tmp_path, capsys):
    import soak

    with pytest.raises(SystemExit):
        soak.main(["--worlds", "2,0", "--out-dir", str(tmp_path)])
    assert "world size 0 in --worlds 2,0 / --reference-world 2: every world size must be >= 1" in capsys.readouterr().err


def test_soak_short(tmp_path, capsys):
    """recipes/soak.py in brief: a 12-step run cut into segments at world 1 then 2 (resuming from
    sharded checkpoints) matches the same run done in one go at world 2."""
    import soak

    assert soak.main(["--steps", "12", "--worlds", "1,2", "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| 2 | 2 | 7-12 |" in out and "PASS" in out, out


def test_sft_from_the_pretrained_checkpoint(sft_run):
    from transformers import AutoModelForCausalLM

    out, stdout = sft_run
    assert "SFT" in stdout and "36 train / 4 held-out examples" in stdout
    log = read_log(out / "log.jsonl")
    assert [r["step"] for r in log] == list(range(1, SFT_STEPS + 1))
    losses = [r["loss"] for r in log]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3, losses
    assert [r["step"] for r in log if "eval_loss" in r] == [5, 10]
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    assert model.config.vocab_size == 300
    _check_png(out / "loss.png")
    saved = json.loads((out / "config.json").read_text())
    assert saved["world_size"] == 2 and saved["steps"] == SFT_STEPS and saved["model"].endswith("final")


def test_sft_loss_counts_every_token_once_however_the_batch_is_split(pretrain_run, sft_run, tmp_path):
    """The same global batch of 8 examples (responses of 2 and 3 tokens) as 2 ranks x 2 micro-batches
    of 2 instead of 2 ranks x 1 micro-batch of 4: every step's loss and gradient are those of the
    sum over the batch's response tokens divided by their number, so the logs agree to fp32
    rounding (a mean per micro-batch weighted each split's short examples differently), and so does
    the held-out loss, whose batches are global batches too (they were --micro-batch x world
    examples, so the split evaluated other examples)."""
    out, _ = sft_run
    data = out.parent / "sft.jsonl"
    split = tmp_path / "out"
    run_recipe("finetune.py", "--model", str(pretrain_run[0] / "final"), "--data", str(data),
               "--steps", "5", "--eval-fraction", "0.1", "--eval-every", "0", "--eval-batches", "2",
               "--save-every", "0", "--out-dir", str(split), *COMMON[:-1], "2", "--accum-steps", "2")
    got, want = read_log(split / "log.jsonl"), read_log(out / "log.jsonl")[:5]
    for key in ("loss", "grad_norm", "eval_loss"):
        a, b = [r[key] for r in got if key in r], [r[key] for r in want if key in r]
        assert len(a) == len(b) > 0 and a == pytest.approx(b, rel=1e-5), (key, a, b)


def test_finetune_with_frozen_embedding_and_first_layer(pretrain_run, tmp_path):
    """--freeze: the named parameters leave the run exactly as they came in (the exported final
    checkpoint holds the pretrained ones bitwise), and the rest still learns."""
    from safetensors.torch import load_file

    out = tmp_path / "out"
    stdout = run_recipe("finetune.py", "--model", str(pretrain_run[0] / "final"), "--steps", "6",
                        "--eval-every", "0", "--eval-batches", "1", "--save-every", "0", "--lr", "1e-2",
                        "--freeze", "embed_tokens,layers.0.", "--out-dir", str(out), *COMMON)
    assert "of them frozen" in stdout and "frozen values" in stdout  # (layer 0's norms: in the trained norm group)
    before = load_file(pretrain_run[0] / "final" / "model.safetensors")
    after = load_file(out / "final" / "model.safetensors")
    frozen = [k for k in before if "embed_tokens" in k or "layers.0." in k]
    assert frozen and all(torch.equal(after[k], before[k]) for k in frozen)
    assert all(not torch.equal(after[k], before[k]) for k in before if k not in frozen)


def test_freeze_option_errors(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in TINY_CONFIG.items() if k not in ("model_type", "architectures")}))
    with pytest.raises(ValueError, match=r"--freeze embed,mlp\.upper: 'mlp\.upper' is in no parameter name of the model "
                                         r"\(they look like model\.embed_tokens\.weight, lm_head\.weight\)"):
        train.freeze(model, "embed,mlp.upper")
    with pytest.raises(ValueError, match=r"--freeze model freezes every parameter of the model: nothing would train"):
        train.freeze(model, "model")
    model.requires_grad_(True)
    assert train.freeze(model, None) == 0
    assert train.freeze(model, " embed_tokens , ") == model.model.embed_tokens.weight.numel()
    assert not model.model.embed_tokens.weight.requires_grad and model.model.norm.weight.requires_grad
    model.requires_grad_(True)
    assert train.freeze(model, "lm_head") == model.lm_head.weight.numel()  # a tied name
    assert not model.model.embed_tokens.weight.requires_grad
    # a resumed run must freeze what the checkpoint's run froze, however the patterns spell it
    model.requires_grad_(True)
    train.freeze(model, "layers.0,embed_tokens")
    ckpt = Path("run/checkpoint")
    saved = {"step": 2, "freeze": "embed_tokens,layers.0.", "frozen": train.frozen_names(model)}
    assert train.freeze_problem(finetune.FinetuneConfig(freeze="layers.0,embed_tokens"), model, saved, ckpt) is None
    model.requires_grad_(True)
    train.freeze(model, "layers.1.")
    problem = train.freeze_problem(finetune.FinetuneConfig(freeze="layers.1."), model, saved, ckpt)
    assert problem == (
        "--freeze layers.1. does not freeze what the run that saved the checkpoint in run/checkpoint froze: it freezes "
        "model.layers.1.input_layernorm.weight, model.layers.1.mlp.down_proj.weight, model.layers.1.mlp.gate_proj.weight "
        "and 6 more, which that run trained and trains lm_head.weight, model.embed_tokens.weight, "
        "model.layers.0.input_layernorm.weight and 8 more, which that run froze. The optimizer's parameter groups and "
        "state are those of the parameters that run trained. To continue it, pass --freeze embed_tokens,layers.0.; to "
        "train other parameters from its weights, start a new run from its export (--model <out-dir>/final, another "
        "--out-dir)"), problem
    model.requires_grad_(True)
    assert train.freeze_problem(finetune.FinetuneConfig(), model, saved, ckpt).startswith(
        "this run (no --freeze) does not freeze what the run that saved the checkpoint in run/checkpoint froze: it "
        "trains lm_head.weight, ")
    train.freeze(model, "layers.1.")
    # a checkpoint saved before the names were recorded: its run's patterns (extra, else config.json) stand for them
    assert train.freeze_problem(finetune.FinetuneConfig(freeze="layers.1."), model, {"step": 2, "freeze": "layers.1"},
                                ckpt) is None
    assert "which that run trained. The optimizer's" in train.freeze_problem(
        finetune.FinetuneConfig(freeze="layers.1."), model, {"step": 2, "freeze": None}, ckpt)
    assert train.freeze_problem(finetune.FinetuneConfig(out_dir=str(tmp_path), freeze="layers.1."), model,
                                {"step": 2}, ckpt) is None  # (nothing says what the run froze)
    (tmp_path / "config.json").write_text(json.dumps({"freeze": "embed"}))
    assert "which that run froze. The optimizer's" in train.freeze_problem(
        finetune.FinetuneConfig(out_dir=str(tmp_path), freeze="layers.1."), model, {"step": 2}, ckpt)


# --------------------------------------------------------------------------------------------
# Profile
# --------------------------------------------------------------------------------------------

EXPECTED_LABELS = {
    "yashard::data", "yashard::forward", "yashard::backward", "yashard::clip_grad_norm",
    "yashard::optimizer_step", "yashard::loss_all_reduce",
    # the runtime's per-unit labels name the unit's HF path, as FSDP2's do
    "yashard::all_gather (model.layers.0)", "yashard::all_gather (norm group)",
    "yashard::reduce_scatter (model.layers.0)", "yashard::reduce_scatter (norm group)",
    "yashard::post_divide (model.layers.0)", "yashard::wait_collective", "yashard::drain",
}


@pytest.mark.parametrize("rank", [0, 1])
def test_profile_trace_is_a_valid_chrome_trace_with_every_label(profile_run, rank):
    out, _ = profile_run
    trace = json.loads((out / f"trace_rank{rank}.json").read_text())
    events = trace["traceEvents"]
    assert isinstance(events, list) and events
    for e in events:
        assert isinstance(e["name"], str) and e["ph"] in {"X", "i", "s", "f", "M", "C", "B", "E"}
        if e["ph"] == "X":
            assert isinstance(e["ts"], (int, float)) and isinstance(e["dur"], (int, float)) and e["dur"] >= 0
            assert "pid" in e and "tid" in e
    names = {e["name"] for e in events if e["ph"] == "X"}
    assert EXPECTED_LABELS <= names, EXPECTED_LABELS - names
    # every runtime label is one of the summary's stages, its unit named where it has one
    labels = {n for n in names if n.startswith("yashard::")}
    assert {ts.stage(n) for n in labels} <= set(ts.STAGE_LABELS) | {"yashard::save_checkpoint"}, labels
    assert all(" (" in n for n in labels if ts.stage(n) in ("yashard::all_gather", "yashard::reduce_scatter",
                                                             "yashard::post_divide")), labels
    steps = [e for e in events if e["ph"] == "X" and e["name"].startswith("ProfilerStep#")]
    assert len(steps) == 2  # --active 2
    assert any(e["name"].startswith("gloo:") for e in events if e["ph"] == "X")
    assert trace["distributedInfo"]["rank"] == rank


def test_profile_summary_is_consistent(profile_run):
    out, stdout = profile_run
    summaries = json.loads((out / "profile_summary.json").read_text())
    assert len(summaries) == 2
    for rank, s in enumerate(summaries):
        assert s["basis"] == "cpu" and s["steps"] == 2
        eps = 1e-6
        assert 0 < s["exposed_comm_ms"] <= s["comm_ms"] + eps
        assert s["comm_ms"] <= s["wall_ms"] + eps
        assert 0 < s["compute_ms"] and s["compute_ms"] + s["exposed_comm_ms"] <= s["wall_ms"] + eps
        assert s["memory_peak_mb"] > 0
        stages = s["stages_ms"]
        loop = sum(stages[k] for k in ("yashard::data", "yashard::forward", "yashard::backward",
                                       "yashard::clip_grad_norm", "yashard::optimizer_step",
                                       "yashard::loss_all_reduce"))
        assert 0 < loop <= s["wall_ms"] + eps
        assert stages["yashard::wait_collective"] <= s["wall_ms"] and stages["yashard::forward"] > 0
        # Independent check of the wall time: the ProfilerStep ranges of that rank's trace.
        trace = json.loads((out / f"trace_rank{rank}.json").read_text())
        step_us = [e["dur"] for e in trace["traceEvents"] if e["ph"] == "X" and e["name"].startswith("ProfilerStep#")]
        assert s["wall_ms"] == pytest.approx(sum(step_us) / len(step_us) / 1e3)
        assert s == ts.summarize_trace(trace)  # rank r's row is rank r's trace (JSON keeps floats exact)
    table = (out / "profile_summary.txt").read_text()
    assert "definitions (cpu)" in table and "exposed" in table and "mean" in table and "max" in table
    assert table.strip() in stdout
    assert len(read_log(out / "log.jsonl")) == 4  # wait 1 + warmup 1 + active 2
    assert not (out / "final").exists()


# --------------------------------------------------------------------------------------------
# Trace arithmetic and summaries on hand-made traces
# --------------------------------------------------------------------------------------------


def _covered(intervals, n):
    return {t for t in range(n) for s, e in intervals if s <= t < e}


def test_interval_ops_match_a_brute_force_count():
    rng = random.Random(0)
    for _ in range(200):
        a = [(s, s + rng.randint(0, 8)) for s in (rng.randint(0, 40) for _ in range(rng.randint(0, 6)))]
        b = [(s, s + rng.randint(0, 8)) for s in (rng.randint(0, 40) for _ in range(rng.randint(0, 6)))]
        ca, cb = _covered(a, 60), _covered(b, 60)
        assert _covered(ts.union(a), 60) == ca and ts.length(a) == len(ca)
        assert _covered(ts.intersect(a, b), 60) == ca & cb
        assert _covered(ts.subtract(a, b), 60) == ca - cb
        u = ts.union(a)
        assert all(e1 < s2 for (_, e1), (s2, _) in zip(u, u[1:]))  # sorted and disjoint


def _x(name, ts_, dur, tid=1, cat="cpu_op", pid=7):
    return {"ph": "X", "name": name, "ts": ts_, "dur": dur, "pid": pid, "tid": tid, "cat": cat}


def _mem(total, device_type):
    return {"ph": "i", "name": "[memory]", "ts": 0, "pid": 7, "tid": 1,
            "args": {"Total Allocated": total, "Device Type": device_type}}


def test_summarize_cpu_trace_by_hand():
    events = [
        _x("ProfilerStep#3", 0, 100, cat="user_annotation"), _x("ProfilerStep#4", 100, 100, cat="user_annotation"),
        _x("aten::mm", 0, 40),
        _x("c10d::_allgather_base_", 40, 5),
        _x("yashard::all_gather (model.layers.3)", 39, 7, cat="user_annotation"),
        _x("autograd::engine::evaluate_function: X", 50, 40),
        _x("yashard::wait_collective", 60, 20, cat="user_annotation"),
        _x("yashard::post_divide (model.layers.3)", 70, 5, cat="user_annotation"), _x("aten::add_", 70, 5),
        _x("aten::add", 110, 50),
        _x("gloo:all_gather", 42, 28, tid=2, cat="user_annotation"),
        _x("aten::copy_", 42, 3, tid=2),  # gloo thread work is communication, not compute
        _x("gloo:all_reduce", 150, 110, tid=2, cat="user_annotation"),  # runs past the window
        _x("gloo:recv", 86, 12, cat="user_annotation"),  # a point-to-point receive, on the training thread
        _mem(1 * 2**20, 0), _mem(3 * 2**20, 0), _mem(2 * 2**20, 0), _mem(50 * 2**20, 1),
    ]
    s = ts.summarize_trace({"traceEvents": events})
    # compute: [0,39) + [50,60) + [70,75) + [80,90) + [110,160) = 39 + 10 + 5 + 10 + 50
    # comm: [42,70) + [86,98) + [150,200); exposed: [42,50) + [60,70) + [90,98) + [160,200)
    assert s["basis"] == "cpu" and s["steps"] == 2
    assert s["wall_ms"] == pytest.approx(0.100)
    assert s["compute_ms"] == pytest.approx(114 / 2 / 1e3)
    assert s["comm_ms"] == pytest.approx(90 / 2 / 1e3)
    assert s["exposed_comm_ms"] == pytest.approx(66 / 2 / 1e3)
    assert s["memory_peak_mb"] == pytest.approx(3.0)
    assert s["stages_ms"]["yashard::wait_collective"] == pytest.approx(20 / 2 / 1e3)
    assert s["stages_ms"]["yashard::forward"] == 0.0
    assert s["stages_ms"]["yashard::all_gather"] == pytest.approx(7 / 2 / 1e3)  # (model.layers.3)'s
    assert s["stages_ms"]["yashard::post_divide"] == pytest.approx(5 / 2 / 1e3)


def test_stage_of_a_label_drops_the_unit():
    assert ts.stage("yashard::all_gather (model.layers.3)") == "yashard::all_gather"
    assert ts.stage("yashard::reduce_scatter (norm group)") == "yashard::reduce_scatter"
    assert ts.stage("yashard::all_gather") == "yashard::all_gather"  # (a label without a unit)
    assert ts.stage("aten::add (x)") == "aten::add (x)"  # only the runtime's labels name a unit


def test_summarize_cuda_trace_by_hand():
    events = [
        _x("ProfilerStep#1", 0, 100, cat="user_annotation"),
        _x("ProfilerStep#1", 5, 120, tid=7, cat="gpu_user_annotation", pid=0),  # GPU mirror: not a step
        _x("yashard::forward", 5, 50, tid=7, cat="gpu_user_annotation", pid=0),
        _x("cudaLaunchKernel", 0, 5, cat="cuda_runtime"),
        _x("ampere_sgemm_128x64_nn", 0, 30, tid=7, cat="kernel", pid=0),
        _x("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 10, 40, tid=20, cat="kernel", pid=0),
        _x("Memcpy DtoD (Device -> Device)", 60, 20, tid=20, cat="gpu_memcpy", pid=0),
        _x("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 70, 50, tid=20, cat="kernel", pid=0),
        _mem(5 * 2**20, 1), _mem(9 * 2**20, 0),
    ]
    s = ts.summarize_trace({"traceEvents": events})
    assert s["basis"] == "cuda" and s["steps"] == 1
    assert s["compute_ms"] == pytest.approx(0.050)   # [0,30) + [60,80)
    assert s["comm_ms"] == pytest.approx(0.070)      # [10,50) + [70,100) (clipped to the step)
    assert s["exposed_comm_ms"] == pytest.approx(0.040)  # [30,50) + [80,100)
    assert s["memory_peak_mb"] == pytest.approx(5.0)
    assert s["wall_ms"] == pytest.approx(0.100) and s["stages_ms"]["yashard::forward"] == 0.0


def test_summarize_trace_needs_profiler_steps():
    with pytest.raises(ValueError, match="no ProfilerStep# ranges: profile with a schedule"):
        ts.summarize_trace({"traceEvents": [_x("aten::mm", 0, 10)]})


def test_format_table_rows_and_definitions():
    s = {"basis": "cuda", "steps": 3, "wall_ms": 10.0, "compute_ms": 8.0, "comm_ms": 4.0,
         "exposed_comm_ms": 1.0, "memory_peak_mb": 100.0, "stages_ms": {k: 0.5 for k in ts.STAGE_LABELS}}
    table = ts.format_table([s, {**s, "wall_ms": 20.0, "exposed_comm_ms": 3.0, "memory_peak_mb": None}])
    lines = table.splitlines()
    assert any(line.split()[:1] == ["mean"] and "15.00" in line and "12.5" in line for line in lines)
    assert any(line.split()[:1] == ["max"] and "20.00" in line and "15.0" in line for line in lines)
    assert "definitions (cuda):" in table and "NCCL" in table
    with pytest.raises(ValueError, match="no summaries"):
        ts.format_table([])


# --------------------------------------------------------------------------------------------
# Command lines and their errors
# --------------------------------------------------------------------------------------------


def test_recipe_configs_from_command_line():
    cfg = pretrain.parse_config(["--model-size", "small", "--steps", "7"])
    assert (cfg.model_size, cfg.config, cfg.steps, cfg.out_dir) == ("small", None, 7, "runs/pretrain")
    assert pretrain.parse_config([]) == pretrain.PretrainConfig()
    assert finetune.parse_config([]).out_dir == "runs/finetune"
    p = profiling.parse_config(["--wait", "0", "--warmup", "1", "--active", "4"])
    assert p.steps == 5 and p.eval_every == 0 and p.profile_memory
    assert profiling.parse_config(["--active", "2", "--steps", "5"]).steps == 5


def test_run_throughput_is_tokens_over_seconds():
    # equal tokens per step: steps at 100 and 300 tokens/s take 3 and 1 time units: 150 tokens/s, not 200
    assert train.throughput([{"tokens_per_s": 1.0}, {"tokens_per_s": 100.0}, {"tokens_per_s": 300.0}]) == 150.0


@pytest.mark.parametrize("module, argv, message", [
    (pretrain, ["--config", "c.json", "--model-size", "tiny"],
     "--config c.json and --model-size tiny each choose the model: pass only one of them"),
    (profiling, ["--model", "m", "--model-size", "small"], "--model m and --model-size small each choose the model"),
    (pretrain, ["--data", "x.jsonl"], "is SFT prompt/response data; pretraining takes plain text"),
    (profiling, ["--steps", "9"], "--steps 9 does not match --wait 1 + --warmup 2 + --active 3 = 6"),
    (profiling, ["--active", "0"], "wait and warmup must be >= 0 and active >= 1"),
    (finetune, ["--steps", "0"], "steps, micro_batch and accum_steps must be >= 1"),
    (pretrain, ["--model-size", "huge"], "invalid choice: 'huge'"),
    (pretrain, ["--min-lr-ratio", "-1"], "--min-lr-ratio -1.0 must be between 0 and 1: the cosine schedule decays"),
    (finetune, ["--min-lr-ratio", "1.5"], "--min-lr-ratio 1.5 must be between 0 and 1"),
    (pretrain, ["--weight-decay", "-0.1"], "--weight-decay -0.1 must be a number >= 0 (0: no weight decay)"),
    (pretrain, ["--lr", "nan"], "--lr nan must be a number > 0"),
    (finetune, ["--data", str(ROOT / "tests")], "--data " + str(ROOT / "tests") + " is a folder: pass one .txt file"),
    (finetune, ["--data", str(ROOT / "README.md")], "unsupported file type; pass a .txt file"),
    (finetune, ["--clip", "nan"], "--clip nan must be a finite number: the global gradient norm to clip to"),
    (pretrain, ["--out-dir", str(ROOT / "README.md")], "README.md is a file: pass a directory (created if missing)"),
    (finetune, ["--eval-batches", "0"], "--eval-batches 0 must be >= 1: every run ends with an evaluation"),
    (pretrain, ["--max-bytes", "0"], "--max-bytes 0 must be >= 1"),
    (finetune, ["--eval-fraction", "0"], "--eval-fraction 0.0 must be between 0 and 1 (both excluded)"),
    (pretrain, ["--eval-fraction", "1"], "--eval-fraction 1.0 must be between 0 and 1 (both excluded)"),
    (finetune, ["--log-every", "0"], "--log-every 0 must be >= 1"),
    (profiling, ["--save-every", "2"], "--save-every 2: a checkpoint save would fall inside the profiled steps"),
    (profiling, ["--eval-every", "1"], "--eval-every 1: an evaluation would fall inside the profiled steps"),
    (profiling, ["--stop-at", "2"], "--stop-at 2: stopping early would fall inside the profiled steps or cut them"),
    (profiling, ["--resume", "true"], "--resume True: resuming would fall inside the profiled steps or cut them"),
])
def test_bad_command_lines_exit_with_the_reason(module, argv, message, capsys):
    with pytest.raises(SystemExit):
        module.parse_config(argv)
    assert message in capsys.readouterr().err


def _usage_error(module, argv, capsys) -> str:
    with pytest.raises(SystemExit):
        module.parse_config(argv)
    return capsys.readouterr().err


def test_resume_options_past_the_checkpoint_are_refused_before_the_run(pretrain_run, capsys):
    """--resume with --stop-at or --steps at or before the checkpoint's step (16 here) exits with a usage error."""
    out = str(pretrain_run[0])
    ckpt = re.escape(str(pretrain_run[0] / "checkpoint"))
    resume = ["--out-dir", out, "--resume", "true"]
    err = _usage_error(pretrain, [*resume, "--steps", "20", "--stop-at", "16"], capsys)
    assert re.search(rf"--stop-at 16 is at or before step 16, where the checkpoint in {ckpt} was saved: a resumed run "
                     r"starts after step 16; pass a --stop-at between 17 and --steps 20, or leave --stop-at out", err), err
    err = _usage_error(pretrain, [*resume, "--steps", "16", "--stop-at", "10"], capsys)
    assert "--stop-at 10 is at or before step 16" in err and "leave --stop-at out: the run is complete" in err, err
    err = _usage_error(pretrain, [*resume, "--steps", "4"], capsys)
    assert re.search(rf"--steps 4 is below step 16, where the checkpoint in {ckpt} was saved, so --resume true has "
                     r"nothing to train: pass --steps 16 to continue the run", err), err
    assert pretrain.parse_config([*resume, "--steps", "20", "--stop-at", "17"]).stop_at == 17
    assert pretrain.parse_config(["--out-dir", out, "--steps", "4", "--stop-at", "2"]).steps == 4  # no --resume


def test_model_and_tokenizer_folders_are_checked_before_anything_is_built(pretrain_run, tmp_path):
    """A missing --model / --tokenizer folder, or --model naming a run's --out-dir or its sharded
    checkpoint, is refused saying which folder to pass (and --resume), before any tokenizer, data or model."""
    out, tok = pretrain_run[0], data.ByteTokenizer()
    with pytest.raises(FileNotFoundError, match=r"^--model /nonexistent: no such folder\. --model takes a local HF "
                                                r"checkpoint folder \(config\.json and \*\.safetensors weights"):
        train.build_model(finetune.FinetuneConfig(model="/nonexistent"), tok)
    with pytest.raises(FileNotFoundError, match=r"^--tokenizer /nonexistent: no such folder\. --tokenizer takes a local "
                                                r"HF tokenizer folder"):
        train.check_folders(finetune.FinetuneConfig(tokenizer="/nonexistent"))
    to_resume = re.escape(f"to continue that run, pass --out-dir {out} --resume true")
    with pytest.raises(ValueError, match=rf"^--model {re.escape(str(out))} is not an HF model folder: its config\.json is "
                                         rf"a recipe's run configuration.*{to_resume}.*pass --model "
                                         rf"{re.escape(str(out / 'final'))}$"):
        train.build_model(finetune.FinetuneConfig(model=str(out)), tok)
    for folder in (out / "checkpoint", next((out / "checkpoint").glob("save-*"))):
        with pytest.raises(ValueError, match=rf"^--model {re.escape(str(folder))} has no config\.json, so it is not an "
                                             rf"HF model folder: .*It is the yashard training checkpoint .*{to_resume}"):
            train.check_folders(finetune.FinetuneConfig(model=str(folder)))
    with pytest.raises(ValueError, match=r"has no config\.json, so it is not an HF model folder: pass a local HF .* final/ folder\)\.$"):
        train.check_folders(finetune.FinetuneConfig(model=str(tmp_path)))
    with pytest.raises(ValueError, match=r"log\.jsonl is a file: pass a local HF checkpoint folder"):
        train.check_folders(finetune.FinetuneConfig(model=str(out / "log.jsonl")))
    with pytest.raises(ValueError, match=rf"^--tokenizer {re.escape(str(tmp_path))} holds no tokenizer \(no tokenizer\.json, "
                                         r"tokenizer_config\.json or tokenizer\.model\): pass a local HF tokenizer folder"):
        train.check_folders(finetune.FinetuneConfig(model=str(out / "final"), tokenizer=str(tmp_path)))
    (tmp_path / "tokenizer_config.json").write_text("{}")
    train.check_folders(finetune.FinetuneConfig(model=str(out / "final"), tokenizer=str(tmp_path)))


def test_jsonl_data_errors_name_the_file_and_line(tmp_path):
    tok = data.ByteTokenizer()
    jsonl = tmp_path / "sft.jsonl"
    good = json.dumps({"prompt": "a", "response": "b"})
    jsonl.write_text(f"{good}\n\nnot json\n")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(jsonl))}:3: not valid JSON \(Expecting value at column 1\); "
                                         r"every line must be one \{\"prompt\": \.\.\., \"response\": \.\.\.\} object$"):
        data.build_datasets(str(jsonl), tok, seq_len=16)
    jsonl.write_text(f"{good}\n[1, 2]\n")
    with pytest.raises(ValueError, match=r"sft\.jsonl:2: expected a \{\"prompt\": \.\.\., \"response\": \.\.\.\} "
                                         r"object, got a JSON list"):
        data.build_datasets(str(jsonl), tok, seq_len=16)
    for bad, what in (("null", "null"), ("[1]", "a JSON list"), ("3", "a JSON int")):
        jsonl.write_text(f'{good}\n{{"prompt": "a", "response": {bad}}}\n')
        with pytest.raises(ValueError, match=rf"sft\.jsonl:2: 'response' must be a string, got {what}$"):
            data.build_datasets(str(jsonl), tok, seq_len=16)  # (str() made them "None" and reprs)
    jsonl.write_text(f"{good}\n")
    with pytest.raises(ValueError, match=r"sft\.jsonl has only 1 example: at least 2 are needed, one held out for "
                                         r"evaluation \(--eval-fraction\) and at least one to train on"):
        data.build_datasets(str(jsonl), tok, seq_len=16)
    jsonl.write_text(f"{good}\n{good}\n")
    assert [len(part) for part in data.build_datasets(str(jsonl), tok, seq_len=16)[:2]] == [1, 1]
    with pytest.raises(ValueError, match=r"--eval-fraction 0\.9 of the 2 examples in .*sft\.jsonl holds out 2, leaving "
                                         r"none to train on: lower --eval-fraction"):
        data.build_datasets(str(jsonl), tok, seq_len=16, eval_fraction=0.9)


def test_model_source_errors(tmp_path):
    tok = data.ByteTokenizer()
    with pytest.raises(FileNotFoundError, match="no such file, and no folder with a config.json"):
        train.build_model(pretrain.PretrainConfig(config=str(tmp_path / "missing.json")), tok)
    (tmp_path / "config.json").write_text(json.dumps({**TINY_CONFIG, "vocab_size": 100}))
    with pytest.raises(ValueError, match=r"tokenizer has 259 ids but --config .* has a vocabulary of 100: pass"):
        train.build_model(pretrain.PretrainConfig(config=str(tmp_path)), tok)
    # A checkpoint folder is checked on its config.json, before any weights are read.
    with pytest.raises(ValueError, match=r"tokenizer has 259 ids but --model .* has a vocabulary of 100: pass"):
        train.build_model(finetune.FinetuneConfig(model=str(tmp_path)), tok)


def test_sequences_longer_than_the_models_positions_warn():
    cfg = train.preset_config("tiny", data.ByteTokenizer(), seq_len=128)
    assert cfg.max_position_embeddings == 256 and train.position_warning(cfg, 256) is None
    assert train.position_warning(cfg, 257) == (
        "WARNING: --seq-len 257 is longer than the model's max_position_embeddings 256: positions past it were "
        "never trained. Lower --seq-len, or extend the context in the model's config (rope_scaling) first")


def test_log_records_are_strict_json():
    assert train._strict_json({"loss": float("nan"), "grad_norm": float("inf"), "lr": 0.5, "step": 3}) == \
        {"loss": None, "grad_norm": None, "lr": 0.5, "step": 3}


def test_a_random_init_config_gets_the_positions_it_trains(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**TINY_CONFIG, "max_position_embeddings": 32}))
    tok = data.ByteTokenizer()
    model = train.build_model(pretrain.PretrainConfig(config=str(tmp_path), seq_len=64), tok)
    assert model.config.max_position_embeddings == 64 and train.position_warning(model.config, 64) is None
    model = train.build_model(pretrain.PretrainConfig(config=str(tmp_path), seq_len=16), tok)
    assert model.config.max_position_embeddings == 32   # never lowered


def test_model_size_presets():
    tok = data.ByteTokenizer()
    cfg = train.preset_config("small", tok, seq_len=512)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size, cfg.max_position_embeddings) == (256, 8, 259, 512)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (257, 258, 256)
    model = train.build_model(pretrain.PretrainConfig(), tok)  # no --model-size: tiny
    assert sum(p.numel() for p in model.parameters()) == 804736 and model.config.hidden_size == 128
    with pytest.raises(ValueError, match="unknown model size 'huge'; choose one of tiny, small, base"):
        train.preset_config("huge", tok, 128)


def test_resume_after_a_crash_reproduces_the_uninterrupted_run(pretrain_run, tmp_path):
    """Every rank is SIGKILLed as step 14 starts (13 steps logged, the checkpoint of step 10 on
    disk); --resume goes back to step 10 and logs exactly what the uninterrupted run logged."""
    full_out, _ = pretrain_run
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    out = tmp_path / "out"
    args = ["--config", str(tmp_path / "config.json"), "--steps", str(PRETRAIN_STEPS), "--eval-every", "8",
            "--save-every", "10", "--out-dir", str(out), *PRETRAIN_ARGS]
    crashed = _torchrun(ROOT / "tests" / "crash_pretrain.py", args, {"YASHARD_TEST_KILL_AT": "13"})
    assert crashed.returncode != 0, crashed.stdout[-2000:]
    assert [r["step"] for r in read_log(out / "log.jsonl")] == list(range(1, 14))
    assert not (out / "final").exists()
    stdout = run_recipe("pretrain.py", *args, "--resume", "true")
    assert "after step 10" in stdout
    keys = ("step", "loss", "lr", "grad_norm", "eval_loss")
    resumed = [{k: r.get(k) for k in keys} for r in read_log(out / "log.jsonl")]
    assert resumed == [{k: r.get(k) for k in keys} for r in read_log(full_out / "log.jsonl")]


def test_progress_bar_on_rank_0_only(pretrain_run):
    stderr = (pretrain_run[0].parent / "stderr.txt").read_text()
    states = [line.strip() for line in stderr.replace("\r", "\n").splitlines() if line.strip().startswith("train:")]
    done = [line for line in states if f"{PRETRAIN_STEPS}/{PRETRAIN_STEPS}" in line]
    assert done, stderr[-2000:]
    assert all(re.search(rf"{key}=\d", done[-1]) for key in ("loss", "tok_s", "mem")), done[-1]
    assert sum(line.startswith("train:   0%") for line in states) <= 1, "more than one rank drew a progress bar"


def test_phase_memory_recipe_reports_every_phase_and_constant_memory_after_step_one():
    """recipes/phase_memory.py: one row per step, each phase's end and peak; from step one on, the
    memory at the end of every phase is the same step after step (fixed buffers)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pytest.skip("/proc/self/clear_refs is not writable here: the recipe cannot reset the peak")
    out = run_recipe("phase_memory.py", "--engine", "yashard", "--model", "small", "--steps", "3")
    assert "| step | forward end (peak) | backward end (peak) | clip+step+zero_grad end (peak) |" in out
    rows = [[(float(e), float(p)) for e, p in re.findall(r"(-?\d+) \((-?\d+)\)", line)]
            for line in out.splitlines() if re.match(r"^\| \d+ \|", line)]
    assert len(rows) == 3 and all(len(r) == 3 for r in rows), out
    for (e1, _), (e2, _) in zip(rows[1], rows[2]):   # steps 1 and 2: same memory at every phase end
        assert abs(e2 - e1) <= 3, rows


def _saved_weight_decay(out: Path) -> list[float]:
    latest = (out / "checkpoint" / "LATEST").read_text().strip()
    index = json.loads((out / "checkpoint" / latest / "index.json").read_text())
    return [g["hparams"]["weight_decay"] for g in index["optimizer"]["param_groups"]]


def test_resume_with_another_global_batch_and_a_fresh_run_over_a_checkpoint_warn(tmp_path):
    """... and a resumed run applies its own --weight-decay (load_checkpoint restores the saved one)."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    out = tmp_path / "out"
    args = ["--config", str(tmp_path / "config.json"), "--steps", "4", "--eval-every", "0", "--out-dir", str(out),
            "--seq-len", "64", "--max-bytes", "300000", "--save-every", "1"]
    run_recipe("pretrain.py", *args, "--micro-batch", "2", "--stop-at", "1")
    assert _saved_weight_decay(out) == [0.1, 0.0]
    stdout = run_recipe("pretrain.py", *args, "--micro-batch", "1", "--stop-at", "2", "--resume", "true",
                        "--weight-decay", "0.5")
    assert re.search(r"WARNING: the checkpoint was trained with a global batch of 4 sequences, this run uses 2 "
                     r"\(--micro-batch 1 per rank x --accum-steps 1 x world size 2\)", stdout), stdout
    assert "note: --weight-decay 0.5 applies from step 2 on; the checkpoint was trained with 0.1" in stdout, stdout
    assert _saved_weight_decay(out) == [0.5, 0.0]   # what step 2 trained with (the no-decay group stays 0)
    # --freeze that differs from the checkpoint's run (which froze nothing): refused before sharding
    proc = _torchrun(ROOT / "recipes" / "pretrain.py", [*args, "--micro-batch", "1", "--stop-at", "3", "--resume",
                                                        "true", "--freeze", "embed_tokens"])
    assert proc.returncode != 0 and "pretrain.py: error: --freeze embed_tokens does not freeze what the run that " \
        "saved the checkpoint in" in proc.stderr, proc.stderr[-3000:]
    # usage lines, and no traceback of a rank's own (torchrun still prints its agent's)
    assert "ValueError" not in proc.stderr, proc.stderr[-3000:]
    stdout = run_recipe("pretrain.py", *args, "--micro-batch", "2", "--stop-at", "1")
    assert re.search(r"WARNING: .*checkpoint holds a checkpoint and this run starts at step 0 without --resume true",
                     stdout), stdout


def test_fp16_run_scales_the_loss_and_resumes_the_scaler(tmp_path):
    """--param-dtype fp16 trains with ShardedGradScaler; its state is checkpointed, so a run stopped
    and resumed logs bitwise what the uninterrupted one logs and ends with the same scaler state
    (this config overflows at the initial scale: the runs skip a step and back off)."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))

    def run(out, *more):
        run_recipe("pretrain.py", "--config", str(tmp_path / "config.json"), "--steps", "4", "--eval-every", "0",
                   "--out-dir", str(out), "--seq-len", "64", "--max-bytes", "300000", "--save-every", "1",
                   "--param-dtype", "fp16", *more)
        latest = (out / "checkpoint" / "LATEST").read_text().strip()
        extra = json.loads((out / "checkpoint" / latest / "index.json").read_text())["extra"]
        return extra["grad_scaler"], [r["loss"] for r in read_log(out / "log.jsonl")]

    whole, whole_losses = run(tmp_path / "whole")
    assert whole["scale"] < 65536.0 and whole["_growth_tracker"] < 4   # a step was skipped ...
    strict = [json.loads(line, parse_constant=lambda c: pytest.fail(f"log.jsonl holds {c}"))
              for line in (tmp_path / "whole" / "log.jsonl").read_text().splitlines()]
    assert any(r["grad_norm"] is None for r in strict)                  # ... and logged without an inf
    assert len(whole_losses) == 4 and all(math.isfinite(x) for x in whole_losses) and whole_losses[-1] < whole_losses[0]
    run(tmp_path / "cut", "--stop-at", "2")
    resumed, resumed_losses = run(tmp_path / "cut", "--resume", "true")
    assert resumed == whole and resumed_losses == whole_losses


@pytest.mark.parametrize("path,message", [("corpus.csv", r"--data .*corpus\.csv: unsupported file type; pass a \.txt"),
                                          ("missing.txt", r"--data .*missing\.txt: no such file")])
def test_data_option_errors(tmp_path, path, message):
    (tmp_path / "corpus.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=message):
        pretrain.PretrainConfig(data=str(tmp_path / path)).validate()


def test_a_model_folder_without_a_tokenizer_is_refused_and_final_holds_the_runs_own(tmp_path):
    """--model <folder> with no tokenizer trained silently on bytes (ids of another tokenizer's
    tokens); a byte-level run's final/ now says it is byte-level, and final/ holds only its own run's
    tokenizer (an earlier run's, kept by export_hf, went with the model it belonged to)."""
    folder = tmp_path / "model"
    folder.mkdir()
    with pytest.raises(ValueError, match=rf"^--model {re.escape(str(folder))} holds no tokenizer \(no tokenizer\.json, "
                                         r"tokenizer_config\.json or tokenizer\.model\): .* Pass that tokenizer's folder "
                                         r"with --tokenizer, or --tokenizer byte-level if"):
        train.tokenizer_path(None, str(folder))
    assert train.tokenizer_path("byte-level", str(folder)) is None
    assert train.tokenizer_path(str(tmp_path), str(folder)) == str(tmp_path)
    assert train.tokenizer_path(None, None) is None
    train.check_folders(finetune.FinetuneConfig(tokenizer="byte-level"))  # (not a folder: the byte-level choice)
    (folder / "tokenizer.json").write_text("{}")  # an earlier run's tokenizer, kept by export_hf
    (folder / "special_tokens_map.json").write_text("{}")
    train.write_tokenizer(data.ByteTokenizer(), folder)
    assert sorted(p.name for p in folder.iterdir()) == [train.BYTE_TOKENIZER_FILE]
    assert train.tokenizer_path(None, str(folder)) is None
    (folder / "tokenizer_config.json").write_text("{}")
    assert train.tokenizer_path(None, str(folder)) is None  # (the marker is this run's)
    assert train.tokenizer_path(str(folder), None) is None  # --tokenizer <a byte-level final/>: bytes too
    train.check_folders(finetune.FinetuneConfig(tokenizer=str(folder)))


def test_a_resume_refuses_a_checkpoint_an_earlier_run_left(tmp_path):
    """A run started over in the same --out-dir without --resume (and saving nothing: --save-every 0)
    left the earlier run's checkpoint; resuming joined the two runs without a word."""
    out = tmp_path / "out"
    (out / "checkpoint").mkdir(parents=True)
    cfg = finetune.FinetuneConfig(out_dir=str(out), resume=True, steps=8)
    (out / "config.json").write_text(json.dumps({"run": "later", "steps": 8}))
    problem = train.resume_problem(cfg, {"step": 6, "run": "earlier"}, out / "checkpoint")
    assert problem.startswith(f"the checkpoint in {out / 'checkpoint'} (step 6) belongs to an earlier run than the "
                              f"log.jsonl and config.json in {out}: a later run started over"), problem
    assert "Leave out --resume true to start a new run" in problem
    assert train.resume_problem(cfg, {"step": 6, "run": "later"}, out / "checkpoint") is None
    # a checkpoint saved before runs had ids gets one from its save's name, which a run resuming it keeps
    assert train.checkpoint_run({"step": 6}, "save-00000006") == "legacy-save-00000006"
    assert train.resume_problem(cfg, {"step": 6, "run": "legacy-save-00000006"}, out / "checkpoint").startswith(
        "the checkpoint in")
    (out / "config.json").write_text(json.dumps({"steps": 8}))  # (a config.json written before runs had ids)
    assert train.resume_problem(cfg, {"step": 6, "run": "legacy-save-00000006"}, out / "checkpoint") is None


def test_runs_too_short_for_their_warmup_are_told(capsys):
    note = train.schedule_note(finetune.FinetuneConfig(steps=3, warmup_steps=5, lr=2e-3))
    assert note == ("note: --steps 3 ends inside the --warmup-steps 5 warmup: the learning rate never reaches --lr "
                    "0.002 (it ends at 0.0012) and does not decay; lower --warmup-steps")
    assert "leaves no step after the --warmup-steps 5 warmup to decay in" in train.schedule_note(
        finetune.FinetuneConfig(steps=6, warmup_steps=5))
    assert train.schedule_note(finetune.FinetuneConfig(steps=7, warmup_steps=5)) is None


def test_a_random_init_config_takes_the_tokenizers_special_ids(tmp_path):
    """pretrain --config with other BOS/EOS/PAD ids than the tokenizer's: the data carries the
    tokenizer's, and the exported config (and so generate()) said the config's."""
    (tmp_path / "config.json").write_text(json.dumps({**TINY_CONFIG, "bos_token_id": 1, "eos_token_id": 2,
                                                       "pad_token_id": None}))
    notes = []
    model = train.build_model(pretrain.PretrainConfig(config=str(tmp_path), seq_len=64), data.ByteTokenizer(),
                              note=notes.append)
    assert (model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id) == (257, 258, 256)
    assert notes == [f"note: --config {tmp_path}: bos_token_id 1 -> 257, eos_token_id 2 -> 258, pad_token_id None "
                     "-> 256, the tokenizer's, which the training data uses (final/config.json says so)"]


def test_errors_in_what_a_run_was_given_are_usage_errors(tmp_path):
    """Checks that need the files (data, folders, checkpoints) ran after the process group started
    and printed a traceback from every rank; they end as a usage error. recipes/train.py, which is
    no recipe, says what to run."""
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "finetune.py"), "--data", str(one), "--out-dir",
                           str(tmp_path / "out")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"finetune.py: error: {one} has only 1 example: at least 2 are needed" in proc.stderr, proc.stderr
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "train.py"), "--help"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "train.py is the training loop the recipes share, not a recipe: run " \
        "recipes/finetune.py or recipes/pretrain.py" in proc.stderr, proc.stderr


def test_a_16_bit_model_folder_trained_in_fp32_is_noted(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**TINY_CONFIG, "dtype": "bfloat16"}))
    notes = []
    train.build_model(finetune.FinetuneConfig(model=str(tmp_path)), data.ByteTokenizer(), note=notes.append)
    assert notes == [f"note: --model {tmp_path} stores torch.bfloat16 weights; this run computes in fp32 "
                     "(--param-dtype fp32) and exports fp32 to final/ (twice the size): pass --param-dtype bf16 to "
                     "keep torch.bfloat16"]
    notes.clear()
    train.build_model(finetune.FinetuneConfig(model=str(tmp_path), param_dtype="bf16"), data.ByteTokenizer(),
                      note=notes.append)
    assert notes == []


def test_a_checkpoint_saved_before_runs_had_ids_resumes_again_under_its_derived_id(tmp_path):
    """A checkpoint without a run id gets one from its save's name, which the run resuming it writes to
    config.json; resumed once more before its next save, setup compared config.json's id with the
    checkpoint's missing one and refused its own run."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    out = tmp_path / "out"
    args = ["--config", str(tmp_path / "config.json"), "--steps", "3", "--eval-every", "0", "--out-dir", str(out),
            "--seq-len", "64", "--max-bytes", "300000", "--micro-batch", "2"]
    run_recipe("pretrain.py", *args, "--stop-at", "1")
    latest = (out / "checkpoint" / "LATEST").read_text().strip()
    index_path = out / "checkpoint" / latest / "index.json"
    index = json.loads(index_path.read_text())
    del index["extra"]["run"]  # (as saved before runs had ids)
    index_path.write_text(json.dumps(index))
    config = json.loads((out / "config.json").read_text())
    config["run"] = train.checkpoint_run(index["extra"], index.get("save") or latest)  # (a resume of it wrote this)
    (out / "config.json").write_text(json.dumps(config))
    stdout = run_recipe("pretrain.py", *args, "--stop-at", "2", "--resume", "true")
    assert "resumed from" in stdout and "after step 1" in stdout, stdout
