"""Export a sharded model as a HuggingFace sharded-safetensors folder, one unit at a time.

The folder ``from_pretrained`` reads::

    <path>/
      config.json                          model.config.save_pretrained (dtype set to the export dtype)
      generation_config.json               when the model has one
      model.safetensors.index.json         {"metadata": {"total_size": bytes}, "weight_map": {name: file}}
      model-00001-of-000NN.safetensors     the tensors in unit order (embedding, decoder layers, lm_head,
      ...                                  norm group), packed into files of at most ``max_shard_size``

or, as ``save_pretrained`` writes it, a single ``model.safetensors`` and no index when everything
fits in one file. Which tensor goes to which file is planned before anything is gathered
(:func:`plan_files`): every size is known from the layouts.

Streaming: for each unit every rank joins one all-gather of the unit's flat vector into a temporary
buffer and rank 0 appends that unit's tensors (cast to ``dtype``) to the file(s) they are planned
in, so the extra memory is one unit. Tensors are stored under the names and in the form the
model's checkpoints use, as ``save_pretrained`` writes them (a transformers-5 MoE layer's fused
experts one tensor per expert: :mod:`yashard.hf_names`). With tied input/output embeddings only
the input embedding is stored; ``from_pretrained`` re-ties the output embedding to it
(transformers lists it in ``_tied_weights_keys``). Persistent buffers (a router's score-correction
bias, ...) follow the parameters, rank 0's copy in the dtype the model holds them in, as
``save_pretrained`` stores them (``state_dict()`` holds them; non-persistent ones, such as rotary
tables, are rebuilt by the model and not stored).

Atomic protocol: rank 0 writes into a fresh sibling directory ``.<name>.yashard-tmp-<random>``,
copies in what an existing ``path`` holds beside weights (tokenizer files, chat templates, READMEs:
``save_pretrained`` leaves those too; weight files of an earlier save are dropped), fsyncs every file
and the directory, then publishes it in one step: ``rename`` when ``path`` does not
exist, else an atomic exchange of the two directories (Linux ``renameat2(RENAME_EXCHANGE)``) after
which the old export is deleted. Where the exchange is unsupported (non-Linux, NFS) it falls back to
two renames (old aside to ``.<name>.yashard-old-<random>``, new in): a crash between them leaves
``path`` missing but both complete folders on disk, never a partial folder at ``path``; the next
export to the same path first moves the previous folder back (with a warning), so a crash of that
export leaves it in place. Leftover temporary siblings of killed exports are then removed.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import re
import secrets
import shutil
from pathlib import Path

import torch

from ._io import StreamedSafetensors, exchange_dirs, fsync_dir, fsync_file
from .call_gate import enter
from .checkpoint import CheckpointError, agree
from .hf_names import stored_shapes, to_stored
from .masters import gather_whole
from .peft_adapter import check_no_peft_names, check_plain_names, gather_units, lora_merge_plan, plain_name
from .saved_state import persistent_buffers
from .sharded_model import runtime_of

logger = logging.getLogger("yashard")

WEIGHTS_INDEX = "model.safetensors.index.json"
WEIGHTS_SINGLE = "model.safetensors"
DEFAULT_MAX_SHARD_SIZE = "50GB"   # transformers 5's save_pretrained default
_EXPORT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or a string such as ``"5GB"`` (10**9 bytes) or ``"500MiB"`` (2**20)."""
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise TypeError(f"max_shard_size must be an int (bytes) or a string like '5GB', got {type(size).__name__}")
    if isinstance(size, int):
        n = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b|b)?\s*", size.lower())
        if m is None:
            raise ValueError(f"max_shard_size={size!r} is not a size; write bytes as an int or a string like "
                             "'5GB', '500MB' or '2GiB'")
        n = int(float(m.group(1)) * _UNITS[m.group(2) or ""])
    if n <= 0:
        raise ValueError(f"max_shard_size={size!r} must be positive")
    return n


def plan_files(nbytes: list[int], limit: int) -> list[int]:
    """The file (0-based) of each tensor, in order: a file takes tensors until the next would take
    it past ``limit`` bytes; a tensor larger than ``limit`` gets a file of its own."""
    out, f, used = [], 0, 0
    for n in nbytes:
        if used and used + n > limit:
            f, used = f + 1, 0
        out.append(f)
        used += n
    return out


def export_file_name(i: int, n: int) -> str:
    """HF's name of shard ``i`` (1-based) of ``n``."""
    return f"model-{i:05d}-of-{n:05d}.safetensors"


