"""``yashard.hf.Trainer``: ``transformers.Trainer`` on a yashard-sharded model.

:class:`ShardedTrainerMixin` goes in front of ``transformers.Trainer`` or any subclass of it
(``yashard.hf.Trainer``, ``yashard.hf.SFTTrainer``; ``yashard.hf.sharded_trainer(cls)`` builds
one for another subclass). The user's ``TrainingArguments`` stay as they are. What it does:

* **Shards the model** given as an object or a folder path, with the ``ShardConfig`` given as
  ``shard_config=`` or derived from the arguments: ``bf16=True`` computes in bf16,
  ``gradient_checkpointing=True`` (or ``activation_checkpointing``) checkpoints every layer (``ShardConfig.checkpoint_layers``,
  yashard's own; HF's is off then). A model sharded already is checked against them.
* **Accelerate**: the trainer's accelerator is :class:`yashard.hf.Accelerator`: no DDP, gradient
  accumulation in yashard's default mode, the global gradient norm, no device move.
* **Checkpoints** (``save_steps``, ``save_total_limit``): ``checkpoint-N/yashard`` is a yashard
  sharded checkpoint of the model and the optimizer; the scheduler, RNG states,
  ``trainer_state.json`` and ``training_args.bin`` are Trainer's own files beside it.
  ``resume_from_checkpoint`` reads them at any world size; ``yashard/`` from another step is refused.
* **save_model()** writes an HF folder (``yashard.export_hf``) with the tokenizer, which
  ``AutoModelForCausalLM.from_pretrained`` loads; for a PEFT model, the adapter
  (``yashard.save_adapter``), which ``PeftModel.from_pretrained`` loads.
* **PEFT**: a ``PeftModel``, or ``peft_config=`` (applied before sharding, in TRL's order: after
  ``set_seed(args.seed)``, see :mod:`yashard.hf.model_init`), trains the adapters.
* **torch_compile**: each decoder layer is compiled (:func:`yashard.hf.accelerator.compile_layers`).
* A process started without torchrun trains on a one-rank group of its own.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import logging
import os
import types

import torch
import transformers

from ..api import shard
from ..checkpoint import load_checkpoint, read_index, resolve_checkpoint, save_checkpoint
from ..config import ShardConfig
from ..hf_export import export_hf
from ..sharded_model import ShardedModel
from ..peft_adapter import save_adapter
from .accelerator import (CHECKPOINT_DIR, Accelerator, ensure_process_group, raw_optimizer, refuse_other_sharding,
                          with_precision)
from .model_init import folder_model, with_adapters

logger = logging.getLogger("yashard")

TRAINING_ARGS_NAME = "training_args.bin"
SCHEDULER_NAME = "scheduler.pt"


def shard_config_from_args(args, config: ShardConfig | None, num_layers: int) -> ShardConfig:
    """The ``ShardConfig`` that ``TrainingArguments`` ask for, on top of ``config`` (the user's, or
    the default): ``bf16`` sets ``param_dtype=torch.bfloat16``; ``gradient_checkpointing``
    checkpoints every one of the ``num_layers`` layers; ``fp16`` is refused."""
    if getattr(args, "fp16", False):
        raise ValueError("TrainingArguments(fp16=True) with yashard: yashard.hf trains in fp32 or bf16; set bf16=True "
                         "instead")
    config = with_precision(config, torch.bfloat16 if getattr(args, "bf16", False) else torch.float32)
    if checkpointing(args) and not 0 < config.checkpoint_layers < num_layers:  # (else: the user chose the layers)
        config = dataclasses.replace(config, checkpoint_layers=num_layers)
    return config


_CHECKPOINTING = ("activation_checkpointing", "gradient_checkpointing")  # (the second: its name before transformers 5.x)


def checkpointing(args) -> bool:
    """Whether ``args`` ask for activation checkpointing (either name); refuses the options yashard's
    checkpointing has no equivalent for."""
    if not any(getattr(args, name, False) for name in _CHECKPOINTING):
        return False
    kwargs = {**(getattr(args, "gradient_checkpointing_kwargs", None) or {}),
              **(getattr(args, "activation_checkpointing_kwargs", None) or {})}
    if kwargs.get("every_n_layers", 1) != 1 or kwargs.get("offload", False):
        raise ValueError("activation checkpointing with every_n_layers or offload: yashard checkpoints the first N "
                         "layers in place (ShardConfig(checkpoint_layers=N)); drop those keys and pass "
                         "shard_config=ShardConfig(checkpoint_layers=N)")
    return True


def checkpointing_off(args) -> None:
    """Turn HF's activation checkpointing off in ``args`` (yashard's runs instead)."""
    for name in _CHECKPOINTING:
        if hasattr(args, name):
            setattr(args, name, False)


def _num_layers(model) -> int:
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(getattr(text, "num_hidden_layers", 0) or 0)


_REFUSED_ARGS = {
    "push_to_hub": "save_model() writes the folder; upload it with huggingface_hub.upload_folder",
    "fsdp": "yashard shards the model in FSDP's place; leave fsdp and fsdp_config out",
    "deepspeed": "yashard shards the model in DeepSpeed's place; leave deepspeed out",
    "sync_ref_model": "TRL mixes the policy's parameters into the reference model's one by one, and a sharded "
                      "policy's parameters are flat shards; leave it off",
    "precompute_ref_log_probs": "TRL names its cache by a hash of the model's state_dict, which a sharded model does "
                                "not have; leave it off (the reference runs beside the policy at each step)",
}


def _refuse_unsupported(args, given: dict) -> None:
    """Arguments that ask for what yashard replaces, or cannot honour, are refused by name."""
    for name, why in _REFUSED_ARGS.items():
        if getattr(args, name, None):
            raise ValueError(f"TrainingArguments({name}=...) with yashard.hf: {why}")
    refuse_other_sharding()  # (ACCELERATE_USE_FSDP, ...: the Accelerator that Trainer builds reads them)
    template = getattr(args, "chat_template_path", None)
    if template is not None and not (os.path.isfile(template) and template.endswith((".jinja", ".j2"))):
        raise ValueError(  # (TRL clones it in its __init__, after the model would be sharded)
            f"chat_template_path={template!r} with yashard.hf: TRL would copy that tokenizer's chat template and "
            "resize the model's embeddings, which a sharded model cannot. Do it first: model, tokenizer, added = "
            "trl.clone_chat_template(model, tokenizer, path); pass both, with the added tokens in peft_config's "
            "trainable_token_indices; or pass a .jinja template file")
    if given.get("model_init") is not None:
        raise ValueError("model_init with yashard.hf: pass the model itself (model=...); the trainer shards it once")


def _check_optimizers(optimizers, model: ShardedModel) -> None:
    """An optimizer given to the trainer must train the sharded model's shards."""
    optimizer = (optimizers or (None, None))[0]
    if optimizer is None:
        return
    mine = {id(p) for p in model.parameters()}
    if any(id(p) not in mine for g in optimizer.param_groups for p in g["params"]):
        raise ValueError(
            "optimizers=(optimizer, ...) holds parameters of the unsharded model, which the trainer has just "
            "replaced with flat shards, so it would train nothing. Pass optimizer_cls_and_kwargs=(torch.optim.AdamW, "
            "{...}) to have Trainer build it over the shards, or shard the model yourself (yashard.shard) and build "
            "the optimizer over model.parameters()")


