"""Rank functions for the checkpoint tests.

A *segment* trains steps ``[start, stop)`` of one fixed data stream: the global batch of step ``i``
is ``batches(...)[i]`` whatever the world size, and rank r takes rows ``[r * B/W, (r + 1) * B/W)``.
A segment may begin by loading a checkpoint and may save at given steps, so a run cut into segments
at any world sizes can be compared with the uninterrupted run.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import yashard
from models import batches, build

SEG = dict(family="llama", overrides={}, seed=0, lr=1e-3, wd=0.1, clip=1.0, global_batch=6, seq=12, total=6,
           start=0, stop=6, load=None, saves={}, export=None, logits_seed=7,
           freeze=())  # parameters whose names contain one of these are frozen before sharding


def segment(**kw) -> dict:
    bad = set(kw) - set(SEG)
    if bad:
        raise KeyError(f"unknown segment keys {bad}")
    return {**SEG, **kw}


def _setup(s: dict):
    model = build(s["family"], seed=s["seed"], **s["overrides"])
    for name, p in model.named_parameters():
        if any(f in name for f in s["freeze"]):
            p.requires_grad_(False)
    sm = yashard.shard(model)
    opt = torch.optim.AdamW(sm.param_groups(s["wd"]), lr=s["lr"])
    return sm, opt


def train_segment(rank: int, world: int, s: dict) -> dict:
    sm, opt = _setup(s)
    vocab = sm.config.vocab_size
    extra = None
    if s["load"] is not None:
        extra = yashard.load_checkpoint(s["load"], sm, opt)
        assert extra == {"step": s["start"]}, extra
    if s["export"] is not None:
        yashard.export_hf(sm, s["export"])  # replaced by the export at the end
    data = batches(s["total"], s["global_batch"], s["seq"], vocab)
    losses = []
    for step in range(s["start"], s["stop"]):
        if step in s["saves"]:
            yashard.save_checkpoint(s["saves"][step], sm, opt, extra={"step": step})
        local = data[step].chunk(world)[rank]
        out = sm(input_ids=local, labels=local)
        out.loss.backward()
        loss = out.loss.detach().clone()
        dist.all_reduce(loss)
        losses.append(loss.item() / world)
        sm.clip_grad_norm_(s["clip"])
        opt.step()
        opt.zero_grad()
    if s["stop"] in s["saves"]:
        yashard.save_checkpoint(s["saves"][s["stop"]], sm, opt, extra={"step": s["stop"]})
    out = dict(losses=losses, params=sm.full_state_dict(), extra=extra)
    if s["export"] is not None:
        out.update(export(sm, s))
    return out


EXPORT_LIMIT = 40_000  # bytes: the tiny models' fp32 exports span several files, some across units


def export(sm, s: dict) -> dict:
    """Export bf16 (one file), and fp32 in files of at most EXPORT_LIMIT bytes over the export of the
    initial weights (the swap); the sharded model's logits."""
    path = s["export"]
    yashard.export_hf(sm, path + "-bf16", dtype=torch.bfloat16)
    yashard.export_hf(sm, path, max_shard_size=EXPORT_LIMIT)
    sm.eval()
    g = torch.Generator().manual_seed(s["logits_seed"])
    x = torch.randint(0, sm.config.vocab_size, (2, s["seq"]), generator=g)
    with torch.no_grad():
        logits = sm(input_ids=x).logits
    return dict(input_ids=x, logits=logits)


def run_segments(rank: int, world: int, segments: list) -> list:
    return [train_segment(rank, world, s) for s in segments]


# ------------------------------------------------------------------------------------------------
# Killing a rank in the middle of a save


def _die(marker: str, what: str):
    with open(marker, "w") as f:
        f.write(what)
        f.flush()
        os.fsync(f.fileno())
    os._exit(1)


