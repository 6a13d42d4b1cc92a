"""Filling the fp32 master shards: from live weights, from a HuggingFace folder, or by initialisation.

:func:`yashard.shard` accepts three kinds of models, and no rank ever holds more of the full model
than one parameter (meta model) or one unit (live model) at a time:

* **live** weights (the model was built on the CPU or loaded): each unit is flattened, rank 0's
  copy is broadcast (``sync_module_states``) and every rank keeps its shard;
* a model on the **meta** device plus ``weights=<HF folder>``: every rank reads just the rows that
  cover its shard from the safetensors files (:mod:`yashard.safetensors_io`); nothing is pickled;
* a model on the **meta** device alone: the model's own initialisation is replayed parameter by
  parameter, in the same order and with the same random draws as building it on the CPU, so the
  weights are identical to ``torch.manual_seed(s); AutoModelForCausalLM.from_config(cfg)`` with the
  same RNG state (see :func:`replay_initialisation`).

Buffers the model built on the meta device (rotary tables) are computed by the model's own
initialisation code; one left unset is an error, never garbage.
"""

from __future__ import annotations

import copy
import inspect
import json
import logging
import math
import os
import re
from contextlib import nullcontext
from types import SimpleNamespace
from typing import Callable

import torch
from torch import nn

from . import hf_names
from .layout import FlatLayout, shard_pieces
from .safetensors_io import SafetensorsFile

# (unit key, entry index) of every parameter, by id(param)
ParamIndex = dict[int, tuple[str, int]]


def is_meta_model(model: nn.Module) -> bool:
    """True when any parameter of ``model`` lives on the meta device."""
    return any(p.is_meta for p in model.parameters())


def _copy_pieces(master: torch.Tensor, layout: FlatLayout, rank: int, index: int, full: torch.Tensor) -> None:
    """Copy this rank's pieces of entry ``index`` from the full flattened tensor ``full``."""
    for piece in shard_pieces(layout, rank):
        if piece.entry == index:
            master[piece.shard_start : piece.shard_start + piece.numel].copy_(full[piece.entry_start : piece.entry_end])


# ------------------------------------------------------------------------------------------ live
def from_live(groups, layouts, masters, rank: int, broadcast: Callable[[torch.Tensor, str], None] | None) -> None:
    """Masters from materialised parameters; ``broadcast(flat, unit)`` syncs rank 0's copy."""
    for key, members in groups.items():
        layout = layouts[key]
        flat = torch.zeros(layout.padded, dtype=torch.float32, device=masters[key].device)
        for entry, (p, _, _) in zip(layout.entries, members):
            flat[entry.offset : entry.end].copy_(p.detach().reshape(-1))
        if broadcast is not None:
            broadcast(flat, key)
        lo, hi = layout.shard_range(rank)
        masters[key].copy_(flat[lo:hi])
        del flat


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
    from .checkpoint import _config_dict, config_diff

    try:  # config.json leaves defaults out: compare whole configs, read by the model's own config class
        # (already imported: a custom-code model's too, so nothing asks to trust remote code again)
        from transformers import AutoConfig

        config_class = type(cfg) if hasattr(type(cfg), "from_pretrained") else AutoConfig
        saved = _config_dict(SimpleNamespace(config=config_class.from_pretrained(folder.path)))
    except Exception:  # noqa: BLE001 - a config transformers cannot read: nothing to compare
        return
    changed = config_diff(saved, _config_dict(model))
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
                part = folder.read(name, piece.entry_start, piece.entry_end)
                masters[key][piece.shard_start : piece.shard_start + piece.numel].copy_(part)
    for key, sources in converted:
        layout = layouts[key]
        held = hf_names.from_stored(model, {n: folder.read(n).view(folder.shape(n)) for n in sources})
        for index, (entry, (_, _, fqns)) in enumerate(zip(layout.entries, groups[key])):
            value = held.get(fqns[0])
            if value is None or tuple(value.shape) != tuple(entry.shape):
                got = "nothing" if value is None else f"shape {list(value.shape)}"
                raise ValueError(f"{folder.path}: converting {', '.join(sources[:3])}, ... as transformers does gave "
                                 f"{got} for {fqns[0]}, whose shape is {list(entry.shape)}")
            _copy_pieces(masters[key], layout, rank, index, value.reshape(-1))
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
def _pretrained_model_class():
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency
        return ()
    return PreTrainedModel