def _input_embedding_name(hf) -> str | None:
    get = getattr(hf, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    for name, module in hf.named_modules():
        if module is emb:
            return f"{name}.weight"
    return None


def stored_names(fqns: list[list[str]], input_embedding: str | None) -> list[str]:
    """Per entry, the one HF name to store: the input embedding's for tied embeddings, else the first."""
    return [input_embedding if input_embedding in names else names[0] for names in fqns]


# Files a model folder holds beside its config and weights (tokenizers, templates, model cards):
# a folder of only these is where a tokenizer was saved first, as HF workflows do
_COMPANION_FILE = re.compile(
    r"tokenizer(_config)?\.json|special_tokens_map\.json|added_tokens\.json|vocab\.(json|txt)|merges\.txt|"
    r".*\.(model|tiktoken)|chat_template\.(jinja|json)|(preprocessor|processor)_config\.json|"
    r"generation_config\.json|README\.md|\.gitattributes"
)


def _looks_like_model_folder(p: Path) -> bool:
    names = set(os.listdir(p))
    return "config.json" in names or all(_COMPANION_FILE.fullmatch(n) for n in names)


def _prepare(dest: Path) -> Path:
    """Check ``dest`` (rank 0), remove leftovers of killed exports, create the temporary directory."""
    if dest.exists() and not dest.is_dir():
        raise CheckpointError(f"export_hf path {dest} is a file; pass a directory path")
    if dest.is_dir() and not _looks_like_model_folder(dest):
        shown = ", ".join(sorted(os.listdir(dest))[:5])
        raise CheckpointError(
            f"export_hf path {dest} exists and is not a model folder (it holds {shown}, no config.json and "
            "not only tokenizer files); export to a new path, or remove it first"
        )
    parent = dest.parent
    parent.mkdir(parents=True, exist_ok=True)
    old_prefix, tmp_prefix = f".{dest.name}.yashard-old-", f".{dest.name}.yashard-tmp-"
    olds = [parent / n for n in os.listdir(parent) if n.startswith(old_prefix)]
    if olds and not dest.exists():  # killed between the fallback's two renames: put the previous export back
        back = max(olds, key=lambda p: p.stat().st_mtime)
        os.rename(back, dest)
        fsync_dir(parent)
        logger.warning("export_hf: %s was missing and %s held the previous export (an export was killed while "
                       "publishing); moved it back before this export", dest, back.name)
    for name in os.listdir(parent):
        if name.startswith((tmp_prefix, old_prefix)):
            shutil.rmtree(parent / name, ignore_errors=True)
    tmp = parent / f".{dest.name}.yashard-tmp-{secrets.token_hex(4)}"
    tmp.mkdir()
    return tmp


# Weight files of any earlier save in the folder: replaced by this export, never carried over.
_WEIGHT_FILE = re.compile(r"(model|pytorch_model)(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?")


def _carry_over(dest: Path, tmp: Path) -> None:
    """Copy into ``tmp`` what ``dest`` holds beside weights and what the export writes (tokenizer
    files, chat templates, READMEs, subfolders), as ``save_pretrained`` leaves them in place."""
    if not dest.is_dir():
        return
    for f in dest.iterdir():
        if (tmp / f.name).exists() or _WEIGHT_FILE.fullmatch(f.name):
            continue
        if f.is_dir() and not f.is_symlink():
            shutil.copytree(f, tmp / f.name, symlinks=True)
        else:
            shutil.copy2(f, tmp / f.name, follow_symlinks=False)


def _publish(tmp: Path, dest: Path) -> None:
    _carry_over(dest, tmp)
    for root, _, files in os.walk(tmp):
        for name in files:
            if not os.path.islink(os.path.join(root, name)):
                fsync_file(os.path.join(root, name))
        fsync_dir(root)
    if not dest.exists():
        os.rename(tmp, dest)
    elif exchange_dirs(tmp, dest):
        shutil.rmtree(tmp)               # tmp now holds the previous export
    else:  # pragma: no cover - non-Linux or NFS
        old = dest.parent / f".{dest.name}.yashard-old-{secrets.token_hex(4)}"
        os.rename(dest, old)
        os.rename(tmp, dest)
        shutil.rmtree(old)
    fsync_dir(dest.parent)


def export_hf(model, path: str | os.PathLike, *, dtype: torch.dtype | None = None,
              max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> Path:
    """Write ``model``'s full weights as a HuggingFace folder that ``from_pretrained(path)`` loads.

    Collective: every rank calls it; rank 0 writes. Streamed unit by unit (peak extra memory: one
    unit's gathered flat vector), in HF's format: ``model.safetensors``, or, when the weights take
    more than ``max_shard_size`` (bytes, or a string like ``"5GB"``; default ``"50GB"`` as in
    ``save_pretrained``), ``model-0000i-of-0000N.safetensors`` files plus
    ``model.safetensors.index.json``; and ``config.json``. Tied embeddings are stored once, under the
    input embedding's name. ``dtype`` (float32 by default, or bfloat16 / float16) casts every tensor
    and is written to the config. Atomic (module docstring): ``path`` holds either the previous
    folder or the complete new one. Returns ``path``.

    A frozen unit's master kept in a 16-bit ``param_dtype`` is written as those values (widened to
    fp32, then cast to ``dtype``). A PEFT LoRA model is written as the plain HF model, its active
    adapters merged into the base weights (``W + B @ A * scaling``, as peft's ``merge_and_unload``),
    in fp32 over the base weights as held, then cast once to ``dtype``. LoRA on an ``lm_head`` tied
    to the embedding is merged into the ``lm_head`` alone, and a ``modules_to_save`` copy is written
    as the trained module under its plain name: the folder is then untied
    (``tie_word_embeddings=False``), as the trained model computes. PEFT layers it cannot merge
    (DoRA, LoRA on embeddings) are refused: save those with :func:`yashard.save_adapter`. So are
    PEFT names left in the sharded weights by ``unload()`` after ``shard()``.
    """
    rt = runtime_of(model, "export_hf")
    if any(u.rebuild is not None for u in rt.units):
        raise ValueError(
            "export_hf cannot write a 4-bit base (QLoRA): its layers hold bitsandbytes' packed weights, which an HF "
            "folder of float weights cannot hold and which a merge of the adapters would round again. Save the "
            "adapters with yashard.save_adapter and load them onto the 4-bit base with PeftModel.from_pretrained")
    comm = rt.comm
    enter(comm, "export_hf")
    dtype = torch.float32 if dtype is None else dtype
    if dtype not in _EXPORT_DTYPES:
        raise ValueError(f"export_hf dtype={dtype} is not supported; use torch.float32, torch.bfloat16 or torch.float16")
    limit = parse_size(max_shard_size)
    hf = rt.model
    units = rt.units
    emb = _input_embedding_name(hf)
    itemsize = torch.empty((), dtype=dtype).element_size()
    # A PEFT model's HF model is written as the plain HF model: base weights under their HF names
    # with the LoRA adapters merged in, no adapter weight (the adapters are gathered first)
    lora = lora_merge_plan(hf, [f for u in units for fqns in u.fqns for f in fqns])
    adapters = {}
    if lora is not None:
        needed = lora.needed
        adapters = gather_units(rt, [u for u in units if any(f in needed for fqns in u.fqns for f in fqns)])
    # Per unit, (stored name, entry) of each tensor it stores
    kept = [[(lora.stored_name(nm) if lora else nm, e) for nm, e in zip(stored_names(u.fqns, emb), u.layout.entries)]
            for u in units]
    kept = [[(nm, e) for nm, e in unit_kept if nm is not None] for unit_kept in kept]
    untie = False
    if lora is not None:
        # A tied weight one of whose names has an adapter merged in is stored under both names (the
        # embedding as held, the output embedding merged), as is a tied output embedding replaced by
        # a trained modules_to_save copy: the two differ, so the folder is untied (config below)
        for u, unit_kept in zip(units, kept):
            for e, fqns in zip(u.layout.entries, u.fqns):
                extra = {lora.stored_name(f) for f in fqns} & set(lora.merges)
                extra -= {nm for nm, _ in unit_kept}
                unit_kept.extend((nm, e) for nm in sorted(extra))
        chosen = set(stored_names([f for u in units for f in u.fqns], emb))
        tied_away = {plain_name(f) for u in units for fqns in u.fqns if len(fqns) > 1 for f in fqns} - chosen
        untie = any(nm in tied_away for unit_kept in kept for nm, _ in unit_kept)
    # (stored name, shape) of every tensor in unit order, as checkpoints of the model store them (a
    # MoE layer's fused experts split per expert: hf_names), then the persistent buffers, and the
    # file each goes to
    held = [[(nm, e.shape) for nm, e in unit_kept] for unit_kept in kept]
    if lora is not None:
        check_plain_names(nm for unit_held in held for nm, _ in unit_held)
    else:  # (always: unload() after shard() leaves PEFT names in the units and none in the modules)
        check_no_peft_names(nm for unit_held in held for nm, _ in unit_held)
    per_unit = [stored_shapes(hf, h) for h in held]
    tensors = [t for unit in per_unit for t in unit]
    buffers = list(to_stored(hf, dict(persistent_buffers(hf))).items())
    sizes = [math.prod(shape) * itemsize for _, shape in tensors] + [b.numel() * b.element_size() for _, b in buffers]
    file_of = plan_files(sizes, limit)
    n_files = file_of[-1] + 1
    fnames = [WEIGHTS_SINGLE] if n_files == 1 else [export_file_name(i + 1, n_files) for i in range(n_files)]
    specs: list[list] = [[] for _ in range(n_files)]
    for (nm, shape), f in zip(tensors, file_of):
        specs[f].append((nm, dtype, shape))
    for (nm, b), f in zip(buffers, file_of[len(tensors):]):
        specs[f].append((nm, b.dtype, tuple(b.shape)))
    dest = Path(os.path.realpath(path))  # a symlinked folder: write (and swap) its target, as save_pretrained
    err, tmp = None, None
    try:
        if comm.rank == 0:
            tmp = _prepare(dest)
    except Exception as e:  # noqa: BLE001 - shared with every rank by agree
        err = e
    tmp = Path(agree(comm, "export_hf", err, str(tmp) if tmp else None)[0])

    weight_map: dict[str, str] = {}
    total = 0
    err = None
    writer, at = None, 0   # the open file and the position of the next tensor in ``tensors``

    def put(i: int, nm: str, value: torch.Tensor) -> None:  # the i-th planned tensor, into its file
        nonlocal writer, total
        f = file_of[i]
        if writer is None or writer.path.name != fnames[f]:
            if writer is not None:
                writer.close()
                writer = None  # closed: nothing to abort if opening the next one fails
            writer = StreamedSafetensors(tmp / fnames[f], specs[f], metadata={"format": "pt"})
        writer.write(nm, value)
        weight_map[nm] = fnames[f]
        total += sizes[i]

    def failed(e: Exception) -> None:  # rank 0 stops writing; the other ranks still join the gathers
        nonlocal err, writer
        err = e
        if writer is not None:
            writer.abort()
        writer = None

    with torch.no_grad():
        for u, unit_kept, unit_stored in zip(units, kept, per_unit):
            if not unit_kept:  # (the adapter group, merged into the base weights: nothing of it is stored)
                continue
            flat = gather_whole(comm, u, u.master, "export_hf")  # (fp32: a 16-bit frozen master widened)
            mine = range(at, at + len(unit_stored))
            at = mine.stop
            if comm.rank != 0 or err is not None:
                continue  # keep joining the gathers: every rank issues the same collectives
            try:
                held_now = {nm: flat[e.offset:e.end].view(e.shape) for nm, e in unit_kept}
                if lora is not None:
                    held_now = {nm: lora.merged(nm, t, adapters) for nm, t in held_now.items()}
                stored = to_stored(hf, held_now)
                for i in mine:
                    nm, _ = tensors[i]
                    put(i, nm, stored[nm].to(dtype).contiguous())
            except Exception as e:  # noqa: BLE001
                failed(e)
            del flat
        if comm.rank == 0 and err is None:
            try:
                for i, (nm, b) in enumerate(buffers, start=len(tensors)):
                    put(i, nm, b.detach())
            except Exception as e:  # noqa: BLE001
                failed(e)
    if writer is not None and err is None:
        try:
            writer.close()
        except Exception as e:  # noqa: BLE001
            err = e
            writer.abort()
    try:
        if comm.rank == 0 and err is None:
            if n_files > 1:
                index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
                with open(tmp / WEIGHTS_INDEX, "w", encoding="utf-8") as f:
                    json.dump(index, f, indent=2)
                    f.flush()
                    os.fsync(f.fileno())
            cfg = copy.deepcopy(hf.config)
            cfg.dtype = dtype
            cfg.architectures = [type(hf).__name__]
            if untie:  # the output embedding differs from the input one: the merge cannot keep them tied
                for c in {id(cfg): cfg, id(cfg.get_text_config()): cfg.get_text_config()}.values():
                    c.tie_word_embeddings = False
            cfg.save_pretrained(tmp)
            gen = getattr(hf, "generation_config", None)
            if gen is not None:
                gen.save_pretrained(tmp)
            _publish(tmp, dest)
    except Exception as e:  # noqa: BLE001
        err = e
    if err is not None and comm.rank == 0 and tmp.exists():
        shutil.rmtree(tmp, ignore_errors=True)  # never published; the previous export is untouched
    agree(comm, "export_hf", err)
    return dest