def _kill_mid_shard_write(marker: str, after: int) -> None:
    """This rank writes ``after`` tensors of its shard file, then half of the next one, and dies."""
    from yashard._io import StreamedSafetensors

    original = StreamedSafetensors.write
    count = [0]

    def write(self, key, tensor):
        if count[0] == after:
            raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
            self._f.write(memoryview(raw[: len(raw) // 2]))
            self._f.flush()
            _die(marker, f"killed while writing {key} to {self.path}")
        count[0] += 1
        original(self, key, tensor)

    StreamedSafetensors.write = write


def _kill_mid_pointer_write(marker: str) -> None:
    """Rank 0 writes the index, then half of the new LATEST's temp file, and dies before the rename."""
    import yashard.checkpoint.save as ck

    original = ck.write_text_atomic

    def write_text_atomic(path, text):
        if os.path.basename(path) == ck.POINTER:
            tmp = os.path.join(os.path.dirname(path), f".{ck.POINTER}.tmp-{os.getpid()}")
            with open(tmp, "w") as f:
                f.write(text[: len(text) // 2])
            _die(marker, f"killed while writing {tmp}")
        original(path, text)

    ck.write_text_atomic = write_text_atomic


def save_then_killed_save(rank: int, world: int, s: dict, path: str, ref: str, marker: str, victim: int, how: str):
    """Train 1 step and save to ``path`` (rank 0 also writes the full weights to ``ref``); train
    one more step and save again, while ``victim`` dies in the middle of that save (``how``)."""
    from safetensors.torch import save_file

    sm, opt = _setup(s)
    data = batches(s["total"], s["global_batch"], s["seq"], sm.config.vocab_size)
    for step in range(2):
        if step == 1:
            yashard.save_checkpoint(path, sm, opt, extra={"step": 1})
            full = sm.full_state_dict()
            if rank == 0:
                save_file({k: v.clone() for k, v in full.items()}, ref)
            if rank == victim:
                if how == "shard":
                    _kill_mid_shard_write(marker, after=3)
                else:
                    _kill_mid_pointer_write(marker)
        local = data[step].chunk(world)[rank]
        sm(input_ids=local, labels=local).loss.backward()
        opt.step()
        opt.zero_grad()
    yashard.save_checkpoint(path, sm, opt, extra={"step": 2})
    return "save returned"  # only reached if the kill did not happen


# ------------------------------------------------------------------------------------------------
# torch.distributed.checkpoint through model.sharded_state_dict()

DCP_MODELS = {"llama": ("llama", {}), "qwen2_tied": ("qwen2", {"tie_word_embeddings": True}),
              "qwen3": ("qwen3", {"hidden_size": 44, "intermediate_size": 70})}   # 44, 70: uneven pieces


def dcp_save(rank, world, root: str, cfg: dict | None = None) -> dict:
    """Train two steps of each DCP model (``cfg``: ShardConfig fields), dcp.save its sharded state
    dict; the full weights."""
    import torch.distributed.checkpoint as dcp

    out = {}
    for name, (family, kw) in DCP_MODELS.items():
        sm = yashard.shard(build(family, seed=3, **kw), config=yashard.ShardConfig(**(cfg or {})))
        opt = torch.optim.AdamW(sm.param_groups(0.1), lr=1e-2)
        for ids in batches(2, 2 * world, 8, 96, seed=5):
            part = ids.chunk(world)[rank]
            sm(input_ids=part, labels=part).loss.backward()
            opt.step()
            opt.zero_grad()
        dcp.save(sm.sharded_state_dict(), checkpoint_id=os.path.join(root, name))
        out[name] = sm.full_state_dict()
    return out


def dcp_load(rank, world, root: str, ids: torch.Tensor) -> dict:
    """Shard each DCP model from another init, run a forward (its slots now hold those weights),
    dcp.load the checkpoint in place; the full weights and the logits of ``ids`` after the load."""
    import torch.distributed.checkpoint as dcp

    out = {}
    for name, (family, kw) in DCP_MODELS.items():
        sm = yashard.shard(build(family, seed=11, **kw)).eval()
        with torch.no_grad():
            sm(input_ids=ids)
        sd = sm.sharded_state_dict()
        dcp.load(sd, checkpoint_id=os.path.join(root, name))
        with torch.no_grad():
            logits = sm(input_ids=ids).logits
        out[name] = dict(params=sm.full_state_dict(), logits=logits, boxes=max(len(p.boxes) for p in sd.values()))
    return out


def _fsdp2(family: str, kw: dict, seed: int, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = build(family, seed=seed, **kw)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def fsdp2_dcp(rank, world, root: str, action: str) -> dict:
    """FSDP2 (fully_shard per layer and at the root) saves each DCP model with dcp.save(model.state_dict())
    (``action`` "save"), or loads it in place from ``root`` ("load"); the full weights either way."""
    import torch.distributed.checkpoint as dcp

    out = {}
    for name, (family, kw) in DCP_MODELS.items():
        model = _fsdp2(family, kw, 6 if action == "save" else 12, world)
        sd = model.state_dict()
        (dcp.save if action == "save" else dcp.load)(sd, checkpoint_id=os.path.join(root, name))
        out[name] = {k: v.full_tensor() for k, v in model.state_dict().items()}
    return out


def dcp_async_save(rank, world, path: str) -> dict:
    """dcp.async_save with yashard's SnapshotStager, then an optimizer step before the save is waited
    for; the full weights at the async_save call."""
    import torch.distributed.checkpoint as dcp

    from yashard.dcp import SnapshotStager

    sm = yashard.shard(build("llama", seed=3))
    opt = torch.optim.AdamW(sm.param_groups(0.1), lr=1e-2)
    before = sm.full_state_dict()
    group = dist.new_group(backend="gloo")   # the save's collectives run beside training's (DCP's advice)
    fut = dcp.async_save({"model": sm.sharded_state_dict()}, checkpoint_id=path, async_stager=SnapshotStager(),
                         process_group=group)
    ids = batches(1, 2 * world, 8, 96)[0].chunk(world)[rank]
    sm(input_ids=ids, labels=ids).loss.backward()
    opt.step()                       # the masters change while the save may still be writing
    fut.result()
    return before


def dcp_load_named(rank, world, path: str) -> dict:
    """A Llama sharded from another init loads ``{"model": sharded_state_dict()}`` from ``path``."""
    import torch.distributed.checkpoint as dcp

    sm = yashard.shard(build("llama", seed=13))
    dcp.load({"model": sm.sharded_state_dict()}, checkpoint_id=path)
    return sm.full_state_dict()


def dcp_train_resume(rank, world, root: str, start: int, stop: int, save_at: int | None, fused: bool) -> dict:
    """Steps ``[start, stop)`` of a fixed stream with AdamW (``fused``) and clipping; at ``start`` > 0 the
    model and optimizer come from the DCP checkpoint in ``root`` (at any world size); at ``save_at``
    they are saved there. Losses per step and the final full weights."""
    import torch.distributed.checkpoint as dcp

    sm = yashard.shard(build("qwen2", seed=3, hidden_size=48, intermediate_size=70))
    opt = torch.optim.AdamW(sm.param_groups(0.1), lr=1e-2, fused=fused)
    if start:
        sd = {"model": sm.sharded_state_dict(), "optim": sm.sharded_optim_state_dict(opt)}
        dcp.load(sd, checkpoint_id=root)
        sm.load_sharded_optim_state_dict(opt, sd["optim"])
    losses = []
    for step, ids in enumerate(batches(stop, 6, 8, 96, seed=5)):
        if step < start:
            continue
        if step == 2:   # a schedule: the loaded learning rate must be the saved one
            for g in opt.param_groups:
                g["lr"] = 5e-3
        part = ids.chunk(world)[rank]
        loss = sm(input_ids=part, labels=part).loss
        loss.backward()
        sm.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
        if save_at == step + 1:
            dcp.save({"model": sm.sharded_state_dict(), "optim": sm.sharded_optim_state_dict(opt)},
                     checkpoint_id=root)
    return dict(losses=losses, params=sm.full_state_dict(), lr=[g["lr"] for g in opt.param_groups])


def _third_step(model, opt, rank, world):
    ids = batches(3, 6, 8, 96, seed=5)[2].chunk(world)[rank]   # global batch 6 at world 2 and 3
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def fsdp2_train_save_continue(rank, world, root: str) -> dict:
    """FSDP2 AdamW (matrices decayed, 1-D parameters not: yashard's grouping), two steps, a DCP save
    of model and optimizer through torch's state_dict helpers, then a third step; the full weights."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model = _fsdp2("qwen2", {"tie_word_embeddings": True}, 3, world)
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0, "lr": 7e-3}], lr=1e-2)
    for ids in batches(2, 6, 8, 96, seed=5):
        part = ids.chunk(world)[rank]
        model(input_ids=part, labels=part).loss.backward()
        opt.step()
        opt.zero_grad()
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=root)
    _third_step(model, opt, rank, world)
    return {k: v.full_tensor() for k, v in model.state_dict().items()}


def yashard_load_continue(rank, world, root: str) -> dict:
    """yashard loads that checkpoint (model and AdamW state) and takes the third step; the full weights."""
    import torch.distributed.checkpoint as dcp

    sm = yashard.shard(build("qwen2", seed=11, tie_word_embeddings=True))
    opt = torch.optim.AdamW(sm.param_groups(0.1), lr=1e-3)
    sd = {"model": sm.sharded_state_dict(), "optim": sm.sharded_optim_state_dict(opt)}
    dcp.load(sd, checkpoint_id=root)
    sm.load_sharded_optim_state_dict(opt, sd["optim"])
    _third_step(sm, opt, rank, world)
    return sm.full_state_dict()


def save_misuse(rank, world, root: str, what: str) -> str | None:
    """save_checkpoint with per-rank ``extra`` ("extra") or with each rank's path on its own disk
    ("unshared": rank r writes under root/r, as on node-local disks) or with an optimizer whose scalar
    state differs between ranks ("per_rank_scalar") or that has none for a unit on rank 1 alone
    ("missing_state"); the error every rank raises."""
    import yashard.checkpoint.save as ck

    sm = yashard.shard(build("llama", seed=3))
    ck._VISIBLE_TIMEOUT = 0.5
    path = os.path.join(root, str(rank), "ck") if what == "unshared" else os.path.join(root, "ck")
    extra = {"step": 3, "loader_pos": 100 * rank + 7} if what == "extra" else {"step": 3}
    opt = None
    if what in ("per_rank_scalar", "missing_state"):  # a 0-d statistic of each rank's own shard / rank 1 lost a unit's
        opt = (_PerRankScalar if what == "per_rank_scalar" else torch.optim.AdamW)(sm.parameters(), lr=1e-3)
        ids = batches(1, 2 * world, 8, 96)[0].chunk(world)[rank]
        sm(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        if what == "missing_state" and rank == 1:
            del opt.state[sm.runtime.units[1].master]
    try:
        yashard.save_checkpoint(path, sm, opt, extra=extra)
    except ck.CheckpointError as e:
        return str(e)
    return None


class _PerRankScalar(torch.optim.SGD):
    """SGD that also keeps a 0-d statistic of each parameter (here: of this rank's shard)."""

    @torch.no_grad()
    def step(self, closure=None):
        super().step(closure)
        for g in self.param_groups:
            for p in g["params"]:
                self.state[p]["rms"] = p.norm()


def dcp_optimizer_scalars(rank, world) -> dict:
    """Scalar optimizer state under DCP: NAdam's mu_product (the same on every rank) goes through;
    a statistic of each rank's shard is refused; a fresh Rprop (whose first state depends on lr) is
    refused before anything changes."""
    out = {}
    for name, make in (("nadam", lambda ps: torch.optim.NAdam(ps, lr=1e-3)),
                       ("per_rank", lambda ps: _PerRankScalar(ps, lr=1e-3)),
                       ("rprop", lambda ps: torch.optim.Rprop(ps, lr=1e-3))):
        sm = yashard.shard(build("llama", seed=3))
        opt = make(sm.parameters())
        if name != "rprop":
            ids = batches(1, 2 * world, 8, 96)[0].chunk(world)[rank]
            sm(input_ids=ids, labels=ids).loss.backward()
            opt.step()
        try:
            sd = sm.sharded_optim_state_dict(opt)
            out[name] = sorted({k for st in sd["state"].values() for k in st})
        except ValueError as e:
            out[name] = str(e)
        out[name + "_state"] = len(opt.state)
    return out


def optimizer_state_dict_misuse(rank, world, root: str, mode: str):
    """opt.state_dict() of master shards carried the usual ways: ``mode`` "dcp" (dcp.save / dcp.load
    of it, then load_state_dict), "own" (each rank torch.saves its own, and loads it back), "rank0"
    (every rank loads rank 0's file; "rank0_two": with a second model's shards in the optimizer,
    "rank0_sgd": an SGD without state), "from2" (at another world size, the files written at world 2).
    The error load_state_dict raised (None if it loaded) and whether the loaded state is what this
    rank saved."""
    import torch.distributed.checkpoint as dcp

    two = mode == "rank0_two"  # the optimizer also holds a second model's shards, over a one-rank shard group (last)

    def fresh():
        sm = yashard.shard(build())
        params = list(sm.parameters())
        if two:
            other = yashard.shard(build(), config=yashard.ShardConfig(shard_group_size=1))
            params += list(other.parameters())
            sm.other = other
        if mode == "rank0_sgd":
            return sm, torch.optim.SGD(params, lr=1e-2)  # (no state)
        return sm, torch.optim.AdamW(params, lr=1e-2)

    def step(sm, opt, seed):
        ids = batches(1, 2 * world, 8, 96, seed=seed)[0].chunk(world)[rank]
        sm(input_ids=ids, labels=ids).loss.backward()
        if two:
            sm.other(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    sm, opt = fresh()
    step(sm, opt, 1)
    want = [opt.state[p]["exp_avg"].clone() for p in sm.parameters()] if mode != "rank0_sgd" else []
    if mode == "dcp":
        dcp.save({"optim": opt.state_dict()}, checkpoint_id=f"{root}/dcp")
    elif mode != "from2":
        torch.save(opt.state_dict(), f"{root}/opt_{rank}.pt")
    dist.barrier()
    sm2, opt2 = fresh()
    step(sm2, opt2, 2)
    if mode == "dcp":
        sd = {"optim": opt2.state_dict()}
        dcp.load(sd, checkpoint_id=f"{root}/dcp")
        sd = sd["optim"]
    else:
        sd = torch.load(f"{root}/opt_{ {'own': rank, 'from2': min(rank, 1)}.get(mode, 0)}.pt")
    try:
        opt2.load_state_dict(sd)
        error = None
    except ValueError as e:
        error = str(e)
    same = mode != "from2" and all(torch.equal(opt2.state[p]["exp_avg"], w) for p, w in zip(sm2.parameters(), want))
    return error, same


def load_while_a_save_commits(rank, world, root: str) -> dict:
    """Two saves into ``root``, the older one restored after the newer one's cleanup removed it, and
    rank 1 made to find the older one (as if it read LATEST just before the newer save committed):
    every rank must load the same, newest save."""
    import logging
    import shutil
    from pathlib import Path

    from yashard.checkpoint import load as ck

    sm, opt = _setup(segment())
    old = yashard.save_checkpoint(root, sm, opt, extra={"step": 1})
    dist.barrier()
    if rank == 0:
        shutil.copytree(old, Path(root).parent / "kept")
    dist.barrier()
    with torch.no_grad():
        for p in sm.parameters():
            p.add_(1.0)
    new = yashard.save_checkpoint(root, sm, opt, extra={"step": 2})
    dist.barrier()
    if rank == 0:
        assert not old.exists()
        shutil.copytree(Path(root).parent / "kept", old)
    dist.barrier()
    if rank == 1:
        ck.resolve_checkpoint = lambda path: old
    warned = []
    handler = logging.Handler()
    handler.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger("yashard").addHandler(handler)
    sm2, opt2 = _setup(segment(seed=3))
    extra = yashard.load_checkpoint(root, sm2, opt2)
    same = all(torch.equal(u.master, u2.master) for u, u2 in zip(sm.runtime.units, sm2.runtime.units))
    return dict(extra=extra, same=same, warned=warned, old=old.name, new=new.name)


def load_different_checkpoints(rank, world, root_a: str, root_b: str, how: str) -> str | None:
    """Two saves (into two roots, or both kept in one); each rank is given another one to load:
    ``roots``: rank r loads root r; ``explicit``: rank 0 names the older save directory of root_a,
    the others load root_a (whose LATEST names the newer)."""
    import shutil
    from pathlib import Path

    sm, opt = _setup(segment())
    first = yashard.save_checkpoint(root_a, sm, opt, extra={"step": 1})
    dist.barrier()
    if rank == 0 and how == "explicit":
        shutil.copytree(first, Path(root_a).parent / "kept")
    dist.barrier()
    yashard.save_checkpoint(root_b if how == "roots" else root_a, sm, opt, extra={"step": 2})
    dist.barrier()
    if rank == 0 and how == "explicit":
        shutil.copytree(Path(root_a).parent / "kept", first)
    dist.barrier()
    given = {"roots": [root_a, root_b][rank % 2], "explicit": str(first) if rank == 0 else root_a}[how]
    try:
        yashard.load_checkpoint(given, *_setup(segment(seed=3)))
    except yashard.checkpoint.CheckpointError as e:
        return str(e)
    return None


def persistent_buffers_travel(rank, world, root: str) -> dict:
    """DeepSeek-V3, whose routers hold a persistent buffer (``e_score_correction_bias``) that an
    expert-balancing training loop updates: set it after ``shard()``, then export_hf, save_checkpoint
    and dcp.save; zero it, load_checkpoint; zero it, dcp.load. The logits before, the buffers after each load."""
    import torch.distributed.checkpoint as dcp

    sm = yashard.shard(build("deepseek_v3", seed=3))
    biases = {n: b for n, b in sm.module.named_buffers() if n.endswith("e_score_correction_bias")}
    with torch.no_grad():
        for i, b in enumerate(biases.values()):
            b.copy_(torch.linspace(-3, 3, b.numel()) * (i + 1))
        ids = batches(1, 2, 12, 96, seed=4)[0]
        logits = sm(input_ids=ids).logits
    yashard.export_hf(sm, os.path.join(root, "hf"))
    yashard.save_checkpoint(os.path.join(root, "ckpt"), sm)
    dcp.save(sm.sharded_state_dict(), checkpoint_id=os.path.join(root, "dcp"))
    set_to = {n: b.clone() for n, b in biases.items()}
    after = {}
    for how in ("load_checkpoint", "dcp.load"):
        with torch.no_grad():
            for b in biases.values():
                b.zero_()
        if how == "load_checkpoint":
            yashard.load_checkpoint(os.path.join(root, "ckpt"), sm)
        else:
            dcp.load(sm.sharded_state_dict(), checkpoint_id=os.path.join(root, "dcp"))
        after[how] = {n: b.clone() for n, b in biases.items()}
    return dict(logits=logits, ids=ids, set_to=set_to, after=after)