def _hf_init_fn(module: nn.Module):
    """``module._initialize_weights`` as a one-argument callable, for HF models; else None."""
    if not isinstance(module, _pretrained_model_class()):
        return None
    f = module._initialize_weights
    if len(inspect.signature(f).parameters) >= 2:  # transformers 5.x: (module, is_custom_code)
        custom = type(module).is_custom_code() if hasattr(type(module), "is_custom_code") else False
        return lambda mod: f(mod, custom)
    return f


def _init_guard():
    """HF's guard that makes ``torch.nn.init`` respect ``_is_hf_initialized`` (5.x); else nothing."""
    try:
        from transformers import initialization as hf_init

        return hf_init.guard_torch_init_functions()
    except (ImportError, AttributeError):
        return nullcontext()


def _own_reset(module: nn.Module):
    """``reset_parameters`` of a module that owns parameters (``nn.Linear``, ``nn.Embedding``, ...)."""
    if not any(p is not None for p in module._parameters.values()):
        return None
    return getattr(type(module), "reset_parameters", None)


def added_modules(model: nn.Module) -> list[tuple[str, nn.Module, nn.Module | None]]:
    """The submodules of an HF model that its class does not build from its config (added, or put in
    place of one, after the model was built), outermost only, in the model's order, as ``(name,
    module, replaced)``: ``replaced`` is the module the class builds at that name (on the meta
    device), or None. On the CPU their constructors drew after the whole model's initialisation,
    which never touched them, and the modules they replaced were drawn and initialised in the model's
    sequence. Compared by name, type and own parameters' names and shapes with the same class built
    from a copy of the config on the meta device (which draws nothing); a module put in place of one
    of the same type and shapes cannot be told apart, and is initialised as the model's own. Empty
    for models that are not HF ``PreTrainedModel``s or cannot be rebuilt from their config."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(type(model), "_init_weights"):
        return []
    state = torch.get_rng_state()
    try:
        with torch.device("meta"):
            reference = type(model)(copy.deepcopy(config))
    except Exception:  # noqa: BLE001 - a class that needs more than its config: no comparison
        return []
    finally:
        torch.set_rng_state(state)

    def signature(m: nn.Module) -> tuple:
        return type(m), tuple((n, tuple(p.shape)) for n, p in m._parameters.items() if p is not None)

    built = dict(reference.named_modules())
    added = []
    for name, module in model.named_modules():
        if any(name.startswith(r + ".") for r, _, _ in added):
            continue
        original = built.get(name)
        if original is None or signature(original) != signature(module):
            added.append((name, module, original))
    if added:
        logger.info("yashard: meta-device init: %s not built by %s(config): initialised by their own "
                    "reset_parameters after the rest of the model, as a CPU build that added them after "
                    "from_config draws them", ", ".join(n for n, _, _ in added[:4]) + (" ..." if len(added) > 4 else ""),
                    type(model).__name__)
    return added


class _Replay:
    """Replays, parameter by parameter, what building a model on the CPU does to it and to the RNG.

    Building an HF model runs, for every module in registration order, its constructor: children
    first, then its own ``reset_parameters`` draw (``nn.Linear``, ``nn.Embedding``), and for every
    ``PreTrainedModel`` (the inner ``LlamaModel`` too) at the end of its constructor ``post_init``:
    HF's initialisation of every not-yet-initialised module of its subtree, children first. Here
    the constructor draws are made into scratch memory (recording the RNG state before each), and
    each module is materialised only when its HF initialisation runs: its parameters first get
    their constructor values back (replayed from the recorded RNG state), then the HF
    initialisation overwrites what it initialises, exactly as on the CPU.
    """

    def __init__(self, model: nn.Module, on_param):
        self.model = model
        self.on_param = on_param
        self.snapshots: dict[int, torch.Tensor] = {}   # id(module) -> RNG state before its reset
        self.done: set[int] = set()                    # modules whose final values are delivered
        self.delivered: set[int] = set()               # id(meta param) already handed out
        self.unset: list[str] = []
        self.buffers: list[tuple[str, nn.Module, str]] = []  # materialised here: checked by check_buffers
        self.names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
        self.added = added_modules(model)              # built after the model: drawn after it, no HF init
        self.added_ids = {id(m) for _, m, _ in self.added}
        self.stand_ins: set[int] = set()               # id(param) of replaced modules: drawn, not delivered

    def _put(self, name: str, module: nn.Module) -> None:
        parent, _, child = name.rpartition(".")
        setattr(self.model.get_submodule(parent) if parent else self.model, child, module)

    def run(self) -> None:
        replaced = [(n, m, r) for n, m, r in self.added if r is not None]
        with torch.no_grad(), _init_guard():
            try:  # the modules replaced after from_config are drawn in their place, and thrown away
                for name, _, original in replaced:
                    self._put(name, original)
                    self.stand_ins.update(id(p) for p in original.parameters())
                self.construct(self.model)
            finally:
                for name, module, _ in replaced:
                    self._put(name, module)
            for _, module, _ in self.added:  # as on the CPU: constructed after from_config, in model order
                self.construct(module)
            # Modules outside any HF model (plain torch models): their constructor values are final.
            for module in self.model.modules():
                if id(module) not in self.done:
                    self.finalise(module, None)
        self.check_buffers()
        if self.unset:
            raise ValueError(
                f"{', '.join(self.unset[:4])} of the meta-device model are set by no initialisation (no "
                "reset_parameters, not an HF-initialised module); build the model on the CPU, or pass "
                "weights=<HF folder> to yashard.shard"
            )

    def construct(self, module: nn.Module) -> None:
        for child in module.children():
            if id(child) not in self.added_ids:
                self.construct(child)
        reset = _own_reset(module)
        if reset is not None and any(p.is_meta for p in module._parameters.values() if p is not None):
            self.snapshots[id(module)] = torch.get_rng_state()
            scratch = copy.copy(module)
            scratch._parameters = {n: (nn.Parameter(torch.empty(p.shape, dtype=p.dtype)) if p is not None else None)
                                   for n, p in module._parameters.items()}
            reset(scratch)
        fn = _hf_init_fn(module)
        if fn is not None:
            self.hf_init(module, fn)

    def hf_init(self, module: nn.Module, fn) -> None:
        for child in module.children():
            if id(child) not in self.added_ids:
                self.hf_init(child, _hf_init_fn(child) or fn)
        if id(module) not in self.done:
            self.finalise(module, fn)

    def finalise(self, module: nn.Module, fn) -> None:
        """Materialise ``module``'s own tensors, give them their final values, deliver, drop."""
        self.done.add(id(module))
        name = self.names.get(id(module), type(module).__name__)
        for bname, b in module._buffers.items():
            if b is not None and b.is_meta:
                fresh = torch.empty(b.shape, dtype=b.dtype)
                if fresh.is_floating_point():
                    fresh.fill_(float("nan"))
                module._buffers[bname] = fresh
                self.buffers.append((name, module, bname))
        metas = {n: p for n, p in module._parameters.items() if p is not None and p.is_meta}
        for pname, meta in metas.items():
            fresh = torch.empty(meta.shape, dtype=meta.dtype)
            if fresh.is_floating_point():
                fresh.fill_(float("nan"))
            module._parameters[pname] = nn.Parameter(fresh, requires_grad=meta.requires_grad)
        if metas and id(module) in self.snapshots:  # the constructor's values, from its RNG state
            now = torch.get_rng_state()
            torch.set_rng_state(self.snapshots[id(module)])
            _own_reset(module)(module)
            torch.set_rng_state(now)
        if fn is not None:
            if hasattr(module, "_is_hf_initialized"):
                del module._is_hf_initialized
            fn(module)
        _recompute_rotary(module)
        for pname, meta in metas.items():
            value = module._parameters[pname].detach()
            module._parameters[pname] = meta
            if id(meta) in self.delivered or id(meta) in self.stand_ins:
                continue  # tied: the first module to initialise it wins (HF ties after initialising)
            if value.is_floating_point() and torch.isnan(value).any():
                self.unset.append(f"parameter {name}.{pname}")
                continue
            self.delivered.add(id(meta))
            self.on_param(meta, value)

    def check_buffers(self) -> None:
        """Name every buffer materialised here that no initialisation set. Checked once every module
        is done, not when its own module is: an ancestor's initialisation may set it (Falcon-H1's
        model sets every layer's ``mamba.mup_vector``), as it runs after its children's."""
        for name, module, bname in self.buffers:
            b = module._buffers.get(bname)
            if b is not None and b.is_floating_point() and torch.isnan(b).any():
                self.unset.append(f"buffer {name}.{bname}")


