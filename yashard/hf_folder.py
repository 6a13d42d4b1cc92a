"""Reading a HuggingFace folder into the master shards: each rank reads only its rows.

A model on the meta device plus ``weights=<HF folder>``: every rank reads just the rows that cover
its shard from the safetensors files (:mod:`yashard.safetensors_io`); nothing is pickled. Names
stored in a layout transformers converts when loading (fused MoE experts) are converted as
``from_pretrained`` converts them (:mod:`yashard.hf_names`), one unit at a time. A folder whose
weights would mean something else in the model is refused; tensors the model has no place for and
config fields that change the computation are logged.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from types import SimpleNamespace

import torch
from torch import nn

from . import hf_names
from .config_compare import config_diff, config_dict
from .layout import FlatLayout, shard_pieces
from .materialize import copy_pieces
from .safetensors_io import SafetensorsFile

logger = logging.getLogger("yashard")

# Stored dtypes a folder's weights may have: yashard widens them to its fp32 masters as they are.
FLOAT_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


# ------------------------------------------------------------------------------------------ folder
class HFFolder:
    """The safetensors files of a HuggingFace checkpoint folder (headers read on first use)."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        if not os.path.isdir(self.path):
            raise FileNotFoundError(f"weights={self.path!r} is not a directory; pass a HuggingFace checkpoint folder")
        index = os.path.join(self.path, "model.safetensors.index.json")
        single = os.path.join(self.path, "model.safetensors")
        self._files: dict[str, SafetensorsFile] = {}
        if os.path.exists(single):  # transformers' order: a single file wins over an index beside it
            if os.path.exists(index):
                logger.warning("yashard: %s holds both model.safetensors and model.safetensors.index.json; "
                               "reading model.safetensors, as transformers' from_pretrained does (the index is "
                               "left over from an earlier sharded save: delete it, or the single file)", self.path)
            weight_map = {k: "model.safetensors" for k in self._file("model.safetensors").keys()}
        elif os.path.exists(index):
            with open(index) as f:
                try:
                    weight_map = json.load(f)["weight_map"]
                except (ValueError, KeyError, TypeError) as e:
                    raise ValueError(f"{index} is not a safetensors index (no 'weight_map'): {e}") from None
        else:
            found = sorted(os.listdir(self.path))
            pickled = [f for f in found if f.endswith((".bin", ".pt", ".pth", ".pkl"))]
            hint = (" It holds pickled weights, which yashard never loads (unpickling runs code): re-save them "
                    "with save_pretrained(..., safe_serialization=True)." if pickled else "")
            raise FileNotFoundError(
                f"{self.path} has neither model.safetensors nor model.safetensors.index.json "
                f"(found: {', '.join(found[:10]) or 'nothing'}).{hint}"
            )
        self.weight_map: dict[str, str] = weight_map
        self._stored: dict[str, str] = {}  # name the model uses -> name in the files, where they differ
        self.prefix_added = ""

    def add_prefix(self, lead: str) -> None:
        """Read every stored name ``n`` as ``lead + n`` (a base model's checkpoint read into the model
        that wraps it)."""
        self._stored = {lead + k: self._stored.get(k, k) for k in self.weight_map}
        self.weight_map = {lead + k: v for k, v in self.weight_map.items()}
        self.prefix_added = lead

    def _file(self, filename: str) -> SafetensorsFile:
        if filename not in self._files:
            path = os.path.join(self.path, filename)
            if not os.path.exists(path):
                raise FileNotFoundError(
                    f"{self.path}: model.safetensors.index.json lists {filename}, which is not in the folder; "
                    "copy the whole checkpoint folder (every file its index names)"
                )
            self._files[filename] = SafetensorsFile(path)
        return self._files[filename]

    def _holding(self, name: str) -> tuple[SafetensorsFile, str]:
        file = self._file(self.weight_map[name])
        name = self._stored.get(name, name)
        if name not in file.tensors and name not in file.unreadable:
            raise ValueError(
                f"{self.path}: model.safetensors.index.json places {name} in {self.weight_map[name]}, which does "
                "not hold it; the index and the files come from different saves: copy the folder again"
            )
        return file, name

    def shape(self, name: str) -> tuple[int, ...]:
        file, stored = self._holding(name)
        return file.shape(stored)

    def dtype(self, name: str) -> torch.dtype:
        file, stored = self._holding(name)
        return file.dtype(stored)

    def read(self, name: str, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """Elements ``[lo, hi)`` of the flattened tensor ``name`` (all of it by default), 1-D."""
        file, stored = self._holding(name)
        return file.read(stored, lo, hi)

    def config(self) -> dict | None:
        """The folder's ``config.json``, if it has one."""
        path = os.path.join(self.path, "config.json")
        if not os.path.exists(path):
            return None
        with open(path) as f:
            return json.load(f)


def align_base_prefix(folder: HFFolder, model: nn.Module) -> None:
    """A base model's checkpoint (``LlamaModel.save_pretrained``: ``embed_tokens.weight``) read into
    the causal LM that wraps it (``model.embed_tokens.weight``): every stored name gains the model's
    ``base_model_prefix``, as transformers' loader adds it. Nothing changes when any stored name
    already carries the prefix or no stored name fits the model with it."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    if not prefix:
        return
    lead = prefix + "."
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    names |= {n for n, _ in model.named_buffers(remove_duplicate=False)}
    if any(k.startswith(lead) for k in folder.weight_map):
        return
    if any(lead + k in names for k in folder.weight_map):
        folder.add_prefix(lead)
        logger.info("yashard: %s holds a base model (names without %r): read as %s<name>, as transformers does",
                    folder.path, lead, lead)


def check_folder_config(folder: HFFolder, model: nn.Module, warn: bool = True) -> None:
    """Refuse a folder whose weights would mean something else in ``model``: quantized weights
    (their scales live in other tensors) and another architecture; warn when config fields that
    change the computation differ."""
    saved = folder.config()
    if saved is None:
        return
    quant = saved.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise ValueError(
            f"{folder.path} holds quantized weights (config.json quantization_config: {method}); yashard loads "
            "float weights only and would read the quantized codes without their scales. Dequantize first (load "
            "it with transformers and save_pretrained a bf16 or fp32 copy)"
        )
    cfg = getattr(model, "config", None)
    ours, theirs = getattr(cfg, "model_type", None), saved.get("model_type")
    if ours and theirs and ours != theirs:
        raise ValueError(
            f"{folder.path} is a {theirs} checkpoint (config.json model_type) and the model is a {ours}; the same "
            "names can mean other computations (Gemma's norms scale by 1 + w). Build the model from the folder's "
            "config: yashard.from_pretrained(folder)"
        )
    if not warn:
        return
    try:  # config.json leaves defaults out: compare whole configs, read by the model's own config class
        # (already imported: a custom-code model's too, so nothing asks to trust remote code again)
        from transformers import AutoConfig

        config_class = type(cfg) if hasattr(type(cfg), "from_pretrained") else AutoConfig
        saved = config_dict(SimpleNamespace(config=config_class.from_pretrained(folder.path)))
    except Exception:  # noqa: BLE001 - a config transformers cannot read: nothing to compare
        return
    changed = config_diff(saved, config_dict(model))
    if changed:
        logger.warning("yashard: the model's config differs from %s/config.json in fields that change the "
                       "computation: %s", folder.path, "; ".join(changed))


def config_architectures(folder: HFFolder) -> str:
    """The class names the folder's config.json says saved it, for messages."""
    arch = (folder.config() or {}).get("architectures") or ["a class its config.json does not name"]
    return ", ".join(map(str, arch))


def _converted_sources(folder: HFFolder, model: nn.Module, layout: FlatLayout,
                       members) -> tuple[list[str], list[str]] | None:
    """The stored names a unit's weights are converted from (a transformers-5 MoE layer's experts,
    stored one tensor per expert: :mod:`yashard.hf_names`) and those of them stored with other
    shapes than the conversion needs (``name: folder [..], model [..]``), when the folder holds all
    of them; else None."""
    held = [(fqns[0], entry.shape) for entry, (_, _, fqns) in zip(layout.entries, members)]
    stored = hf_names.stored_shapes(model, held)
    if not all(n in folder.weight_map for n, _ in stored):
        return None
    wrong = [f"{n}: folder {list(folder.shape(n))}, model {list(shape)}" for n, shape in stored
             if tuple(folder.shape(n)) != shape]
    for n, _ in stored:
        _check_float(folder, n)
    return [n for n, _ in stored], wrong


def _check_float(folder: HFFolder, name: str) -> None:
    dtype = folder.dtype(name)
    if dtype not in FLOAT_WEIGHT_DTYPES:
        raise ValueError(
            f"{folder.path}: {name} is stored as {dtype}; yashard loads float weights only (fp32, bf16, fp16, fp64) "
            "and would read quantized codes as numbers. Dequantize the checkpoint first"
        )


def from_folder(folder: HFFolder, model: nn.Module, groups, layouts, masters, rank: int) -> set[str]:
    """Masters from a HF folder: each rank reads only the rows that cover its shard. A unit stored
    in another form (per-expert tensors of a fused MoE layer) is read whole, converted as
    transformers converts it, and this rank's part kept (one unit's extra memory). Returns the
    names read (tied names included)."""
    missing, wrong = [], []
    plan = []
    converted = []
    used = set()
    for key, members in groups.items():
        layout = layouts[key]
        if (not all(any(n in folder.weight_map for n in fqns) for _, _, fqns in members)
                and hf_names.converts(model)):
            found = _converted_sources(folder, model, layout, members)
            if found is not None:
                sources, mismatched = found
                wrong.extend(mismatched)
                if not mismatched:
                    converted.append((key, sources))
                used.update(sources)
                continue
        for index, (entry, (_, _, fqns)) in enumerate(zip(layout.entries, members)):
            present = [n for n in fqns if n in folder.weight_map]
            if not present:
                missing.append(" / ".join(fqns))
                continue
            name = present[0]
            stored = folder.shape(name)
            if stored != entry.shape:
                wrong.append(f"{name}: folder {list(stored)}, model {list(entry.shape)}")
                continue
            _check_float(folder, name)
            for other in present[1:]:  # the model ties these names: the folder must hold one tensor
                _check_tied(folder, name, other)
            used.update(present)
            plan.append((key, index, name))
    if missing or wrong:
        parts = []
        if missing:
            parts.append(f"{len(missing)} parameter(s) of the model are not in the folder ({', '.join(missing[:4])}"
                         f"{', ...' if len(missing) > 4 else ''})")
        if wrong:
            parts.append(f"{len(wrong)} have other shapes ({'; '.join(wrong[:4])}{'; ...' if len(wrong) > 4 else ''})")
        known = {n for members in groups.values() for _, _, fqns in members for n in fqns}
        unknown = sorted(k for k in folder.weight_map if k not in known)
        hint = ""
        if missing and unknown:
            hint = (f" The folder stores names the model does not have (e.g. {unknown[0]}): yashard reads names as "
                    "stored or as the conversions transformers registers for the model's class turn them (Mixtral's "
                    "experts, for one), and these fit neither; if transformers loads this folder, load it with "
                    "AutoModelForCausalLM.from_pretrained and pass that model to yashard.shard (rank 0's weights are "
                    "broadcast).")
        advice = ("Build the model from the folder's own config.json (AutoConfig.from_pretrained(folder)) or use "
                  "yashard.from_pretrained(folder).")
        if missing and folder.prefix_added:
            advice = (f"The folder holds a base model ({config_architectures(folder)}, names without "
                      f"{folder.prefix_added!r}), which has no output head: tie the head to the embedding "
                      "(tie_word_embeddings=True), or load it with AutoModelForCausalLM.from_pretrained(folder), "
                      "which draws a new head, and pass that model to yashard.shard.")
        raise ValueError(f"the weights in {folder.path} do not fit the model: {' and '.join(parts)}. {advice}" + hint)
    for key, index, name in plan:
        layout = layouts[key]
        entry = layout.entries[index]
        for piece in shard_pieces(layout, rank):
            if piece.entry == index:
                part = folder.read(name, piece.entry_start, piece.entry_end)  # (in fp32: masters.py)
                masters[key][piece.shard_start : piece.shard_start + piece.numel].copy_(part.float())
    for key, sources in converted:
        layout = layouts[key]
        held = hf_names.from_stored(model, {n: folder.read(n).view(folder.shape(n)) for n in sources})
        for index, (entry, (_, _, fqns)) in enumerate(zip(layout.entries, groups[key])):
            value = held.get(fqns[0])
            if value is None or tuple(value.shape) != tuple(entry.shape):
                got = "nothing" if value is None else f"shape {list(value.shape)}"
                raise ValueError(f"{folder.path}: converting {', '.join(sources[:3])}, ... as transformers does gave "
                                 f"{got} for {fqns[0]}, whose shape is {list(entry.shape)}")
            copy_pieces(masters[key], layout, rank, index, value.reshape(-1).float())
    return used


def _check_tied(folder: HFFolder, a: str, b: str, chunk: int = 1 << 24) -> None:
    """The model ties ``a`` and ``b`` (one parameter) and the folder stores both: they must be equal,
    or one of them would be dropped (transformers 5 then leaves the two untied)."""
    if folder.shape(b) != folder.shape(a):
        raise ValueError(f"{folder.path}: the model ties {a} and {b}, which the folder stores with other shapes")
    numel = math.prod(folder.shape(a))
    for lo in range(0, numel, chunk):
        hi = min(lo + chunk, numel)
        if not torch.equal(folder.read(a, lo, hi).float(), folder.read(b, lo, hi).float()):
            raise ValueError(
                f"{folder.path} stores {a} and {b} with different values, but the model ties them (its config has "
                "tie_word_embeddings=True): one would be dropped. Build the model with tie_word_embeddings=False "
                "(as transformers does for such a folder), or save the folder with tied weights"
            )


def warn_unused(folder: HFFolder, model: nn.Module, used: set[str]) -> None:
    """Log the folder's tensors the model has no place for (another model's, or more layers), as
    transformers' load report does; tensors the model class declares ignorable are left out."""
    ignore = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])]
    extra = sorted(k for k in folder.weight_map if k not in used and not k.endswith("rotary_emb.inv_freq")
                   and not any(p.search(k) for p in ignore))
    if extra:
        logger.warning("yashard: %d tensor(s) in %s have no place in the model and were not loaded: %s%s",
                       len(extra), folder.path, ", ".join(extra[:6]), ", ..." if len(extra) > 6 else "")