def _check_sharded(model: ShardedModel, args) -> None:
    """A model sharded by the user must compute as the arguments ask."""
    config = model.runtime.config
    if getattr(args, "fp16", False):
        raise ValueError("TrainingArguments(fp16=True) with yashard: set bf16=True instead")
    if getattr(args, "bf16", False) and config.param_dtype == torch.float32:
        raise ValueError("TrainingArguments(bf16=True) but the model was sharded with param_dtype=torch.float32, so it "
                         "would compute in fp32: shard it with ShardConfig(param_dtype=torch.bfloat16), or pass the "
                         "unsharded model and let the trainer shard it")
    if checkpointing(args) and config.checkpoint_layers == 0:
        raise ValueError("TrainingArguments(gradient_checkpointing=True) but the model was sharded without activation "
                         "checkpointing: shard it with ShardConfig(checkpoint_layers=<number of layers>), or pass the "
                         "unsharded model and let the trainer shard it")


class ShardedTrainerMixin:
    """Put in front of ``transformers.Trainer`` (or a subclass): see the module docstring.

    ``shard_config``: the ``ShardConfig`` for the model (by default derived from ``args``)."""

    def __init__(self, *pos, shard_config: ShardConfig | None = None, **kwargs):
        # (bound by name: TRL's DPO/GRPO-style trainers take another argument between model and args)
        bound = inspect.signature(super().__init__).bind_partial(*pos, **kwargs)
        given = bound.arguments
        model, args = given.get("model"), given.get("args")
        if args is None:
            raise ValueError(f"{type(self).__name__} needs args (TrainingArguments): yashard reads bf16 and "
                             "gradient_checkpointing from them")
        args = copy.copy(args)  # (checkpointing is switched off below: not on the caller's object)
        given["args"] = args
        _refuse_unsupported(args, given)
        _ = args.device  # (sets up the process group, as Trainer does, before the model is sharded)
        ensure_process_group()
        # (TRL applies peft_config inside its __init__, after the model would be sharded: applied here, in TRL's order)
        peft_config = given.pop("peft_config", None)
        if peft_config is not None and isinstance(model, ShardedModel):
            raise ValueError("peft_config= with a model that is sharded already: apply get_peft_model before "
                             "yashard.shard, or pass the unsharded model")
        quantization = given.pop("quantization_config", None)
        if quantization is not None:  # (TRL's: it loads a folder with it, as a model_init_kwargs entry)
            if not isinstance(model, (str, os.PathLike)):
                raise ValueError("quantization_config= with a loaded model: TRL would ignore it. Load the model "
                                 "quantised (from_pretrained(..., quantization_config=...)), or pass its folder")
            init = dict(getattr(args, "model_init_kwargs", None) or {})
            if init.get("quantization_config") is not None:
                raise ValueError("quantization_config= and model_init_kwargs['quantization_config'] both given: "
                                 "set it in one place, as TRL asks")
            args.model_init_kwargs = {**init, "quantization_config": quantization}
        if isinstance(model, (str, os.PathLike)):
            model = folder_model(model, args, _folder_config(model, args, shard_config), peft_config)
        elif model is not None and not isinstance(model, ShardedModel):
            if peft_config is not None:
                model = with_adapters(model, peft_config, args)
            model = shard(model, config=shard_config_from_args(args, shard_config, _num_layers(model)))
        elif isinstance(model, ShardedModel):
            if shard_config is not None:
                raise ValueError("shard_config= was given with a model that is sharded already; shard an unsharded "
                                 "model with it, or leave it out")
            _check_sharded(model, args)
        if model is None:
            raise ValueError(f"{type(self).__name__} needs model=: an HF model, a local folder or a sharded model")
        if "ref_model" in bound.signature.parameters and given.get("ref_model") is None and is_peft(model):
            if peft_config is None:  # (TRL's reference would be a copy of the adapter as given: a second adapter)
                raise ValueError(
                    f"{type(self).__name__} with a PEFT model and no ref_model: TRL's reference would be a copy of the "
                    "model's adapter, which yashard.hf cannot add to a sharded model. Pass the base model with "
                    "peft_config= (the reference is then the base model, its adapter disabled), or pass ref_model=")
            # TRL takes the base model with the adapter disabled as the reference of a model it applied
            # peft_config to; it does not see the PeftModel inside a sharded model, so name that reference
            given["ref_model"] = AdapterOffReference(model)
        _check_optimizers(given.get("optimizers"), model)
        if checkpointing(args):
            logger.info("yashard: activation checkpointing is yashard's own (ShardConfig.checkpoint_layers=%d); "
                        "HF's is left off", model.runtime.config.checkpoint_layers)
            checkpointing_off(args)
        given["model"] = model
        self.shard_config = model.runtime.config
        with _quantised_peft_checked(model):
            super().__init__(*bound.args, **bound.kwargs)
        # (Trainer reads the label names and whether a loss comes back from the model's class: the HF one's)
        from transformers.utils import can_return_loss, find_labels

        hf_class = type(hf_model(self.model))
        if self.args.label_names is None:
            self.label_names = find_labels(hf_class)
        self.can_return_loss = can_return_loss(hf_class)
        replace_fused_lm_head(self.model)
        if isinstance(getattr(self, "ref_model", None), AdapterOffReference):
            self.ref_model.take_fused_lm_head()

    def compute_loss(self, model, inputs, *pos, **kwargs):
        # Trainer shifts the labels for label smoothing (and a compute_loss_func) only when the model
        # it unwraps is named as a causal LM: name the HF model while it looks
        if not isinstance(model, ShardedModel):
            return super().compute_loss(model, inputs, *pos, **kwargs)
        accelerator = self.accelerator
        own = accelerator.unwrap_model
        accelerator.unwrap_model = lambda m, *a, **k: hf_model(m) if m is model else own(m, *a, **k)
        try:
            return super().compute_loss(model, inputs, *pos, **kwargs)
        finally:
            del accelerator.unwrap_model

    def get_num_trainable_parameters(self) -> int:
        if isinstance(self.model, ShardedModel):
            return hf_model(self.model).num_parameters(only_trainable=True)
        return super().get_num_trainable_parameters()

    # --- Accelerate ----------------------------------------------------------------------

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        # the Accelerator Trainer built, with yashard's methods (see yashard.hf.accelerator)
        self.accelerator.__class__ = Accelerator
        self.accelerator.shard_config = getattr(self, "shard_config", None)

    def _set_signature_columns_if_needed(self) -> None:
        # Trainer keeps the dataset columns that the model's forward names; a sharded model's forward
        # takes (*args, **kwargs), so ask the HF model's (a subclass's own rule, e.g. TRL's, stands)
        own = super()._set_signature_columns_if_needed
        if (self._signature_columns is None and isinstance(self.model, ShardedModel)
                and getattr(own, "__func__", None) is transformers.Trainer._set_signature_columns_if_needed):
            names = list(inspect.signature(hf_model(self.model).forward).parameters)
            self._signature_columns = names + sorted({"label", "label_ids", *self.label_names})
        own()

    def _move_model_to_device(self, model, device) -> None:
        if not isinstance(model, ShardedModel):
            super()._move_model_to_device(model, device)

    # --- saving --------------------------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Every rank calls it. In a checkpoint (``_internal_call``): the sharded checkpoint of the model
        and, unless ``save_only_model``, the optimizer. Otherwise: an HF folder with the tokenizer."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not isinstance(self.model, ShardedModel):
            return super().save_model(output_dir, _internal_call)
        if _internal_call:
            optimizer = None if self.args.save_only_model or self.optimizer is None else raw_optimizer(self.optimizer)
            save_checkpoint(os.path.join(output_dir, CHECKPOINT_DIR), self.model, optimizer,
                            extra={"global_step": self.state.global_step})  # (checked on resume: _load_sharded)
            if is_peft(self.model):  # (as a DDP checkpoint of a PEFT model: its adapter, for PeftModel.from_pretrained)
                save_adapter(self.model, output_dir)
        elif is_peft(self.model):
            save_adapter(self.model, output_dir)  # (as Trainer saves a PEFT model: the adapter)
        else:
            export_hf(self.model, output_dir)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # (the optimizer went into the sharded checkpoint with the model: save_model)
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    # --- loading -------------------------------------------------------------------------

    def _sharded_checkpoint(self, checkpoint: str) -> str:
        path = os.path.join(checkpoint, CHECKPOINT_DIR)
        if not os.path.isdir(path):
            raise FileNotFoundError(
                f"{checkpoint} has no {CHECKPOINT_DIR}/ folder, so it is not a checkpoint of a yashard trainer: resume "
                "from a checkpoint-N folder it wrote. To start from an HF folder's weights, pass the folder as the "
                "model instead")
        return path

    def _load_sharded(self, checkpoint: str, model: ShardedModel, optimizer=None) -> None:
        """Load ``checkpoint``'s sharded state; refuse one saved at another step than its
        trainer_state.json, before anything is read into the model."""
        path = self._sharded_checkpoint(checkpoint)
        extra = read_index(resolve_checkpoint(path)).get("extra")
        saved = extra.get("global_step") if isinstance(extra, dict) else None
        state = os.path.join(checkpoint, transformers.trainer.TRAINER_STATE_NAME)
        # (a checkpoint of an earlier yashard has no step to compare)
        step = transformers.TrainerState.load_from_json(state).global_step if os.path.isfile(state) else saved
        if saved is not None and saved != step:
            raise ValueError(
                f"{checkpoint}: its sharded state ({CHECKPOINT_DIR}/) was saved at step {saved}, its "
                f"{transformers.trainer.TRAINER_STATE_NAME} at step {step}, so the weights and optimizer state would "
                f"not be the ones that step left. Resume from a checkpoint-N folder as the trainer wrote it, or copy "
                f"the {CHECKPOINT_DIR}/ folder of checkpoint-{step} into it")
        load_checkpoint(path, model, optimizer)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        model = self.model if model is None else model
        if not isinstance(model, ShardedModel):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        self._load_sharded(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not isinstance(self.model, ShardedModel):
            return super()._load_optimizer_and_scheduler(checkpoint)
        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        if not os.path.isfile(scheduler):
            return  # (save_only_model: the model alone, loaded already)
        self._load_sharded(checkpoint, self.model, raw_optimizer(self.optimizer))
        self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))

    def _load_best_model(self) -> None:
        if not isinstance(self.model, ShardedModel):
            return super()._load_best_model()
        logger.info("Loading best model from %s (score: %s).", self.state.best_model_checkpoint, self.state.best_metric)
        self._load_sharded(self.state.best_model_checkpoint, self.model)