def _recompute_rotary(module: nn.Module) -> None:
    """HF rotary embeddings compute ``inv_freq`` in their constructor; transformers 5 also does it in
    ``_init_weights``, 4.x does not. Where it is still unset, compute it the constructor's way."""
    buf = module._buffers.get("inv_freq")
    init = getattr(module, "rope_init_fn", None)
    if buf is None or init is None or not hasattr(module, "config") or not torch.isnan(buf).any():
        return
    inv_freq, scaling = init(module.config, "cpu")
    module._buffers["inv_freq"] = inv_freq.to(buf.dtype)
    if hasattr(module, "original_inv_freq"):
        module.original_inv_freq = module._buffers["inv_freq"]
    if hasattr(module, "attention_scaling"):
        module.attention_scaling = scaling


def replay_initialisation(model: nn.Module, on_param: Callable[[nn.Parameter, torch.Tensor], None]) -> None:
    """Initialise a meta-device model one module at a time, exactly as building it on the CPU would.

    Contract: the global CPU RNG is consumed exactly as by ``from_config`` on the CPU, and every
    parameter gets bitwise the value it would have there (see :class:`_Replay` for the order).
    ``on_param(meta_param, value)`` receives each parameter once, right after its module was
    initialised; the value is dropped afterwards, so memory peaks at one module. Meta buffers
    (rotary tables) are materialised on the CPU and kept. A parameter or buffer that no
    initialisation sets raises, naming it. Parameters stay on the meta device.
    """
    _Replay(model, on_param).run()


