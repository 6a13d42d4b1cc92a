"""Sharded checkpoints (save, resume, reshard, crash safety, errors) and the HuggingFace export.

Multi-process parts run each rank through ``harness._entry`` (gloo, CPU), started from a forkserver
that imported torch/transformers once (``harness.run_distributed``); a module-scoped fixture trains the
uninterrupted W=2 reference once (Llama, tied Llama, Qwen2 with biases), saving at steps 2 and 3 and
exporting at the end; resumed runs are compared with it. Error paths and single-rank round trips
use a 1-rank gloo group in this process.
"""

import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import yashard
from yashard import comm_hooks
from ckpt_workers import (DCP_MODELS, persistent_buffers_travel, load_different_checkpoints, load_while_a_save_commits, dcp_optimizer_scalars, optimizer_state_dict_misuse, save_misuse, EXPORT_LIMIT, dcp_async_save, dcp_load, dcp_load_named, dcp_save,
                          dcp_train_resume, fsdp2_dcp, fsdp2_train_save_continue, run_segments, save_then_killed_save,
                          segment, yashard_load_continue)
from harness import run_distributed as launch, run_until_exit
from models import batches, build
from workers import rel_err
from yashard._io import StreamedSafetensors, exchange_dirs, sniff_foreign_format
from yashard.checkpoint import (CheckpointError, check_extra, coverage_problem, decode_value, describe_params,
                                encode_value, overlaps, params_diff)
from yashard.checkpoint.load import _plan_reads
from yashard.hf_export import parse_size, plan_files, stored_names
from yashard.layout import build_layout, shard_pieces

FAMILIES = {
    "llama": dict(family="llama"),
    "llama_tied": dict(family="llama", overrides={"tie_word_embeddings": True}),
    "qwen2": dict(family="qwen2"),
}


# ------------------------------------------------------------------------------------------------
# Pure helpers


def test_overlaps_and_coverage():
    pieces = [(0, 10), (10, 25), (25, 30)]
    assert overlaps(pieces, 5, 12) == [(0, 5, 10), (1, 10, 12)]
    assert overlaps(pieces, 10, 25) == [(1, 10, 25)]
    assert overlaps(pieces, 30, 30) == []
    assert coverage_problem(30, pieces) is None
    assert coverage_problem(30, [(10, 25), (0, 10), (25, 30)]) is None   # any order
    assert coverage_problem(30, [(0, 10), (12, 30)]) == "elements [10, 12) are in no piece"
    assert coverage_problem(30, [(0, 12), (10, 30)]) == "pieces overlap at [10, 12)"
    assert coverage_problem(30, [(0, 29)]) == "elements [29, 30) are in no piece"
    assert coverage_problem(30, [(0, 31)]) == "piece [0, 31) is outside [0, 30)"


def test_params_diff_names_both_sides():
    ck = describe_params({"a": {"shape": [2, 3], "tied": ["b"]}, "c": {"shape": [4]}})
    assert ck == {"a": "shape (2, 3)", "b": "tied to a", "c": "shape (4,)"}
    mine = describe_params({"a": {"shape": [2, 4]}, "b": {"shape": [2, 3]}, "d": {"shape": [1]}})
    assert params_diff(ck, mine) == [
        "a: checkpoint shape (2, 3), model shape (2, 4)",
        "b: checkpoint tied to a, model shape (2, 3)",
        "c: in the checkpoint (shape (4,)), not in the model",
        "d: in the model (shape (1,)), not in the checkpoint",
    ]
    assert params_diff(ck, mine, limit=2)[-1] == "... and 2 more"
    assert params_diff(ck, ck) == []


def test_encode_decode_round_trip():
    values = [None, True, 3, 1e-3, float("inf"), "x", (0.9, 0.999), [1, (2, 3)], {"k": torch.tensor(2.5)},
              torch.tensor(7.0), torch.tensor(3, dtype=torch.int64), torch.tensor(1.5, dtype=torch.bfloat16)]
    for v in values:
        enc = encode_value(v, "v")
        back = decode_value(json.loads(json.dumps(enc)))
        if isinstance(v, torch.Tensor):
            assert back.dtype == v.dtype and torch.equal(back, v)
        elif isinstance(v, dict):
            assert torch.equal(back["k"], v["k"])
        else:
            assert back == v and type(back) is type(v)
    with pytest.raises(TypeError, match=r"opt\['f'\] is a function, which a yashard checkpoint cannot store"):
        encode_value(lambda: 0, "opt['f']")
    with pytest.raises(TypeError, match=r"s is a \(3,\) tensor, which a yashard checkpoint cannot store"):
        encode_value(torch.zeros(3), "s")


def test_check_extra():
    assert check_extra({"step": 3, "sched": {"last_epoch": 2, "base_lrs": (1e-3,)}}) == \
        {"step": 3, "sched": {"last_epoch": 2, "base_lrs": [1e-3]}}   # tuples come back as lists
    with pytest.raises(TypeError, match=r"must be JSON-serialisable: extra\['loss'\] is a Tensor \(use \.item\(\) or \.tolist\(\)\)"):
        check_extra({"loss": torch.tensor(1.0)})
    with pytest.raises(TypeError, match=r"must be JSON-serialisable: extra\['a'\] has the non-string key 1; use string keys"):
        check_extra({"a": {1: 2}})
    with pytest.raises(TypeError, match=r"extra\[0\] is a set"):
        check_extra([{1, 2}])