def hf_model(model: ShardedModel):
    """The HF model a sharded model calls: its module, or the base model of a PEFT model."""
    inner = model.module
    return inner.get_base_model() if is_peft(model) else inner


def is_peft(model: ShardedModel) -> bool:
    """Whether a sharded model calls a PEFT model (``yashard.shard(peft_model)``)."""
    return hasattr(model.module, "peft_config") and hasattr(model.module, "get_base_model")




def _folder_config(path, args, shard_config) -> ShardConfig:
    """The ``ShardConfig`` the arguments ask for, for a model given as a local folder."""
    config = transformers.AutoConfig.from_pretrained(os.fspath(path), local_files_only=True)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return shard_config_from_args(args, shard_config, int(getattr(text, "num_hidden_layers", 0) or 0))


def fused_lm_head_settings(forward) -> dict | None:
    """The variables of a forward that TRL's ``add_fused_lm_head`` installed (``temperature``,
    ``outputs``, ...), or None for any other forward."""
    fn = getattr(forward, "__func__", forward)
    if fn is None or not hasattr(fn, "__code__"):
        return None
    try:  # (TRL's wraps the class's forward, so its own signature is the one not followed through __wrapped__)
        own = inspect.signature(fn, follow_wrapped=False).parameters
    except (TypeError, ValueError):
        return None
    if "fused_lm_head" not in own:
        return None
    return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))


