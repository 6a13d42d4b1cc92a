"""``yashard.hf.Accelerator``: Hugging Face Accelerate with yashard in place of DDP.

A drop-in subclass of ``accelerate.Accelerator``. What it changes, and only for a yashard model:

* ``prepare(model)`` shards an unsharded model (``ShardConfig`` from ``shard_config=``, or derived
  from ``mixed_precision``) and never wraps it in DDP: yashard reduces the gradients itself. A frozen
  model, or one prepared with ``evaluation_mode=True``, is left unsharded, as Accelerate leaves it
  without DDP. An FSDP, DeepSpeed or Megatron-LM plugin, or ``accelerate launch``'s variable for one,
  is refused.
  It places nothing: the shards already live on their device. No autocast wraps the forward:
  the model computes in ``ShardConfig.param_dtype``, which must match ``mixed_precision``.
* ``no_sync`` / ``accumulate``: with ``reshard_after_forward=True`` (yashard's default) every
  micro-batch reduces its gradients, which accumulate in fp32 in the master gradients, as with
  ZeRO-3; with ``reshard_after_forward=False`` it is the model's own ``no_sync``.
* ``clip_grad_norm_(model.parameters(), ...)`` clips by the global norm over every rank's shards.
* ``save_state`` / ``load_state`` write and read a yashard checkpoint of the model and its
  optimizer in ``<dir>/yashard`` (any world size on load), and Accelerate's own files for the
  rest: schedulers, dataloader samplers, RNG states, the scaler, registered objects.
* ``get_state_dict`` gathers the full fp32 weights, by HF name, on every rank.

Everything else is Accelerate's own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import shutil

import torch
from accelerate import Accelerator as _Accelerator
from accelerate.utils import DistributedType, DynamoBackend
from accelerate.checkpointing import load_accelerator_state, load_custom_state, save_accelerator_state, save_custom_state

from ..api import shard
from ..checkpoint import load_checkpoint, save_checkpoint
from ..config import ShardConfig
from ..patch.spec import get_path
from ..sharded_model import ShardedModel

logger = logging.getLogger("yashard")

CHECKPOINT_DIR = "yashard"  # the sharded checkpoint inside a save_state folder or a Trainer checkpoint

_PRECISION_DTYPES = {"no": torch.float32, "bf16": torch.bfloat16}


def _numbered(root: str) -> list[str]:
    """The ``checkpoint_<i>`` folders in ``root``, oldest first."""
    if not os.path.isdir(root):
        return []
    return sorted((f for f in os.listdir(root) if re.fullmatch(r"checkpoint_\d+", f)), key=lambda f: int(f[11:]))


def ensure_process_group() -> None:
    """A process started without torchrun trains on one rank, as Trainer and Accelerate do without
    DDP: give it a process group of its own (gloo, plus NCCL for CUDA tensors). Under torchrun
    Accelerate has made the group already."""
    import torch.distributed as dist

    if dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


# what would shard or wrap the model in yashard's place: Accelerator's plugin argument, the variable that
# ``accelerate launch`` (--use_fsdp, --use_deepspeed, or a config file that asks for them) sets, the name
_OTHER_SHARDING = (("fsdp_plugin", "ACCELERATE_USE_FSDP", "FSDP"),
                   ("deepspeed_plugin", "ACCELERATE_USE_DEEPSPEED", "DeepSpeed"),
                   ("deepspeed_plugins", "ACCELERATE_USE_DEEPSPEED", "DeepSpeed"),
                   ("megatron_lm_plugin", "ACCELERATE_USE_MEGATRON_LM", "Megatron-LM"))
_OTHER_TYPES = (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM)


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "t", "yes", "y", "on")


def refuse_other_sharding(plugins: dict | None = None) -> None:
    """Refuse an FSDP, DeepSpeed or Megatron-LM plugin in ``plugins`` (Accelerator's arguments), or
    the environment variable ``accelerate launch`` sets for one: each shards or wraps the model in
    yashard's place. Checked before Accelerate reads them (it would set the variable itself)."""
    plugins = plugins or {}
    for arg, var, name in _OTHER_SHARDING:
        if plugins.get(arg) is not None:
            raise ValueError(f"yashard.hf.Accelerator({arg}=...): {name} would wrap the model that yashard shards; "
                             "leave the plugin out (shard_config=ShardConfig(...) sets yashard's sharding)")
        if _env_flag(var):
            raise ValueError(f"yashard.hf with {var}={os.environ[var]} in the environment, which `accelerate launch` "
                             f"sets for {name} (its --use_{name.lower().replace('-', '_')} option or a config file "
                             f"with distributed_type {name.upper().replace('-', '_')}): yashard shards the model in "
                             f"{name}'s place. Launch with torchrun, or with an accelerate config whose "
                             "distributed_type is MULTI_GPU (or MULTI_CPU)")


def precision_dtype(mixed_precision: str) -> torch.dtype:
    """The ``param_dtype`` that Accelerate's ``mixed_precision`` asks for; fp16 and fp8 are refused."""
    if mixed_precision not in _PRECISION_DTYPES:
        raise ValueError(
            f"mixed_precision={mixed_precision!r} with yashard: yashard.hf computes in fp32 ('no') or bf16 ('bf16'). "
            "fp16 needs a gradient scaler over the shards, which Accelerate's does not know: use bf16"
        )
    return _PRECISION_DTYPES[mixed_precision]


def with_precision(config: ShardConfig | None, dtype: torch.dtype) -> ShardConfig:
    """``config`` (or the default) computing in ``dtype`` when mixed precision asks for it: an fp32
    ``param_dtype`` becomes ``dtype``, with a note (masters stay fp32); a narrower one stays."""
    config = config if config is not None else ShardConfig()
    if dtype == torch.float32 or config.param_dtype != torch.float32:
        return config
    logger.info("yashard: mixed precision computes in %s: param_dtype=torch.float32 becomes %s (masters stay fp32)",
                dtype, dtype)
    return dataclasses.replace(config, param_dtype=dtype)


def check_precision(model: ShardedModel, mixed_precision: str) -> None:
    """Refuse a sharded model whose compute dtype is wider than ``mixed_precision`` asks for:
    with no autocast around it, it would silently compute in fp32."""
    want = precision_dtype(mixed_precision)
    have = model.runtime.config.param_dtype
    if want != torch.float32 and have == torch.float32:
        raise ValueError(
            f"mixed precision {mixed_precision!r} but the model was sharded with ShardConfig(param_dtype=torch.float32), "
            "so it would compute in fp32: shard it with ShardConfig(param_dtype=torch.bfloat16), or pass the unsharded "
            "model and let yashard.hf shard it"
        )


def compile_layers(model: ShardedModel, kwargs: dict) -> None:
    """``torch.compile`` (``kwargs``: backend, mode, ...) on each decoder layer of ``model``, once, in
    place of Accelerate's compile of the whole model: yashard's hooks run eagerly between the
    compiled layers (docs/api.md, torch.compile)."""
    rt = model.runtime
    for layer in get_path(rt.model, rt.spec.layers):
        if getattr(layer, "_compiled_call_impl", None) is None:
            layer.compile(**kwargs)


def raw_optimizer(optimizer):
    """The ``torch.optim`` optimizer inside Accelerate's ``AcceleratedOptimizer`` wrappers."""
    while hasattr(optimizer, "optimizer") and not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def optimizer_of(model: ShardedModel, optimizers: list):
    """The optimizer among ``optimizers`` that trains ``model``'s shards (None if there is none);
    any other prepared optimizer is refused, as yashard.hf saves and loads that one only."""
    mine = {id(p) for p in model.parameters()}
    found = [o for o in optimizers if any(id(p) in mine for g in raw_optimizer(o).param_groups for p in g["params"])]
    if len(found) > 1:
        raise ValueError("more than one optimizer trains the yashard model's shards; yashard.hf saves one")
    if len(optimizers) > len(found):
        raise ValueError("an optimizer that does not train the yashard model's shards was prepared; yashard.hf saves "
                         "and loads the model's own optimizer only")
    return raw_optimizer(found[0]) if found else None


class Accelerator(_Accelerator):
    """``accelerate.Accelerator`` that trains yashard-sharded models (see the module docstring).

    ``shard_config``: the ``ShardConfig`` for models that ``prepare`` shards; by default
    ``ShardConfig(param_dtype=...)`` from ``mixed_precision``."""

    def __init__(self, *args, shard_config: ShardConfig | None = None, **kwargs):
        refuse_other_sharding(kwargs)
        super().__init__(*args, **kwargs)
        if self.distributed_type in _OTHER_TYPES:  # (an earlier Accelerator of this process configured it)
            raise ValueError(f"an Accelerator configured for {self.distributed_type.value}: yashard shards the model "
                             "in its place; leave the FSDP, DeepSpeed or Megatron-LM plugin and config out")
        self.shard_config = shard_config

    # --- the model -----------------------------------------------------------------------

    def yashard_config(self) -> ShardConfig:
        """The ``ShardConfig`` for a model this accelerator shards."""
        return with_precision(getattr(self, "shard_config", None), precision_dtype(self.mixed_precision))

    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False):
        if not isinstance(model, ShardedModel):
            # a frozen teacher, or a model prepared for evaluation only (TRL's reference model): neither DDP nor
            # FSDP wraps it in Accelerate, so it is not sharded either
            if evaluation_mode or not any(p.requires_grad for p in model.parameters()):
                return super().prepare_model(model, device_placement, evaluation_mode=True)
            if self.distributed_type in _OTHER_TYPES:
                raise ValueError(f"an Accelerator configured for {self.distributed_type.value}: yashard shards the "
                                 "model in its place; leave the FSDP or DeepSpeed plugin and config out")
            ensure_process_group()
            model = shard(model, config=self.yashard_config())
        check_precision(model, self.mixed_precision)
        if self.state.dynamo_plugin.backend != DynamoBackend.NO:
            compile_layers(model, self.state.dynamo_plugin.to_kwargs())
        if model not in self._models:
            self._models.append(model)
        return model

    def prepare(self, *args, device_placement=None):
        unsharded = {id(p) for m in args if isinstance(m, torch.nn.Module) and not isinstance(m, ShardedModel)
                     for p in m.parameters() if p.requires_grad}
        for opt in args:
            if isinstance(raw_optimizer(opt), torch.optim.Optimizer) and any(
                    id(p) in unsharded for g in raw_optimizer(opt).param_groups for p in g["params"]):
                raise ValueError(
                    "prepare() got an optimizer built over the parameters of the unsharded model it also got: "
                    "sharding replaces them with flat shards, so that optimizer would train nothing. Prepare the "
                    "model first (model = accelerator.prepare(model)), then build the optimizer over "
                    "model.parameters() and prepare it")
        return super().prepare(*args, device_placement=device_placement)

    def unwrap_model(self, model, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
        if isinstance(model, ShardedModel):
            return model
        return super().unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)

    # --- gradients -----------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self, model):
        if not isinstance(model, ShardedModel):
            with super().no_sync(model):
                yield
            return
        if model.runtime.config.reshard_after_forward:
            yield  # every micro-batch reduces; the gradients add up in fp32 in the master gradients
            return
        with model.no_sync():
            yield

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        parameters = list(parameters)
        for model in self._models:
            if isinstance(model, ShardedModel) and {id(p) for p in parameters} == {id(p) for p in model.parameters()}:
                self.unscale_gradients()
                return model.clip_grad_norm_(max_norm, norm_type)
        return super().clip_grad_norm_(parameters, max_norm, norm_type)

    # --- state ---------------------------------------------------------------------------

    def _sharded_model(self, what: str) -> ShardedModel | None:
        """The one sharded model of this accelerator; other models must be frozen (a teacher, a
        reference model): they are not saved or loaded, as their weights do not change."""
        sharded = [m for m in self._models if isinstance(m, ShardedModel)]
        if not sharded:
            return None
        trained = [m for m in self._models if m not in sharded and any(p.requires_grad for p in m.parameters())]
        if len(sharded) > 1 or trained:
            raise ValueError(f"{what} with a yashard model: it saves one trained model per Accelerator (this one "
                             f"has {len(sharded) + len(trained)}); freeze the others (requires_grad_(False)) or save "
                             "them yourself")
        if len(self._models) > 1:
            logger.info("yashard: %s leaves out %d frozen model(s): their weights do not change", what,
                        len(self._models) - 1)
        return sharded[0]

    def _checkpoint_root(self) -> str:
        return os.path.join(self.project_dir, "checkpoints")

    def _save_dir(self, output_dir: str | None) -> str:
        """Where save_state writes: ``output_dir``, or with automatic checkpoint naming the next
        ``checkpoints/checkpoint_<i>`` under the project folder (the oldest removed beyond ``total_limit``)."""
        config = self.project_configuration
        if not config.automatic_checkpoint_naming:
            if output_dir is None:
                raise ValueError("save_state needs output_dir, or ProjectConfiguration(automatic_checkpoint_naming=True)")
            return output_dir
        root = self._checkpoint_root()
        os.makedirs(root, exist_ok=True)
        folders = _numbered(root)
        if config.total_limit is not None and self.is_main_process:
            for folder in folders[: max(0, len(folders) + 1 - config.total_limit)]:
                shutil.rmtree(os.path.join(root, folder))
        path = os.path.join(root, f"checkpoint_{self.save_iteration}")
        if os.path.exists(path):
            raise ValueError(f"checkpoint folder {path} exists already; set accelerator.project_configuration.iteration "
                             "to the next free number")
        self.wait_for_everyone()  # (every rank has looked before any writes it)
        return path

    def _load_dir(self, input_dir: str | None) -> str:
        if input_dir is not None:
            return input_dir
        if not self.project_configuration.automatic_checkpoint_naming:
            raise ValueError("load_state needs input_dir, or ProjectConfiguration(automatic_checkpoint_naming=True)")
        folders = _numbered(self._checkpoint_root())
        if not folders:
            raise FileNotFoundError(f"no checkpoint_<i> folder in {self._checkpoint_root()} to load")
        return os.path.join(self._checkpoint_root(), folders[-1])

    def get_state_dict(self, model, unwrap=True):
        if isinstance(model, ShardedModel):
            return model.full_state_dict()
        return super().get_state_dict(model, unwrap)

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **save_model_func_kwargs):
        model = self._sharded_model("save_state")
        if model is None:
            return super().save_state(output_dir, safe_serialization, **save_model_func_kwargs)
        optimizer = optimizer_of(model, self._optimizers)  # (checked before anything is written)
        output_dir = self._save_dir(output_dir)
        os.makedirs(output_dir, exist_ok=True)
        save_checkpoint(os.path.join(output_dir, CHECKPOINT_DIR), model, optimizer)
        location = save_accelerator_state(
            output_dir, [], [], self._schedulers, self._dataloaders, self.state.process_index, self.step,
            self.scaler, save_on_each_node=self.project_configuration.save_on_each_node,
            safe_serialization=safe_serialization)
        for i, obj in enumerate(self._custom_objects):
            save_custom_state(obj, output_dir, i, save_on_each_node=self.project_configuration.save_on_each_node)
        self.project_configuration.iteration += 1
        return location

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None, **load_model_func_kwargs):
        model = self._sharded_model("load_state")
        if model is None:
            return super().load_state(input_dir, load_kwargs, **load_model_func_kwargs)
        input_dir = self._load_dir(input_dir)
        path = os.path.join(input_dir, CHECKPOINT_DIR)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"{input_dir} has no {CHECKPOINT_DIR}/ folder: it was not written by "
                                    "yashard.hf.Accelerator.save_state")
        load_checkpoint(path, model, optimizer_of(model, self._optimizers))
        override = load_accelerator_state(input_dir, [], [], self._schedulers, self._dataloaders,
                                          self.state.process_index, self.scaler, map_location="cpu",
                                          load_kwargs=load_kwargs)
        if "step" in override:
            self.step = override["step"]
        for i, obj in enumerate(self._custom_objects):
            load_custom_state(obj, input_dir, i)