def test_streamed_safetensors_reads_back(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(5, generator=g), "b/c[0:3]": torch.randn(2, 3, generator=g).bfloat16(),
               "empty": torch.zeros(0), "i": torch.arange(7), "h": torch.randn(3, generator=g).half()}
    w = StreamedSafetensors(tmp_path / "x.safetensors", [(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()],
                            metadata={"format": "pt"})
    for k, t in tensors.items():
        w.write(k, t)
    w.close()
    assert (tmp_path / "x.safetensors").stat().st_size == w.nbytes
    back = load_file(str(tmp_path / "x.safetensors"))
    assert set(back) == set(tensors) and all(torch.equal(back[k], t) for k, t in tensors.items())
    with safe_open(str(tmp_path / "x.safetensors"), "pt") as h:
        assert h.metadata() == {"format": "pt"}
    w = StreamedSafetensors(tmp_path / "y.safetensors", [("a", torch.float32, (2,)), ("b", torch.float32, (2,))])
    with pytest.raises(ValueError, match=r"tensor 0 must be 'a' torch.float32 \(2,\), got 'b'"):
        w.write("b", torch.zeros(2))
    w.write("a", torch.zeros(2))
    with pytest.raises(ValueError, match=r"only 1 of 2 declared tensors were written"):
        w.close()


def test_exchange_dirs_and_sniffing(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "x").write_text("a")
    (tmp_path / "b" / "x").write_text("b")
    if exchange_dirs(tmp_path / "a", tmp_path / "b"):
        assert (tmp_path / "a" / "x").read_text() == "b" and (tmp_path / "b" / "x").read_text() == "a"
    torch.save({"x": 1}, tmp_path / "t.pt")
    (tmp_path / "p.pkl").write_bytes(pickle.dumps({"x": 1}, protocol=4))
    save_file({"x": torch.zeros(1)}, str(tmp_path / "s.safetensors"))
    assert sniff_foreign_format(tmp_path / "t.pt").startswith("a zip archive")
    assert sniff_foreign_format(tmp_path / "p.pkl") == "a pickle file"
    assert sniff_foreign_format(tmp_path / "s.safetensors") is None


def test_plan_reads_reassembles_every_shard_at_every_world_size():
    """Saved at W_s, loaded at W_l: the planned reads rebuild each rank's shard exactly, touching only
    the files whose saved shard overlaps it."""
    shapes = [("a", (7, 5)), ("b", (11,)), ("c", (3, 4)), ("d", (1,))]
    g = torch.Generator().manual_seed(0)
    values = {n: torch.randn(*shape, generator=g).flatten() for n, shape in shapes}
    for w_save in range(1, 5):
        saved = build_layout(shapes, w_save, shard_align=4)
        params = {n: {"shape": list(shape), "pieces": []} for n, shape in shapes}
        stored = {}
        for r in range(w_save):
            for pc in shard_pieces(saved, r):
                n = shapes[pc.entry][0]
                key = f"master/{n}[{pc.entry_start}:{pc.entry_end}]"
                params[n]["pieces"].append({"file": f"f{r}", "lo": pc.entry_start, "hi": pc.entry_end, "keys": {"master": key}})
                stored[key] = values[n][pc.entry_start:pc.entry_end]
        for w_load in range(1, 5):
            layout = build_layout(shapes, w_load, shard_align=2)
            flat = torch.zeros(layout.padded)
            for e, (n, _) in zip(layout.entries, shapes):
                flat[e.offset:e.end] = values[n]
            unit = SimpleNamespace(name="u", layout=layout, fqns=[[n] for n, _ in shapes])
            for r in range(w_load):
                reads = _plan_reads({"params": params}, SimpleNamespace(units=[unit]), r)["u"]
                shard = torch.zeros(layout.shard_numel)
                for rd in reads:
                    assert rd.piece_numel == stored[rd.keys["master"]].numel()
                    shard[rd.dst:rd.dst + rd.b - rd.a] = stored[rd.keys["master"]][rd.a:rd.b]
                s0, s1 = layout.shard_range(r)
                assert torch.equal(shard, flat[s0:s1]), (w_save, w_load, r)
                touched = {rd.file for rd in reads}
                needed = set()
                for e, (n, _) in zip(layout.entries, shapes):
                    lo, hi = max(e.offset, s0) - e.offset, min(e.end, s1) - e.offset
                    needed |= {pc["file"] for pc in params[n]["pieces"] if pc["lo"] < hi and lo < pc["hi"]}
                assert touched == needed


def test_stored_names_keep_the_input_embedding():
    fqns = [["model.embed_tokens.weight", "lm_head.weight"], ["model.norm.weight"]]
    assert stored_names(fqns, "model.embed_tokens.weight") == ["model.embed_tokens.weight", "model.norm.weight"]
    assert stored_names([["lm_head.weight", "model.embed_tokens.weight"]], "model.embed_tokens.weight") == \
        ["model.embed_tokens.weight"]


def test_export_files_are_packed_up_to_the_limit():
    assert plan_files([4, 4, 4], 8) == [0, 0, 1]
    assert plan_files([4, 4, 4], 12) == [0, 0, 0]
    assert plan_files([3, 20, 3, 3], 8) == [0, 1, 2, 2]     # a tensor over the limit: a file of its own
    assert plan_files([20], 8) == [0]
    assert plan_files([0, 8, 0, 1], 8) == [0, 0, 0, 1]


def test_export_size_strings():
    assert parse_size(1234) == 1234
    assert parse_size("5GB") == 5 * 10**9 and parse_size("50gb") == 50 * 10**9
    assert parse_size("2GiB") == 2 * 2**30 and parse_size("500 MiB") == 500 * 2**20
    assert parse_size("1.5MB") == 1_500_000 and parse_size("64KB") == 64_000 and parse_size("7") == 7
    for bad in ("5 gigabytes", "GB", "-1GB", ""):
        with pytest.raises(ValueError, match=r"max_shard_size=.* is not a size; write bytes as an int or a string like"):
            parse_size(bad)
    with pytest.raises(ValueError, match=r"max_shard_size=0 must be positive"):
        parse_size(0)
    with pytest.raises(TypeError, match=r"max_shard_size must be an int \(bytes\) or a string like '5GB', got float"):
        parse_size(5e9)


# ------------------------------------------------------------------------------------------------
# Multi-process: resume, reshard, export


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted W=2 run of every family, saving at steps 2 and 3, exporting at the end."""
    root = tmp_path_factory.mktemp("straight")
    segs = {name: segment(**fam, saves={2: str(root / name / "ck2"), 3: str(root / name / "ck3")},
                          export=str(root / name / "hf"))
            for name, fam in FAMILIES.items()}
    results = launch(run_segments, 2, list(segs.values()))
    return {name: (segs[name], res) for name, res in zip(segs, results[0])}


def test_resume_at_the_same_world_size_is_bitwise(straight):
    segs = [segment(**FAMILIES[name], start=3, load=s["saves"][3]) for name, (s, _) in straight.items()]
    resumed = launch(run_segments, 2, segs)[0]
    for (name, (_, ref)), res in zip(straight.items(), resumed):
        assert res["losses"] == ref["losses"][3:], name
        assert set(res["params"]) == set(ref["params"])
        assert all(torch.equal(res["params"][k], ref["params"][k]) for k in ref["params"]), name


def _assert_close(got: dict, ref: dict, name: str):
    assert set(got) == set(ref)
    flat_got = torch.cat([got[k].flatten() for k in sorted(ref)])
    flat_ref = torch.cat([ref[k].flatten() for k in sorted(ref)])
    assert rel_err(flat_got, flat_ref) < 1e-5, (name, rel_err(flat_got, flat_ref))
    for k in ref:  # biases start at zero, so their relative rounding noise is larger (see test_parity.py)
        assert rel_err(got[k], ref[k]) < (1e-3 if k.endswith("bias") else 1e-5), (name, k, rel_err(got[k], ref[k]))


def test_reshard_2_to_3_to_1(straight, tmp_path):
    names = list(straight)
    w3 = launch(run_segments, 3, [
        segment(**FAMILIES[n], start=2, stop=4, load=straight[n][0]["saves"][2], saves={4: str(tmp_path / n)})
        for n in names])[0]
    w1 = launch(run_segments, 1, [
        segment(**FAMILIES[n], start=4, stop=6, load=str(tmp_path / n)) for n in names])[0]
    for n, a, b in zip(names, w3, w1):
        ref = straight[n][1]
        got = a["losses"] + b["losses"]
        assert max(abs(x - y) / abs(y) for x, y in zip(got, ref["losses"][2:])) < 1e-5, (n, got, ref["losses"])
        _assert_close(b["params"], ref["params"], n)
        index = json.loads(next((tmp_path / n).glob("save-*/index.json")).read_text())
        assert index["shard_world"] == 3 and len(index["files"]) == 3


_LOAD_SCRIPT = """
import json, sys, torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM
out = {}
for name, path, ids in json.loads(sys.argv[1]):
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], (name, info)
    if name.endswith("-bf16"):   # the bf16 export (one model.safetensors), run in fp32 on its bf16 weights
        model = model.float()
    assert model.dtype == torch.float32, model.dtype
    with torch.no_grad():
        out[name] = model.eval()(input_ids=torch.tensor(ids)).logits.contiguous()