# what yashard.hf's answer to TRL's fused LM head (add_fused_lm_head) knows: TRL 1.16's keyword
# arguments, the variables its forward closes over, and the per-token fields it computes
FUSED_TRL_VERSION = "1.16"
_FUSED_KEYWORDS = {"fused_lm_head", "labels", "shift_labels", "num_items_in_batch"}
_FUSED_VARIABLES = {"backbone_attr", "cast_lm_head_to_fp32", "final_logit_softcapping", "logit_scale",
                    "original_forward", "outputs", "temperature", "text_config"}
_FUSED_OUTPUTS = {"log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1"}


def fused_lm_head_temperature(forward, settings: dict, dtype: torch.dtype) -> float:
    """The ``temperature`` of TRL's fused forward ``forward`` (its ``settings``: the variables it closes
    over), for a model computing in ``dtype``. Refuses a forward that takes, reads or computes what
    yashard's answer does not know (another TRL version), as that answer would ignore it."""
    own = inspect.signature(getattr(forward, "__func__", forward), follow_wrapped=False).parameters.values()
    named = [p.name for p in own if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)][1:]  # (not self)
    outputs = settings.get("outputs")
    problems = [f"it takes {name}=" for name in named if name not in _FUSED_KEYWORDS]
    problems += [f"it reads {name}" for name in sorted(set(settings) - _FUSED_VARIABLES)]
    temperature = settings.get("temperature")
    if "temperature" not in settings:
        problems.append("it reads no temperature")
    elif not isinstance(temperature, (int, float)) or isinstance(temperature, bool):
        problems.append(f"its temperature is {temperature!r}, not a number")
    if not isinstance(outputs, tuple):
        problems.append("it reads no outputs tuple")
    else:
        problems += [f"it computes {name!r}" for name in outputs if name not in _FUSED_OUTPUTS]
    if problems:
        raise NotImplementedError(
            f"this TRL trainer's fused LM head (add_fused_lm_head) is of a version yashard.hf does not know: "
            f"{'; '.join(problems)}. yashard.hf answers TRL {FUSED_TRL_VERSION}'s from the model's logits (TRL's reads "
            f"lm_head.weight outside the lm_head's forward, which a sharded model cannot), and would ignore that. "
            f"Install trl=={FUSED_TRL_VERSION}.* (yashard's hf extra)")
    if settings.get("cast_lm_head_to_fp32") and dtype != torch.float32:
        raise NotImplementedError(
            f"cast_lm_head_to_fp32=True with yashard.hf: a sharded lm_head computes in ShardConfig.param_dtype "
            f"({dtype}); leave it off, or train in fp32")
    return float(temperature)