def load_buffers_from_folder(model: nn.Module, folder: HFFolder) -> set[str]:
    """Persistent buffers stored in the folder are read from it, under their own names or the one
    the model's checkpoints store them under (a router bias a MoE conversion renames:
    :mod:`yashard.hf_names`); returns the names read."""
    done = set()
    renames = hf_names.converts(model)
    for mod_name, module in model.named_modules():
        for name, buf in module._buffers.items():
            fqn = f"{mod_name}.{name}" if mod_name else name
            if buf is None or name in module._non_persistent_buffers_set:
                continue
            shape = tuple(buf.shape)
            where = fqn
            if where not in folder.weight_map and renames:
                stored_as = hf_names.stored_shapes(model, [(fqn, shape)])
                where = stored_as[0][0] if len(stored_as) == 1 else fqn
            if where not in folder.weight_map:
                continue
            stored = tuple(folder.shape(where))
            if stored != shape:
                raise ValueError(
                    f"{folder.path} stores buffer {where} with shape {list(stored)} and the model's is {list(shape)}; "
                    "build the model from the folder's own config (yashard.from_pretrained(folder)) or drop the "
                    "buffer from the folder"
                )
            value = folder.read(where, 0, math.prod(shape)).view(shape).to(buf.dtype)
            module._buffers[name] = value
            done.add(where)
    return done


# ------------------------------------------------------------------------------------------ init