def from_init(model: nn.Module, groups, layouts, masters, rank: int, index: ParamIndex) -> None:
    """Masters by replaying the model's own initialisation (see :func:`replay_initialisation`)."""

    def on_param(meta: nn.Parameter, value: torch.Tensor) -> None:
        key, i = index[id(meta)]
        _copy_pieces(masters[key], layouts[key], rank, i, value.reshape(-1).to(torch.float32))

    replay_initialisation(model, on_param)


def init_meta_buffers(model: nn.Module) -> None:
    """Compute the meta buffers (rotary tables) of a model whose parameters come from elsewhere.

    Runs the model's own initialisation on the modules that hold meta buffers and then on their
    ancestors (children first, as HF initialises: an ancestor may set a descendant's buffer), with
    scratch parameters whose values are discarded (draws included), so only the buffers are kept.
    """
    holders = [m for m in model.modules() if any(b is not None and b.is_meta for b in m._buffers.values())]
    if not holders:
        return
    state = torch.get_rng_state()
    owner_fn = {}
    def walk(module, fn):
        for child in module.children():
            walk(child, _hf_init_fn(child) or fn)
        owner_fn[id(module)] = fn
    walk(model, _hf_init_fn(model))
    replay = _Replay(model, lambda meta, value: None)
    wanted = {id(m) for m in holders}
    order = []  # the holders and their ancestors, children first

    def post_order(module) -> bool:
        below = False
        for child in module.children():
            below |= post_order(child)
        if below or id(module) in wanted:
            order.append(module)
            return True
        return False

    post_order(model)
    with torch.no_grad(), _init_guard():
        for module in order:
            replay.finalise(module, owner_fn[id(module)])
    torch.set_rng_state(state)
    replay.check_buffers()
    if replay.unset:
        unset = [u for u in replay.unset if u.startswith("buffer")]
        if unset:
            raise ValueError(
                f"{', '.join(unset[:4])} of the meta-device model are set by no initialisation; build the "
                "model on the CPU (or materialise those buffers) before yashard.shard"
            )