def replace_fused_lm_head(model) -> None:
    """TRL's ``add_fused_lm_head`` makes ``model(..., fused_lm_head=True)`` run the backbone and read
    ``lm_head.weight`` outside the lm_head's own forward, where a sharded model has no weights. Give
    such a model a forward that returns the same per-token fields (``log_probs``, ``entropy``,
    ``log_sum_sq_probs``, ``mean_logits``, ``is_top1``, ``label_mask``, ``loss``, ``aux_loss``) at the
    same ``temperature``, from the model's own logits: the lm_head runs as a unit."""
    forward = model.__dict__.get("forward") if isinstance(model, ShardedModel) else None
    settings = fused_lm_head_settings(forward)
    if settings is None:
        return
    temperature = fused_lm_head_temperature(forward, settings, model.runtime.config.param_dtype)
    logger.info("yashard: TRL's fused LM-head loss reads lm_head.weight outside the lm_head's forward, which a sharded "
                "model cannot; the model's own forward computes the same per-token fields from its full logits")
    model.forward = types.MethodType(functools.partial(_logits_fused_forward, temperature=temperature), model)


class AdapterOffReference(torch.nn.Module):
    """The reference model of a trainer that applied ``peft_config`` (TRL's DPO): the sharded policy
    with its adapter disabled, as TRL computes it for a PEFT model. It holds no parameter of its own
    (the policy is not a submodule), so Accelerate prepares it as a frozen model."""

    def __init__(self, policy: ShardedModel):
        super().__init__()
        object.__setattr__(self, "policy", policy)
        self.config = hf_model(policy).config  # (TRL reads it, e.g. in add_fused_lm_head)
        self.temperature = 1.0

    def forward(self, *args, **kwargs):
        with self.policy.module.disable_adapter():
            return _logits_fused_forward(self.policy, *args, temperature=self.temperature, **kwargs)

    def take_fused_lm_head(self) -> None:
        """Replace the fused head TRL put on this module (and the autocast Accelerate wrapped it in,
        which the sharded policy computes without) by its answer from the policy's logits."""
        forward = self.__dict__.pop("_original_forward", None) or self.__dict__.get("forward")
        self.__dict__.pop("forward", None)
        settings = fused_lm_head_settings(forward)
        if settings is not None:
            self.temperature = fused_lm_head_temperature(forward, settings, self.policy.runtime.config.param_dtype)


