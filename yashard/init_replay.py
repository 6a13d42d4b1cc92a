"""Initialising a meta-device model's master shards by replaying its own initialisation.

The model's own initialisation is replayed parameter by parameter, in the same order and with the
same random draws as building it on the CPU, so the weights are identical to
``torch.manual_seed(s); AutoModelForCausalLM.from_config(cfg)`` with the same RNG state (see
:func:`replay_initialisation`). Buffers the model built on the meta device (rotary tables) are
computed by the model's own initialisation code; one left unset is an error, never garbage.
"""

from __future__ import annotations

import copy
import inspect
import logging
from contextlib import nullcontext
from typing import Callable

import torch
from torch import nn

from .materialize import ParamIndex, copy_pieces

logger = logging.getLogger("yashard")


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
        copy_pieces(masters[key], layouts[key], rank, i, value.reshape(-1).to(torch.float32))

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