assert "yashard" not in sys.modules
save_file(out, sys.argv[2])
"""


def test_export_loads_with_from_pretrained(straight, tmp_path):
    jobs = [(name + sfx, s["export"] + sfx, res["input_ids"].tolist()) for name, (s, res) in straight.items()
            for sfx in ("", "-bf16")]
    out = tmp_path / "logits.safetensors"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}   # plain transformers, no yashard
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([sys.executable, "-c", _LOAD_SCRIPT, json.dumps(jobs), str(out)], capture_output=True,
                          text=True, env=env, timeout=180, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    logits = load_file(str(out))
    for name, (s, res) in straight.items():
        assert rel_err(logits[name], res["logits"]) < 1e-5, (name, rel_err(logits[name], res["logits"]))
        assert 1e-5 < rel_err(logits[name + "-bf16"], res["logits"]) < 2e-2, rel_err(logits[name + "-bf16"], res["logits"])
        path = Path(s["export"])
        index = json.loads((path / "model.safetensors.index.json").read_text())
        files = sorted(set(index["weight_map"].values()))
        assert len(files) > 2 and files == [f"model-{i:05d}-of-{len(files):05d}.safetensors"
                                            for i in range(1, len(files) + 1)]
        assert sorted(p.name for p in path.glob("*.safetensors")) == files
        stored, layers_in = {}, []
        for f in files:
            part = load_file(str(path / f))
            nbytes = sum(t.numel() * t.element_size() for t in part.values())
            assert nbytes <= EXPORT_LIMIT or len(part) == 1, (f, nbytes)   # only a lone tensor may exceed it
            layers_in.append({k.split(".")[2] for k in part if k.startswith("model.layers.")})
            stored.update(part)
        assert any(len(names) > 1 for names in layers_in)   # files are packed across unit boundaries
        assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in stored.values())
        assert set(stored) == set(index["weight_map"])
        assert all(index["weight_map"][k] == f for f in files for k in load_file(str(path / f)))
        params = res["params"]
        if name == "llama_tied":
            assert "lm_head.weight" not in stored and "lm_head.weight" in params
        else:
            assert set(stored) == set(params)
        assert all(torch.equal(stored[k], params[k]) for k in stored)   # the trained weights, bitwise
        # bf16 export: every tensor is the fp32 weight rounded to bf16, and the config says so
        bf = Path(s["export"] + "-bf16")   # under the default max_shard_size: one file, no index, as HF writes it
        assert sorted(p.name for p in bf.iterdir() if "safetensors" in p.name) == ["model.safetensors"]
        bf_stored = load_file(str(bf / "model.safetensors"))
        assert set(bf_stored) == set(stored)
        assert all(torch.equal(bf_stored[k], stored[k].bfloat16()) for k in stored)
        assert json.loads((bf / "config.json").read_text())["dtype"] == "bfloat16"
        assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]   # no temp leftovers


def test_export_loads_back_into_a_sharded_run(straight):
    """export_hf -> yashard.from_pretrained at another world size: the same weights, bitwise."""
    from loading_workers import shard_folder

    for name, (s, res) in straight.items():
        for got in launch(shard_folder, 3, s["export"], True):
            assert set(got["params"]) == set(res["params"]), name
            assert all(torch.equal(got["params"][k], res["params"][k]) for k in res["params"]), name


# ------------------------------------------------------------------------------------------------
# Single-rank process group in this process


def _trained(family="llama", steps=2, opt_cls=torch.optim.AdamW, seed=0, **kw):
    overrides = kw.pop("overrides", {})
    sm = yashard.shard(build(family, seed=seed, **overrides))
    opt = opt_cls(sm.param_groups(0.1), lr=1e-2, **kw)
    for x in batches(steps, 2, 8, 96, seed=seed + 1):
        sm(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    return sm, opt


def _fresh(family="llama", opt_cls=torch.optim.AdamW, seed=5, **kw):
    overrides = kw.pop("overrides", {})
    sm = yashard.shard(build(family, seed=seed, **overrides))
    return sm, opt_cls(sm.param_groups(0.0), lr=0.5, **kw)


@pytest.mark.parametrize("opt_cls,kw,keys", [
    (torch.optim.AdamW, {"amsgrad": True, "betas": (0.8, 0.95)}, {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}),
    (torch.optim.SGD, {"momentum": 0.9, "nesterov": True}, {"momentum_buffer"}),
])
def test_optimizer_state_round_trip(pg, tmp_path, opt_cls, kw, keys):
    sm, opt = _trained(opt_cls=opt_cls, **kw)
    yashard.save_checkpoint(tmp_path / "ck", sm, opt, extra={"step": 2})
    sm2, opt2 = _fresh(opt_cls=opt_cls, **({"momentum": 0.1} if opt_cls is torch.optim.SGD else {}))
    masters = [u.master for u in sm2.runtime.units]
    assert yashard.load_checkpoint(tmp_path / "ck", sm2, opt2) == {"step": 2}
    assert [u.master for u in sm2.runtime.units] == masters                    # same Parameter objects
    assert all(p is q for p, q in zip(masters, (p for g in opt2.param_groups for p in g["params"])))
    for g, g2 in zip(opt.param_groups, opt2.param_groups):
        assert {k: v for k, v in g.items() if k != "params"} == {k: v for k, v in g2.items() if k != "params"}
    for u, u2 in zip(sm.runtime.units, sm2.runtime.units):
        assert torch.equal(u.master, u2.master)
        st, st2 = opt.state[u.master], opt2.state[u2.master]
        assert set(st2) == keys
        for k in keys:
            assert torch.equal(st[k], st2[k]) and st[k].dtype == st2[k].dtype, k
    for m, o in ((sm, opt), (sm2, opt2)):   # one more step on both: bitwise the same
        x = batches(1, 2, 8, 96, seed=9)[0]
        m(input_ids=x, labels=x).loss.backward()
        o.step()
    assert all(torch.equal(u.master, u2.master) for u, u2 in zip(sm.runtime.units, sm2.runtime.units))


def test_load_without_optimizer_and_save_without_optimizer(pg, tmp_path):
    sm, opt = _trained()
    yashard.save_checkpoint(tmp_path / "a", sm, opt)
    sm2, _ = _fresh()
    assert yashard.load_checkpoint(tmp_path / "a", sm2) is None
    assert all(torch.equal(u.master, u2.master) for u, u2 in zip(sm.runtime.units, sm2.runtime.units))
    yashard.save_checkpoint(tmp_path / "b", sm)
    sm3, opt3 = _fresh()
    with pytest.raises(CheckpointError, match=r"holds no optimizer state \(it was saved without an optimizer\); "
                                              r"call load_checkpoint\(path, model\) without one"):
        yashard.load_checkpoint(tmp_path / "b", sm3, opt3)


def test_a_new_save_replaces_the_old_and_keeps_one_directory(pg, tmp_path):
    sm, opt = _trained()
    first = yashard.save_checkpoint(tmp_path / "ck", sm, opt, extra={"step": 2})
    x = batches(1, 2, 8, 96, seed=3)[0]
    sm(input_ids=x, labels=x).loss.backward()
    opt.step()
    second = yashard.save_checkpoint(tmp_path / "ck", sm, opt, extra={"step": 3})
    assert sorted(os.listdir(tmp_path / "ck")) == ["LATEST", second.name] and second.name != first.name
    assert (tmp_path / "ck" / "LATEST").read_text().strip() == second.name
    sm2, opt2 = _fresh()
    assert yashard.load_checkpoint(tmp_path / "ck", sm2, opt2) == {"step": 3}
    assert yashard.load_checkpoint(second, sm2, opt2) == {"step": 3}   # a save directory itself also loads
    assert all(torch.equal(u.master, u2.master) for u, u2 in zip(sm.runtime.units, sm2.runtime.units))


# ------------------------------------------------------------------------------------------------
# Killed saves


@pytest.mark.parametrize("victim,how", [(1, "shard"), (0, "pointer")])
def test_killed_save_leaves_the_previous_checkpoint(pg, tmp_path, victim, how):
    s = segment(family="llama")
    path, ref, marker = tmp_path / "ck", tmp_path / "ref.safetensors", tmp_path / "killed.txt"
    out = run_until_exit(save_then_killed_save, 2, s, str(path), str(ref), str(marker), victim, how)
    assert marker.exists(), out                      # the kill happened where intended ...
    assert out[victim][0] == 1 and out[victim][1] is None, out
    assert all(rep is None or not rep[0] for _, rep in out.values()), out   # ... and no rank finished the save
    saves = sorted(p.name for p in path.iterdir() if p.name.startswith("save-"))
    committed = (path / "LATEST").read_text().strip()
    assert len(saves) == 2 and committed == saves[0], (saves, committed)
    partial = path / saves[1]
    if how == "shard":
        assert "while writing" in marker.read_text() and not (partial / "index.json").exists()
        with pytest.raises(CheckpointError, match=r"is an incomplete save \(no index\.json\): the save that wrote it "
                                                  r"was interrupted before it committed, so it is never loaded"):
            yashard.load_checkpoint(partial, yashard.shard(build("llama")))
    else:
        assert (partial / "index.json").exists() and list(path.glob(".LATEST.tmp-*"))

    # The previous checkpoint loads (here at W=1), bitwise the weights it was saved with.
    sm, opt = _fresh()
    assert yashard.load_checkpoint(path, sm, opt) == {"step": 1}
    full = sm.full_state_dict()
    expected = load_file(str(ref))
    assert set(full) == set(expected) and all(torch.equal(full[k], expected[k]) for k in expected)
    # The next save commits and clears the leftovers.
    new = yashard.save_checkpoint(path, sm, opt, extra={"step": 1})
    assert sorted(os.listdir(path)) == ["LATEST", new.name]


# ------------------------------------------------------------------------------------------------
# Errors


@pytest.fixture
def saved(pg, tmp_path):
    sm, opt = _trained()
    save_dir = yashard.save_checkpoint(tmp_path / "ck", sm, opt, extra={"step": 2})
    return tmp_path / "ck", save_dir


def test_error_path_missing(pg, tmp_path):
    with pytest.raises(CheckpointError, match=r"checkpoint path .*nope does not exist"):
        yashard.load_checkpoint(tmp_path / "nope", _fresh()[0])


def test_error_not_a_checkpoint(pg, tmp_path):
    sm = _fresh()[0]
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"empty is not a yashard checkpoint \(no LATEST or index\.json in it\)"):
        yashard.load_checkpoint(tmp_path / "empty", sm)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"it looks like a HuggingFace model folder: load it with from_pretrained"):
        yashard.load_checkpoint(tmp_path / "hf", sm)
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match=r"checkpoint path .*file is a file; pass the directory given to save_checkpoint"):
        yashard.load_checkpoint(tmp_path / "file", sm)


def test_error_interrupted_first_save(saved):
    root, save_dir = saved
    (root / "LATEST").unlink()
    (save_dir / "index.json").unlink()
    with pytest.raises(CheckpointError, match=rf"ck holds no committed checkpoint: no LATEST file, only the interrupted "
                                              rf"save\(s\) {save_dir.name}"):
        yashard.load_checkpoint(root, _fresh()[0])
    with pytest.raises(CheckpointError, match=r"is an incomplete save \(no index\.json\)"):
        yashard.load_checkpoint(save_dir, _fresh()[0])


def test_error_pointer_damaged(saved):
    root, save_dir = saved
    (root / "LATEST").write_text("../../etc\n")
    with pytest.raises(CheckpointError, match=r"LATEST is corrupt: it should name a save-<n>-<hex> directory, it holds '\.\./\.\./etc'"):
        yashard.load_checkpoint(root, _fresh()[0])
    (root / "LATEST").write_text("save-000009-0123abcd\n")
    with pytest.raises(CheckpointError, match=r"LATEST names save-000009-0123abcd, but .*index\.json is missing"):
        yashard.load_checkpoint(root, _fresh()[0])


def test_error_index_damaged(saved):
    root, save_dir = saved
    index = json.loads((save_dir / "index.json").read_text())
    (save_dir / "index.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"index\.json is not a readable JSON index"):
        yashard.load_checkpoint(root, _fresh()[0])
    (save_dir / "index.json").write_text(json.dumps({**index, "format_version": 99}))
    with pytest.raises(CheckpointError, match=r"has format_version 99, written by yashard 0\.1\.0; this yashard reads "
                                              r"format_version <= 3: upgrade yashard"):
        yashard.load_checkpoint(root, _fresh()[0])
    bad = json.loads(json.dumps(index))
    bad["params"]["model.norm.weight"]["pieces"][0]["lo"] = 1
    (save_dir / "index.json").write_text(json.dumps(bad))
    with pytest.raises(CheckpointError, match=r"the pieces of model\.norm\.weight do not cover it \(elements \[0, 1\) are "
                                              r"in no piece\); the index is damaged"):
        yashard.load_checkpoint(root, _fresh()[0])


def test_checkpoint_buffers_are_checked_and_older_saves_keep_the_models(pg, tmp_path):
    """A stored buffer is checked like a piece (its CRC-32, the model's buffers against the
    checkpoint's, naming both sides); a format-1 save, which stored no buffers, loads and leaves the
    model's own."""
    sm = yashard.shard(build("deepseek_v3", seed=3))
    name, bias = next((n, b) for n, b in sm.module.named_buffers() if n.endswith("e_score_correction_bias"))
    with torch.no_grad():
        bias.fill_(2.0)
    save_dir = yashard.save_checkpoint(tmp_path / "ck", sm)
    index = json.loads((save_dir / "index.json").read_text())
    old = {k: v for k, v in index.items() if k != "buffers"}
    (save_dir / "index.json").write_text(json.dumps({**old, "format_version": 1}))
    with torch.no_grad():
        bias.fill_(5.0)
    yashard.load_checkpoint(tmp_path / "ck", sm)
    assert torch.equal(bias, torch.full_like(bias, 5.0))
    wrong = json.loads(json.dumps(index))
    wrong["buffers"][name]["shape"] = [7]
    (save_dir / "index.json").write_text(json.dumps(wrong))
    with pytest.raises(CheckpointError, match=rf"{re.escape(name)}: checkpoint buffer of shape \(7,\), model buffer "
                                              r"of shape \(4,\)"):
        yashard.load_checkpoint(tmp_path / "ck", sm)
    wrong = json.loads(json.dumps(index))
    wrong["buffers"][name]["crc32"] ^= 1
    (save_dir / "index.json").write_text(json.dumps(wrong))
    with pytest.raises(CheckpointError, match=rf"tensor 'buffer/{re.escape(name)}' do not match the checksum the save "
                                              "recorded"):
        yashard.load_checkpoint(tmp_path / "ck", sm)
    assert torch.equal(bias, torch.full_like(bias, 5.0))   # checked before anything was modified
    wrong = json.loads(json.dumps(index))
    wrong["buffers"][name]["file"] = "shard-00009-of-00010.safetensors"
    (save_dir / "index.json").write_text(json.dumps(wrong))
    with pytest.raises(CheckpointError, match=rf"buffer {re.escape(name)} is in 'shard-00009-of-00010\.safetensors', "
                                              "which the index does not list"):
        yashard.load_checkpoint(tmp_path / "ck", sm)
    wrong = json.loads(json.dumps(index))
    wrong["buffers"][name]["key"] = "buffer/elsewhere"
    (save_dir / "index.json").write_text(json.dumps(wrong))
    with pytest.raises(CheckpointError, match=r"lacks the tensor 'buffer/elsewhere' its index lists; it is damaged"):
        yashard.load_checkpoint(tmp_path / "ck", sm)
    wrong = json.loads(json.dumps(index))
    wrong["buffers"][name]["dtype"] = "float16"
    (save_dir / "index.json").write_text(json.dumps(wrong))
    with pytest.raises(CheckpointError, match=rf"tensor 'buffer/{re.escape(name)}' is torch\.float32 \[4\], the index "
                                              r"expects float16 \[4\]; the file is damaged"):
        yashard.load_checkpoint(tmp_path / "ck", sm)
    (save_dir / "index.json").write_text(json.dumps(index))
    yashard.load_checkpoint(tmp_path / "ck", sm)
    assert torch.equal(bias, torch.full_like(bias, 2.0))
    sm.module.model.layers[0].register_buffer("phase", torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(TypeError, match=r"buffer model\.layers\.0\.phase has dtype torch\.complex64, which a yashard "
                                        r"checkpoint \(safetensors\) cannot store"):
        yashard.save_checkpoint(tmp_path / "ck", sm)


@pytest.mark.parametrize("family,overrides,expected", [
    ("llama", {"intermediate_size": 48},
     r"model\.layers\.0\.mlp\.down_proj\.weight: checkpoint shape \(32, 64\), model shape \(32, 48\)"),
    ("llama", {"tie_word_embeddings": True},
     r"lm_head\.weight: checkpoint shape \(96, 32\), model tied to model\.embed_tokens\.weight"),
    ("qwen2", {}, r"model\.layers\.0\.self_attn\.k_proj\.bias: in the model \(shape \(16,\)\), not in the checkpoint"),
    ("llama", {"num_hidden_layers": 3},
     r"model\.layers\.3\.input_layernorm\.weight: in the checkpoint \(shape \(32,\)\), not in the model"),
])
def test_error_model_mismatch(saved, family, overrides, expected):
    root, _ = saved
    sm, opt = _fresh(family, overrides=overrides)
    before = [u.master.clone() for u in sm.runtime.units]
    with pytest.raises(CheckpointError, match=r"does not match the model: the checkpoint holds \d+ parameters of a "
                                              r"LlamaForCausalLM \(LlamaConfig\), the model has \d+") as ei:
        yashard.load_checkpoint(root, sm, opt)
    assert any(__import__("re").search(expected, line) for line in str(ei.value).splitlines()), str(ei.value)
    assert "Build the model from the config the checkpoint was saved with" in str(ei.value)
    assert all(torch.equal(a, u.master) for a, u in zip(before, sm.runtime.units))   # nothing modified


def test_loading_into_a_model_configured_otherwise_warns(saved, caplog):
    """Same parameters, another activation and norm epsilon: the weights load, and the log names
    what differs (the model would compute something else than the one that was trained)."""
    root, _ = saved
    sm, _ = _fresh(overrides={"hidden_act": "relu", "rms_norm_eps": 0.5})
    with caplog.at_level("WARNING", logger="yashard"):
        yashard.load_checkpoint(root, sm)
    msgs = [r.getMessage() for r in caplog.records if "configured otherwise" in r.getMessage()]
    assert len(msgs) == 1 and "hidden_act: 'silu' -> 'relu'; rms_norm_eps: 1e-06 -> 0.5" in msgs[0], msgs
    caplog.clear()
    with caplog.at_level("WARNING", logger="yashard"):
        yashard.load_checkpoint(root, _fresh()[0])
    assert not [r for r in caplog.records if "configured otherwise" in r.getMessage()]


def test_error_missing_rank_file(saved):
    root, save_dir = saved
    (save_dir / "shard-00000-of-00001.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"is missing shard-00000-of-00001\.safetensors \(written by shard rank 0 "
                                              r"of 1\); restore that file or load an earlier checkpoint"):
        yashard.load_checkpoint(root, _fresh()[0])


def test_ranks_that_find_different_saves_all_load_the_newest(tmp_path):
    """Each rank follows LATEST on its own: a save committing while the ranks read it made them load
    two different complete saves, silently. They now agree on the newest, with a warning."""
    out = launch(load_while_a_save_commits, 2, str(tmp_path / "ck"))
    for r in out:
        assert r["extra"] == {"step": 2} and r["same"], r
    old, new = out[0]["old"], out[0]["new"]
    assert [m for m in out[0]["warned"] if f"found different committed saves under {tmp_path / 'ck'} ({old}, {new})"
            in m and m.endswith(f"every rank loads the newest, {new}")], out[0]["warned"]
    assert not out[1]["warned"]  # (said once, by rank 0)


def test_a_save_removed_by_a_newer_save_while_loading_says_so(saved, monkeypatch):
    root, save_dir = saved
    agreed = yashard.checkpoint.load._agreed_save(_fresh()[0].runtime.comm, root)  # LATEST and the index read first ...
    monkeypatch.setattr(yashard.checkpoint.load, "_agreed_save", lambda comm, path: agreed)
    (root / "LATEST").write_text("save-000009-0123abcd\n")  # ... then a newer save commits and removes this one
    (save_dir / "shard-00000-of-00001.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"lost shard-00000-of-00001\.safetensors while it was being loaded: a "
                                              r"save_checkpoint into .* committed save-000009-0123abcd meanwhile and "
                                              r"removed this save; load .*ck again \(its LATEST names save-000009"):
        yashard.load_checkpoint(root, _fresh()[0])
    monkeypatch.undo()
    # loading that save directory by name, the file is simply missing
    with pytest.raises(CheckpointError, match=r"is missing shard-00000-of-00001\.safetensors \(written by shard rank 0"):
        yashard.load_checkpoint(save_dir, _fresh()[0])


@pytest.mark.parametrize("how", ["roots", "explicit"])
def test_ranks_given_different_checkpoints_are_refused(tmp_path, how):
    """Not a save committing mid-load: one rank names another checkpoint (another root, or an older
    save directory by name). Every rank refuses, naming each rank's save."""
    out = launch(load_different_checkpoints, 2, str(tmp_path / "a"), str(tmp_path / "b"), how)
    for msg in out:
        assert msg is not None and re.fullmatch(
            r"load_checkpoint: the ranks were given different checkpoints \((save-\d{6}-[0-9a-f]{8}) on rank 0, "
            r"(?!\1)(save-\d{6}-[0-9a-f]{8}) on rank 1\); pass the same checkpoint to every rank", msg), msg


def test_a_renamed_or_linked_save_directory_loads(saved, tmp_path):
    """A save is known by the name its index records: copied under another name, or reached
    through a symlink, it loads (its shard files were refused as "copied in from another checkpoint")."""
    root, save_dir = saved
    shutil.copytree(save_dir, tmp_path / "best")
    (tmp_path / "link").symlink_to(save_dir)
    want = yashard.load_checkpoint(root, *_fresh())
    for path in (tmp_path / "best", tmp_path / "link"):
        sm, opt = _fresh()
        assert yashard.load_checkpoint(path, sm, opt) == want
        ref = _fresh()[0]
        yashard.load_checkpoint(root, ref)
        assert all(torch.equal(u.master, r.master) for u, r in zip(sm.runtime.units, ref.runtime.units))


def test_error_truncated_and_garbage_files(saved):
    root, save_dir = saved
    f = save_dir / "shard-00000-of-00001.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=rf"shard-00000-of-00001\.safetensors is {len(data) // 2} bytes but the "
                                              rf"index records {len(data)}: it was truncated"):
        yashard.load_checkpoint(root, _fresh()[0])
    f.write_bytes(b"\xff" * 8 + data[8:])     # same size, header length garbage
    with pytest.raises(CheckpointError, match=r"shard-00000-of-00001\.safetensors is not a readable safetensors file "
                                              r"\(SafetensorError: .*\); it is corrupt"):
        yashard.load_checkpoint(root, _fresh()[0])


def test_error_damaged_bytes_and_a_file_from_another_save(saved):
    """Same size, valid header: flipped bytes in the data fail the per-piece CRC-32 of the index;
    a shard file copied in from another save fails the save name in its metadata. Nothing is loaded."""
    root, save_dir = saved
    f = save_dir / "shard-00000-of-00001.safetensors"
    data = f.read_bytes()
    header_end = 8 + int.from_bytes(data[:8], "little")
    mid = (header_end + len(data)) // 2
    f.write_bytes(data[:mid] + bytes(b ^ 0x5A for b in data[mid:mid + 64]) + data[mid + 64:])
    sm = _fresh()[0]
    before = [u.master.clone() for u in sm.runtime.units]
    with pytest.raises(CheckpointError, match=r"shard-00000-of-00001\.safetensors: the bytes of tensor '.*' do not "
                                              r"match the checksum the save recorded \(CRC-32\): the file was damaged"):
        yashard.load_checkpoint(root, sm)
    assert all(torch.equal(a, u.master) for a, u in zip(before, sm.runtime.units))   # nothing modified
    f.write_bytes(data)
    other = yashard.save_checkpoint(root.parent / "other", *_trained()[:2])
    f.write_bytes((other / f.name).read_bytes())
    with pytest.raises(CheckpointError, match=rf"was written by the save {other.name}, not by {save_dir.name} whose "
                                              r"index lists it: a shard file was copied in from another checkpoint"):
        yashard.load_checkpoint(root, sm)
    f.write_bytes(data)
    yashard.load_checkpoint(root, sm)  # restored: loads


def test_error_per_rank_extra_scalar_state_and_an_unshared_path(tmp_path):
    for msg in launch(save_misuse, 2, str(tmp_path / "x"), "extra"):
        assert msg.startswith("save_checkpoint: extra differs between rank 0 and rank 1 (keys ['loader_pos']), and the "
                              "checkpoint keeps one copy of it."), msg
    msgs = launch(save_misuse, 2, str(tmp_path / "y"), "unshared")
    assert all(m is not None for m in msgs), msgs
    assert re.search(r"rank 1 cannot see .*/y/1/ck/save-\d+-[0-9a-f]+, which rank 0 created 0\.5 s ago: the checkpoint "
                     r"path must be on a file system every rank shares", msgs[1]), msgs[1]
    assert msgs[0].startswith("save_checkpoint failed on rank 1: CheckpointError: rank 1 cannot see"), msgs[0]
    for msg in launch(save_misuse, 2, str(tmp_path / "z"), "per_rank_scalar"):
        assert msg is not None and re.search(
            r"optimizer scalar state of unit embed differs between ranks: rank 0 has \{'rms': .*\}, rank 1 "
            r"has \{'rms': .*\}; the checkpoint stores one value for every rank, so a per-rank scalar", msg), msg
    for msg in launch(save_misuse, 2, str(tmp_path / "m"), "missing_state"):
        assert msg is not None and re.search(
            r"optimizer state of unit \S+ differs between ranks: rank 0 has \{'exp_avg': 'float32', .*\}, rank 1 has "
            r"None; every rank must have stepped the same parameters", msg), msg
    for sub in "xzm":  # refused before anything was written: rank 0 removed the save directory it had created
        assert not list((tmp_path / sub).glob("ck/save-*")), sub


class _Trap:
    """Unpickling this creates a file: proof that something unpickled the shard."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_error_pickle_where_a_shard_should_be(saved, tmp_path):
    root, save_dir = saved
    f = save_dir / "shard-00000-of-00001.safetensors"
    marker = tmp_path / "unpickled"
    f.write_bytes(pickle.dumps(_Trap(str(marker)), protocol=4))
    with pytest.raises(CheckpointError, match=r"shard-00000-of-00001\.safetensors is a pickle file, not a safetensors "
                                              r"shard; yashard never unpickles checkpoint files"):
        yashard.load_checkpoint(root, _fresh()[0])
    torch.save({"x": _Trap(str(marker))}, f)
    with pytest.raises(CheckpointError, match=r"is a zip archive \(torch\.save writes these; they hold pickles\), not a "
                                              r"safetensors shard"):
        yashard.load_checkpoint(root, _fresh()[0])
    assert not marker.exists()


def test_error_optimizer_mismatch(saved):
    root, _ = saved
    sm, opt = _fresh(opt_cls=torch.optim.SGD)
    with pytest.raises(CheckpointError, match=r"holds AdamW state \(torch\.optim\.adamw\), but the optimizer passed is "
                                              r"SGD \(torch\.optim\.sgd\); build a AdamW to resume, or pass optimizer=None"):
        yashard.load_checkpoint(root, sm, opt)
    sm, _ = _fresh()
    one_group = torch.optim.AdamW(sm.parameters(), lr=1e-3)
    with pytest.raises(CheckpointError, match=r"the optimizer's param groups differ from the checkpoint's: checkpoint "
                                              r"\[\['embed', 'layer_0'.*\], \['small'\]\], optimizer \[\['embed'"):
        yashard.load_checkpoint(root, sm, one_group)
    stranger = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], lr=1e-3)
    with pytest.raises(ValueError, match=r"optimizer param group 0 holds a tensor of shape \(3,\) that is not a master "
                                         r"shard of this model"):
        yashard.load_checkpoint(root, sm, stranger)


def test_error_bad_save_inputs(pg, tmp_path):
    sm, opt = _trained(steps=1)
    with pytest.raises(TypeError, match=r"save_checkpoint\(extra=\.\.\.\) must be JSON-serialisable: extra\['t'\] is a Tensor"):
        yashard.save_checkpoint(tmp_path / "a", sm, opt, extra={"t": torch.ones(1)})
    assert not (tmp_path / "a").exists()        # refused before anything was written
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match=r"save_checkpoint path .*file is a file; pass a directory"):
        yashard.save_checkpoint(tmp_path / "file", sm, opt)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("x")
    with pytest.raises(CheckpointError, match=r"mine exists and is not a yashard checkpoint directory \(it holds "
                                              r"notes\.txt\); save into a new or empty directory"):
        yashard.save_checkpoint(tmp_path / "mine", sm, opt)
    with pytest.raises(TypeError, match=r"save_checkpoint expects the ShardedModel returned by yashard\.shard, got LlamaForCausalLM"):
        yashard.save_checkpoint(tmp_path / "b", build("llama"))
    stranger = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], lr=1e-3)
    with pytest.raises(ValueError, match=r"optimizer param group 0 holds a tensor of shape \(3,\) that is not a master"):
        yashard.save_checkpoint(tmp_path / "b", sm, stranger)
    master = sm.runtime.units[0].master
    opt.state[master]["odd"] = torch.zeros(5)
    with pytest.raises(TypeError, match=r"optimizer state 'odd' of unit embed is a \(5,\) tensor, which a yashard "
                                        r"checkpoint cannot store"):
        yashard.save_checkpoint(tmp_path / "b", sm, opt)
    del opt.state[master]["odd"]
    opt.param_groups[0]["fn"] = lambda: 0
    with pytest.raises(TypeError, match=r"optimizer\.param_groups\[0\]\['fn'\] is a function"):
        yashard.save_checkpoint(tmp_path / "b", sm, opt)
    assert not (tmp_path / "b").exists()


def test_error_bad_export_inputs(pg, tmp_path):
    sm, _ = _fresh()
    with pytest.raises(ValueError, match=r"export_hf dtype=torch\.int8 is not supported; use torch\.float32"):
        yashard.export_hf(sm, tmp_path / "x", dtype=torch.int8)
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match=r"export_hf path .*file is a file; pass a directory path"):
        yashard.export_hf(sm, tmp_path / "file")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("x")
    with pytest.raises(CheckpointError, match=r"mine exists and is not a model folder \(it holds notes\.txt, no "
                                              r"config\.json and not only tokenizer files\); export to a new path"):
        yashard.export_hf(sm, tmp_path / "mine")
    assert sorted(os.listdir(tmp_path)) == ["file", "mine"]   # no temp directory left behind


def test_export_into_a_folder_a_tokenizer_was_saved_to_first(pg, tmp_path):
    """HF workflows save the tokenizer first and the model after, into one folder: such a folder
    (tokenizer files only, no config.json yet) was refused as not a model folder."""
    sm, _ = _fresh()
    dest = tmp_path / "hf"
    dest.mkdir()
    (dest / "tokenizer.json").write_text('{"t": 1}')
    (dest / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    (dest / "special_tokens_map.json").write_text("{}")
    yashard.export_hf(sm, dest)
    assert sorted(p.name for p in dest.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                       "special_tokens_map.json", "tokenizer.json",
                                                       "tokenizer_config.json"]
    assert (dest / "tokenizer.json").read_text() == '{"t": 1}'


def test_export_over_a_model_folder_keeps_its_other_files(pg, tmp_path):
    """As save_pretrained: tokenizer files, templates and subfolders stay; earlier weights go."""
    sm, _ = _trained(steps=1)
    dest = tmp_path / "hf"
    yashard.export_hf(sm, dest, max_shard_size=100_000)       # several files + index
    (dest / "tokenizer.json").write_text('{"t": 1}')
    (dest / "chat_template.jinja").write_text("{{ x }}")
    (dest / "extra").mkdir()
    (dest / "extra" / "notes.md").write_text("n")
    (dest / "pytorch_model.bin").write_bytes(b"stale")
    yashard.export_hf(sm, dest)                                  # one file now
    assert sorted(p.name for p in dest.iterdir()) == ["chat_template.jinja", "config.json", "extra",
                                                       "generation_config.json", "model.safetensors", "tokenizer.json"]
    assert (dest / "tokenizer.json").read_text() == '{"t": 1}' and (dest / "extra" / "notes.md").read_text() == "n"
    got = load_file(str(dest / "model.safetensors"))
    full = sm.full_state_dict()
    assert all(torch.equal(got[k], full[k]) for k in got)


def test_export_through_a_symlinked_folder(pg, tmp_path):
    """As save_pretrained: a symlinked folder is written through (the link stays, its target gets the
    export), and a dangling link's target is created."""
    sm, _ = _trained(steps=1)
    yashard.export_hf(sm, tmp_path / "real")                  # a model folder, now with a tokenizer too
    (tmp_path / "real" / "tokenizer.json").write_text("{}")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    yashard.export_hf(sm, tmp_path / "link")
    assert (tmp_path / "link").is_symlink() and (tmp_path / "real" / "model.safetensors").is_file()
    assert (tmp_path / "real" / "tokenizer.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]   # no temporary left behind
    (tmp_path / "dangling").symlink_to(tmp_path / "later")
    yashard.export_hf(sm, tmp_path / "dangling")
    got = load_file(str(tmp_path / "later" / "model.safetensors"))
    assert all(torch.equal(got[k], v) for k, v in sm.full_state_dict().items() if k in got)


def test_export_failure_keeps_the_previous_export(pg, tmp_path, monkeypatch):
    sm, _ = _trained(steps=1)
    yashard.export_hf(sm, tmp_path / "hf")
    before = {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir()}
    import yashard.hf_export as hx

    calls = [0]
    real = hx.StreamedSafetensors.write

    def failing(self, key, t):
        calls[0] += 1
        if calls[0] == 5:
            raise OSError("disk full (simulated)")
        real(self, key, t)

    monkeypatch.setattr(hx.StreamedSafetensors, "write", failing)
    with pytest.raises(OSError, match=r"disk full \(simulated\)"):
        yashard.export_hf(sm, tmp_path / "hf")
    assert {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir()} == before
    assert sorted(os.listdir(tmp_path)) == ["hf"]


def test_an_export_killed_between_the_fallback_renames_is_recovered_by_the_next(pg, tmp_path, monkeypatch, caplog):
    """Where the directories cannot be exchanged (NFS), publishing is two renames; killed between them,
    ``path`` is missing and both complete folders sit beside it. The next export puts the previous one
    back first, so a failure of that export too still leaves a complete folder at ``path``."""
    sm, _ = _trained(steps=1)
    yashard.export_hf(sm, tmp_path / "hf")
    before = {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir()}
    shutil.copytree(tmp_path / "hf", tmp_path / ".hf.yashard-tmp-0000aaaa")   # the complete new folder
    os.rename(tmp_path / "hf", tmp_path / ".hf.yashard-old-0000bbbb")          # the first rename, then killed
    import yashard.hf_export as hx

    def failing(self, key, t):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(hx.StreamedSafetensors, "write", failing)
    with caplog.at_level("WARNING", logger="yashard"), pytest.raises(OSError, match=r"disk full \(simulated\)"):
        yashard.export_hf(sm, tmp_path / "hf")
    assert any(f"{tmp_path / 'hf'} was missing and .hf.yashard-old-0000bbbb held the previous export" in r.getMessage()
               for r in caplog.records), caplog.text
    assert {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir()} == before
    assert sorted(os.listdir(tmp_path)) == ["hf"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")   # no_dist=True says so
def test_persistent_buffers_travel_with_the_weights(tmp_path):
    """What state_dict() holds besides parameters (DeepSeek-V3's router biases, set as a training
    loop sets them) is in the export, which transformers loads with nothing missing and which computes
    what the sharded model computed; save_checkpoint / load_checkpoint and DCP restore it, and the DCP
    checkpoint loads into an unsharded model."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    results = launch(persistent_buffers_travel, 2, str(tmp_path))
    res = results[0]
    assert len(res["set_to"]) == 3 and all(b.abs().sum() > 0 for b in res["set_to"].values())
    for r, out in enumerate(results):
        for how, got in out["after"].items():
            assert all(torch.equal(got[n], res["set_to"][n]) for n in res["set_to"]), (r, how)
    hf, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    buffers = dict(hf.named_buffers())
    assert all(torch.equal(buffers[n], v) for n, v in res["set_to"].items())
    with torch.no_grad():
        assert rel_err(hf(input_ids=res["ids"]).logits, res["logits"]) < 1e-5
    plain = build("deepseek_v3", seed=8)
    sd = plain.state_dict()
    dcp.load(sd, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert all(torch.equal(sd[n], v) for n, v in res["set_to"].items())
    index = json.loads(next((tmp_path / "ckpt").glob("save-*/index.json")).read_text())
    assert index["format_version"] == 2 and sorted(index["buffers"]) == sorted(res["set_to"])


# ------------------------------------------------------------------------------------------------
# torch.distributed.checkpoint (DCP): model.sharded_state_dict()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")   # no_dist=True says so
def test_dcp_save_at_2_loads_at_3_into_a_plain_model_and_back(tmp_path):
    """yashard's DCP checkpoint holds full-shape tensors under HF names, written in pieces by each
    rank: it loads at another world size (in place, into weights the slots had already gathered), into
    an unsharded HF model, and an unsharded model's DCP checkpoint loads into yashard."""
    import torch.distributed.checkpoint as dcp

    saved = launch(dcp_save, 2, str(tmp_path / "yashard"))[0]
    ids = batches(1, 2, 8, 96, seed=9)[0]
    at3 = launch(dcp_load, 3, str(tmp_path / "yashard"), ids)
    for rank_out in at3:
        for name, (family, kw) in DCP_MODELS.items():
            got = rank_out[name]
            assert set(got["params"]) == set(saved[name])
            assert all(torch.equal(got["params"][k], saved[name][k]) for k in saved[name]), name
            ref = build(family, **kw).eval()
            ref.load_state_dict(saved[name])
            with torch.no_grad():
                assert rel_err(got["logits"], ref(input_ids=ids).logits) < 1e-5, name
    assert max(out[n]["boxes"] for out in at3 for n in saved) >= 2   # pieces of matrices cut into boxes

    for name, (family, kw) in DCP_MODELS.items():
        plain = build(family, seed=4, **kw)                     # yashard -> unsharded model
        dcp.load(plain.state_dict(), checkpoint_id=str(tmp_path / "yashard" / name), no_dist=True)
        assert all(torch.equal(v, saved[name][k]) for k, v in plain.state_dict().items()), name
        theirs = build(family, seed=8, **kw)                    # unsharded model -> yashard
        dcp.save(theirs.state_dict(), checkpoint_id=str(tmp_path / "plain" / name), no_dist=True)
    for name, (family, kw) in DCP_MODELS.items():
        want = build(family, seed=8, **kw).state_dict()
        for rank_out in launch(dcp_load, 2, str(tmp_path / "plain"), ids):
            assert all(torch.equal(rank_out[name]["params"][k], want[k]) for k in want), name


def test_dcp_checkpoints_go_between_fsdp2_and_yashard_at_other_world_sizes(tmp_path):
    saved = launch(fsdp2_dcp, 2, str(tmp_path / "fsdp2"), "save")[0]        # FSDP2 at 2 -> yashard at 3
    ids = batches(1, 2, 8, 96, seed=9)[0]
    for rank_out in launch(dcp_load, 3, str(tmp_path / "fsdp2"), ids):
        for name in DCP_MODELS:
            want = saved[name]
            assert set(want) <= set(rank_out[name]["params"])
            assert all(torch.equal(rank_out[name]["params"][k], want[k]) for k in want), name
    ours = launch(dcp_save, 3, str(tmp_path / "yashard"))[0]                 # yashard at 3 -> FSDP2 at 2
    for rank_out in launch(fsdp2_dcp, 2, str(tmp_path / "yashard"), "load"):
        for name in DCP_MODELS:
            assert all(torch.equal(v, ours[name][k]) for k, v in rank_out[name].items()), name


def test_dcp_async_save_with_the_snapshot_stager(tmp_path):
    """The stager copies each rank's boxes when async_save is called: an optimizer step taken before
    the save is waited for does not reach the checkpoint."""
    before = launch(dcp_async_save, 2, str(tmp_path))[0]
    got = launch(dcp_load_named, 1, str(tmp_path))[0]
    assert set(got) == set(before) and all(torch.equal(got[k], before[k]) for k in before)


def test_dcp_async_save_in_process_mode(tmp_path):
    """Process mode pickles the staged state dict to a background process: the stager's snapshots
    pickle (live views refuse it), and what lands is the weights at the async_save call."""
    import subprocess
    import sys
    from pathlib import Path

    from harness import _free_port

    root = Path(__file__).resolve().parent.parent
    ckpt, weights = tmp_path / "ckpt", tmp_path / "before.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
           str(root / "tests" / "dcp_process_save.py"), str(ckpt), str(weights)]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(root), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])}
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "Error" not in proc.stderr, proc.stderr[-5000:]
    before = torch.load(weights)
    got = launch(dcp_load_named, 1, str(ckpt))[0]
    assert set(got) == set(before) and all(torch.equal(got[k], before[k]) for k in before)


def test_a_parameter_with_no_elements_reaches_the_dcp_checkpoint(pg, tmp_path):
    import torch.distributed.checkpoint as dcp

    def model(seed):
        m = build(seed=seed)
        m.model.layers[1].register_parameter("empty", torch.nn.Parameter(torch.zeros(5, 0)))
        return yashard.shard(m)

    src = model(1)
    dcp.save(src.sharded_state_dict(), checkpoint_id=str(tmp_path))
    sm = model(2)
    dcp.load(sm.sharded_state_dict(), checkpoint_id=str(tmp_path))   # raised "Missing key" without it
    want, got = src.full_state_dict(), sm.full_state_dict()
    assert got["model.layers.1.empty"].shape == (5, 0)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_a_hybrid_sharded_dcp_save_writes_each_piece_once_and_loads_at_world_1(tmp_path):
    """4 ranks as 2 replicas of 2 shards: the replicas' identical pieces are written once (DCP gives
    each duplicated write item to one of the ranks holding it) and the checkpoint loads into one rank."""
    saved = launch(dcp_save, 4, str(tmp_path / "hybrid"), {"shard_group_size": 2})[0]
    launch(dcp_save, 2, str(tmp_path / "plain"))
    got = launch(dcp_load, 1, str(tmp_path / "hybrid"), batches(1, 2, 8, 96, seed=9)[0])[0]
    for name in DCP_MODELS:
        assert all(torch.equal(got[name]["params"][k], saved[name][k]) for k in saved[name]), name
        hybrid, plain = (sum(f.stat().st_size for f in (tmp_path / d / name).iterdir() if f.suffix == ".distcp")
                         for d in ("hybrid", "plain"))
        assert abs(hybrid - plain) < 0.1 * plain, (hybrid, plain)   # the same bytes: once, not once per replica


@pytest.mark.parametrize("fused", [False, True])
def test_dcp_model_and_optimizer_resume_the_run(tmp_path, fused):
    """DCP checkpoint of weights + AdamW state at step 3 (world 2): resumed at world 2 the run is
    bitwise the uninterrupted one; at world 3, equal to fp32 rounding (the ranks sum in another
    order). The resumed optimizer has the saved learning rate (changed at step 2)."""
    whole = launch(dcp_train_resume, 2, str(tmp_path), 0, 5, 3, fused)[0]
    same = launch(dcp_train_resume, 2, str(tmp_path), 3, 5, None, fused)[0]
    assert same["losses"] == whole["losses"][3:] and same["lr"] == whole["lr"] == [5e-3, 5e-3]
    assert all(torch.equal(same["params"][k], whole["params"][k]) for k in whole["params"])
    other = launch(dcp_train_resume, 3, str(tmp_path), 3, 5, None, fused)[0]
    assert max(abs(a - b) / b for a, b in zip(other["losses"], whole["losses"][3:])) < 1e-5
    _assert_close(other["params"], whole["params"], "qwen2")


class _DecayIgnoringLr(torch.optim.Optimizer):
    """A toy optimizer that decays its parameters whatever the learning rate (as HF's Adafactor with
    relative steps), keeping a shard-shaped buffer and, with ``scalar``, a per-rank 0-d statistic."""

    def __init__(self, params, lr=1e-2, scalar=False):
        super().__init__(params, dict(lr=lr))
        self.scalar = scalar

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                st.setdefault("buf", torch.zeros_like(p)).add_(p.grad + 1.0)
                if self.scalar:
                    st["rms"] = p.norm()
                p.mul_(0.9)


def test_dcp_optimizer_state_of_a_fresh_optimizer_changes_nothing(pg):
    """Creating the state (a zero-lr step) leaves the weights and the run as they were: the weights
    are put back (this optimizer decays whatever lr says) and the new state is zeroed."""
    sm, opt = _fresh(opt_cls=_DecayIgnoringLr)
    before = sm.full_state_dict()
    sd = sm.sharded_optim_state_dict(opt)
    assert all(torch.equal(v, before[k]) for k, v in sm.full_state_dict().items())
    assert all(not s["buf"].any() for s in opt.state.values())
    a, opt_a = _fresh()
    b, opt_b = _fresh()
    b.sharded_optim_state_dict(opt_b)              # AdamW: step 0, zero moments, as if untouched
    for sm_, opt_ in ((a, opt_a), (b, opt_b)):
        for x in batches(3, 2, 8, 96, seed=2):
            sm_(input_ids=x, labels=x).loss.backward()
            opt_.step()
            opt_.zero_grad()
    assert all(torch.equal(v, a.full_state_dict()[k]) for k, v in b.full_state_dict().items())
    assert set(sd["state"]) == {fqns[0] for u in sm.runtime.units for fqns in u.fqns}


def test_dcp_fresh_optimizer_state_mid_step_is_refused(pg):
    """Creating a fresh optimizer's state takes a step, which would break the pending backward: refused,
    saying so, also after an evaluation forward in between; between steps it works."""
    sm, opt = _fresh()
    x = batches(1, 2, 8, 96, seed=2)[0]
    loss = sm(input_ids=x, labels=x).loss
    for evaluation in (False, True):
        if evaluation:
            with torch.no_grad():
                sm(input_ids=x)
        with pytest.raises(RuntimeError, match=r"AdamW has no state yet, and creating it takes an optimizer step, "
                                               r"which cannot run between a forward and its backward"):
            sm.sharded_optim_state_dict(opt)
    loss.backward()          # the pending backward is intact
    sm.sharded_optim_state_dict(opt)
    opt.step()


def test_dcp_optimizer_scalar_state_and_fresh_state_that_would_differ():
    for out in launch(dcp_optimizer_scalars, 2):
        assert out["nadam"] == ["exp_avg", "exp_avg_sq", "mu_product", "step"], out
        assert out["per_rank"].startswith("_PerRankScalar keeps scalar state 'rms' of embed that differs between ranks "), out
        assert out["rprop"].startswith("Rprop has no state yet, and creating it here (a zero-gradient step) would not "
                                       "give the state its first real step starts from"), out
        assert out["rprop_state"] == 0   # refused before anything was created


def test_dcp_optimizer_state_refuses_regrouped_checkpoints(pg):
    sm, opt = _trained()
    sd = sm.sharded_optim_state_dict(opt)
    norms = sd["param_groups"][1]["params"]
    regrouped = [dict(sd["param_groups"][0]), {**sd["param_groups"][1], "params": norms[:2]},
                 {**sd["param_groups"][1], "params": norms[2:], "weight_decay": 0.1}]
    with pytest.raises(ValueError, match=r"param group 1 of AdamW \(e\.g\. model\.layers\.0\.input_layernorm\.weight\) holds "
                                         r"parameters that the checkpoint keeps in groups \[1, 2\], which differ in "
                                         r"weight_decay: yashard keeps a unit's parameters in one group"):
        sm.load_sharded_optim_state_dict(opt, {"state": sd["state"], "param_groups": regrouped})
    missing = [{**sd["param_groups"][0], "params": sd["param_groups"][0]["params"][1:]}, sd["param_groups"][1]]
    with pytest.raises(ValueError, match=r"param group 0 holds model\.embed_tokens\.weight, which no saved param group "
                                         r"holds \(2 saved groups\)"):
        sm.load_sharded_optim_state_dict(opt, {"state": sd["state"], "param_groups": missing})
    with pytest.raises(ValueError, match=r"the optimizer state dict has no 'state' dict or 'param_groups' list: pass "
                                         r"the dict model\.sharded_optim_state_dict\(opt\) made and dcp\.load filled"):
        sm.load_sharded_optim_state_dict(opt, sd["state"])
    sd["param_groups"][0]["lr"] = 0.125                 # the matching case: hyperparameters applied
    sm.load_sharded_optim_state_dict(opt, sd)
    assert opt.param_groups[0]["lr"] == 0.125


def test_an_fsdp2_training_checkpoint_continues_under_yashard():
    """Model + AdamW state saved by FSDP2 (torch's get_model/optimizer_state_dict) at world 2, loaded
    by yashard at world 3 (moments, step counts and each group's learning rate): the next step gives
    FSDP2's own next step, to fp32 rounding."""
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        theirs = launch(fsdp2_train_save_continue, 2, root)[0]
        ours = launch(yashard_load_continue, 3, root)[0]
    _assert_close({k: ours[k] for k in theirs}, theirs, "fsdp2 -> yashard")


def test_another_ranks_optimizer_state_dict_is_refused(tmp_path):
    """opt.state_dict() of master shards holds this rank's shards under the names every rank uses: a
    rank-0 file loaded on every rank, or dcp.save / dcp.load of it (DCP keeps one rank's copy of each
    tensor) gave ranks other ranks' moments without a word, and files of another world size failed
    inside the optimizer's step. Its tag (shard rank, world, shards, checksums) makes
    load_state_dict refuse them, naming the fix; each rank's own file at the same world loads."""
    fix = "save and load with yashard.save_checkpoint / yashard.load_checkpoint (any world size)"
    assert launch(optimizer_state_dict_misuse, 2, str(tmp_path), "own") == [(None, True), (None, True)]
    (e0, same0), (e1, _) = launch(optimizer_state_dict_misuse, 2, str(tmp_path), "rank0")
    assert e0 is None and same0
    assert e1.startswith("AdamW.load_state_dict: this state dict is another rank's or another layout's optimizer "
                         "state of yashard master shards: it holds shard rank 0's state and this is shard rank 1 "
                         "(embed;") and fix in e1
    for error, _ in launch(optimizer_state_dict_misuse, 3, str(tmp_path), "from2"):
        assert re.search(r"it was saved from 7 shards of [\d,]+ elements over shard world 2 and this optimizer holds "
                         r"7 shards of [\d,]+ elements over shard world 3", error), error
    # a second model over a one-rank shard group, last in the optimizer, does not hide the first one's ranks
    (e0, _), (e1, _) = launch(optimizer_state_dict_misuse, 2, str(tmp_path), "rank0_two")
    assert e0 is None and "it holds shard rank 0's state and this is shard rank 1" in e1
    assert [e for e, _ in launch(optimizer_state_dict_misuse, 2, str(tmp_path), "rank0_sgd")] == [None, None]  # no state
    # DCP keeps one rank's tag (and one rank's copy of each tensor): every other shard rank refuses
    dcp_results = launch(optimizer_state_dict_misuse, 2, str(tmp_path), "dcp")
    refused = [e for e, _ in dcp_results if e is not None]
    assert len(refused) == 1, dcp_results
    assert "torch.distributed.checkpoint keeps one rank's copy" in refused[0]


class _CountingState:
    """A comm hook state with a position to resume, as QgzState has."""

    def __init__(self):
        self.calls = 0

    def state_dict(self):
        return {"calls": self.calls}

    def load_state_dict(self, state):
        self.calls = int(state["calls"])


class _OtherState(_CountingState):
    def load_state_dict(self, state):
        self.other = state["other"]


def _counting_hook(state, bucket):
    state.calls += 1
    return comm_hooks.reduce_scatter_hook(state, bucket)


def test_a_hook_state_that_cannot_take_the_checkpoints_is_refused_before_registering(pg, tmp_path, caplog):
    """load_checkpoint, then register_comm_hook with a state whose load_state_dict fails on the
    saved state: refused naming both, nothing registered, so the right state can be registered
    next and resumes. A load after the first forward, with no hook to take the state, says how."""
    import logging

    sm = yashard.shard(build())
    sm.register_comm_hook(_CountingState(), _counting_hook)
    ids = batches(1, 2, 8, sm.module.config.vocab_size)[0]
    sm(input_ids=ids, labels=ids).loss.backward()
    yashard.save_checkpoint(tmp_path, sm)
    saved = sm.runtime.comm_hook_state.calls
    assert saved > 0

    fresh = yashard.shard(build())
    yashard.load_checkpoint(tmp_path, fresh)
    with pytest.raises(ValueError, match=r"the checkpoint's comm hook state \{'calls': \d+\} does not load into the "
                                         r"hook state _OtherState \(KeyError: 'other'\): register the hook and state"):
        fresh.register_comm_hook(_OtherState(), _counting_hook)
    state = _CountingState()
    fresh.register_comm_hook(state, _counting_hook)
    assert state.calls == saved and fresh.runtime.comm_hook_state is state

    late = yashard.shard(build())
    late(input_ids=ids, labels=ids).loss.backward()
    with caplog.at_level(logging.WARNING, logger="yashard"):
        yashard.load_checkpoint(tmp_path, late)
    assert "no hook was registered before the first forward" in caplog.text
    assert "to resume it, load the checkpoint into a freshly sharded model and call register_comm_hook" in caplog.text