def _logits_fused_forward(self, *args, temperature=1.0, fused_lm_head=False, labels=None, shift_labels=None,
                          num_items_in_batch=None, **kwargs):
    if not fused_lm_head:
        extra = {k: v for k, v in (("labels", labels), ("shift_labels", shift_labels),
                                   ("num_items_in_batch", num_items_in_batch)) if v is not None}
        return type(self).forward(self, *args, **kwargs, **extra)
    from trl.trainer.utils import FusedCausalLMOutput

    kwargs["use_cache"] = False
    out = type(self).forward(self, *args, **kwargs)
    logits = out.logits
    if shift_labels is None:
        logits, labels = logits[:, :-1], labels[:, 1:]
    else:
        labels = shift_labels
    mask = labels != -100
    logits = logits.float() / temperature
    log_z = torch.logsumexp(logits, dim=-1)
    targets = labels.clamp(min=0)
    log_p = logits - log_z.unsqueeze(-1)
    log_probs = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1).masked_fill(~mask, 0)
    entropy = -(log_p.exp() * log_p).sum(-1).masked_fill(~mask, 0)
    with torch.no_grad():
        log_sum_sq_probs = torch.logsumexp(2 * log_p, dim=-1).masked_fill(~mask, 0)
        mean_logits = logits.mean(-1).masked_fill(~mask, 0)
        is_top1 = (logits.argmax(-1) == targets) & mask  # (argmax: the first of equal maxima, as TRL's)
    loss = -log_probs.sum() / (mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch)
    aux_loss = getattr(out, "aux_loss", None) if kwargs.get("output_router_logits") else None
    if aux_loss is not None:
        loss = loss + getattr(self.config.get_text_config(), "router_aux_loss_coef", 0.0) * aux_loss
    return FusedCausalLMOutput(loss=loss, log_probs=log_probs, entropy=entropy, log_sum_sq_probs=log_sum_sq_probs,
                               mean_logits=mean_logits, is_top1=is_top1, label_mask=mask, aux_loss=aux_loss)


def _count_sharded_too(count):
    """Trainer logs "Number of trainable parameters" with ``get_model_param_count(model)``, which sums
    ``model.parameters()``: a sharded model's are this rank's shards. Count the model's own."""
    @functools.wraps(count)
    def get_model_param_count(model, trainable_only=False):
        if isinstance(model, ShardedModel):
            return hf_model(model).num_parameters(only_trainable=trainable_only)
        return count(model, trainable_only)

    return get_model_param_count


if not hasattr(transformers.trainer.get_model_param_count, "__wrapped__"):
    transformers.trainer.get_model_param_count = _count_sharded_too(transformers.trainer.get_model_param_count)


class Trainer(ShardedTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` on yashard (see :class:`ShardedTrainerMixin`)."""


_TRAINER_CLASSES: dict[type, type] = {}


def sharded_trainer(cls: type) -> type:
    """``cls`` (a subclass of ``transformers.Trainer``) with :class:`ShardedTrainerMixin` in front,
    under the same name; built once per class."""
    if not (isinstance(cls, type) and issubclass(cls, transformers.Trainer)):
        raise TypeError(f"sharded_trainer expects a subclass of transformers.Trainer, got {cls!r}")
    if issubclass(cls, ShardedTrainerMixin):
        return cls
    if cls not in _TRAINER_CLASSES:
        _TRAINER_CLASSES[cls] = type(cls.__name__, (ShardedTrainerMixin, cls), {"__module__": __name__,
                                                                                "__doc__": cls.__doc__})
    return _TRAINER_CLASSES[cls]


@contextlib.contextmanager
def _quantised_peft_checked(model):
    """transformers' Trainer refuses a quantised model that is not a ``PeftModel``
    (``validate_quantization_for_training``). A sharded ``PeftModel`` on a 4-bit base (QLoRA) is
    one: the check runs on the ``PeftModel`` inside. TRL's bf16 cast of a quantised model's
    adapters is not let at the master shards."""
    import transformers.trainer as hf_trainer

    check = getattr(hf_trainer, "validate_quantization_for_training", None)
    if check is None or not is_peft(model):
        yield
        return
    hf_trainer.validate_quantization_for_training = lambda m: check(model.module if m is model else m)
    # TRL's SFTTrainer casts a quantised model's trained parameters to bf16 (param.data = ...): those
    # would be yashard's fp32 master shards. The sharded model keeps fp32 masters (it computes in
    # param_dtype), so it does not answer TRL as quantised while TRL's __init__ looks.
    hidden = getattr(model, "is_loaded_in_4bit", False)
    if hidden:
        model.is_loaded_in_4bit = False
    try:
        yield
    finally:
        hf_trainer.validate_quantization_for_training = check
        if hidden:
            del model.is_loaded_in_4bit
