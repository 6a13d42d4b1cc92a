"""User-facing configuration."""

from __future__ import annotations

import datetime
import threading
from dataclasses import dataclass

import torch

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def dtype_name(d: object) -> str:
    return str(d).replace("torch.", "")


# the longest wait a collective_timeout may bound: threading's and timedelta's limits
_MAX_TIMEOUT = min(threading.TIMEOUT_MAX, datetime.timedelta.max.total_seconds())


@dataclass(frozen=True)
class ShardConfig:
    """How :func:`yashard.shard` shards and runs a model.

    Attributes:
        param_dtype: dtype of the gathered weights and of the forward/backward compute
            (``torch.float32``, ``torch.bfloat16`` or ``torch.float16``). Master weights, their
            gradients and the optimizer state are always fp32.
        reduce_dtype: dtype of the gradient buffers and of gradients on the wire. The reduction is
            a SUM followed by a division by the world size in fp32 (post-divide). ``None`` means
            fp32. fp16 with bf16 params is rejected (fp16 overflows where bf16 does not); fp16
            gradients need loss scaling (:class:`yashard.ShardedGradScaler`; without one the first
            step logs a warning); a reduce dtype narrower than fp32 trades gradient precision for
            bandwidth.
        checkpoint_layers: how many decoder layers (counted from the first) recompute their
            activations in backward instead of storing them. 0 disables activation checkpointing;
            a value larger than the number of layers is an error at :func:`yashard.shard` time.
        sync_module_states: broadcast rank 0's initial weights to every rank before sharding, so
            ranks that built the model with different seeds still train one model.
        shard_align: every shard is a multiple of this many elements (alignment for the
            collectives; 1 means no extra padding).
        device: device for buffers and compute. ``None`` picks the current CUDA device when the
            process group uses NCCL, else the CPU.
        shard_group_size: hybrid sharding (HSDP). Units are sharded within groups of this many
            consecutive ranks (typically one node) and replicated across groups: gradients are
            reduce-scattered inside the group, then all-reduced across groups. ``None``: shard over
            the whole group (ZeRO-3). Must divide the world size.
        secondary_group_size: ZeRO++ hpZ. After each forward all-gather every rank keeps a secondary
            slice (1/secondary_group_size of each layer, in ``param_dtype``), so the backward
            re-gathers run inside groups of this many consecutive ranks (one node) only. Costs
            ``layer params / secondary_group_size`` elements per rank. Must divide the shard group.
        quantized_weights: ZeRO++ qwZ. ``8`` or ``4``: the forward (and, without hpZ, backward)
            weight all-gathers move block-quantized int8/int4 codes plus one fp32 scale per
            ``quant_block`` elements and dequantize into the weight buffer; the fp32 master shards are
            never quantized. ``None``: off. The norm group is never quantized.
        quant_block: elements per quantization block (one fp32 scale each) for qwZ.
        reshard_after_forward: ``True`` (the YaFSDP design): the decoder layers take turns in two
            weight+gradient buffers (even and odd layers), so each layer is gathered for its forward
            and again for its backward, and its gradients are reduced after every backward.
            ``False``: every unit gets a weight+gradient buffer of its own, allocated once like the
            others (``memory_plan()`` lists them: the whole padded model in ``param_dtype`` +
            ``reduce_dtype`` per rank, as DDP or ZeRO-2 hold it). Weights are then gathered once per
            optimizer step and stay for every micro-batch, and :meth:`ShardedModel.no_sync`
            accumulates gradients unreduced until the last micro-batch, so a step with gradient
            accumulation moves as many bytes as one without. Masters, their gradients and the
            optimizer state stay sharded. Not combinable with ``secondary_group_size`` (hpZ keeps
            slices for backward re-gathers, which this mode has none of).
        share_outer_slot: ``True``: the embedding and the lm_head gather into the buffer of the two
            layer slots, laid end to end, instead of a slot of their own (``layout.outer_arena``):
            the fixed memory drops by that slot, up to what the larger of the two exceeds both
            layer slots by. Results are bitwise the same; each step exposes about four transfers
            that the default overlaps (the first layer's and the lm_head's gathers, the last
            layer's backward re-gather, the first layer's reduction before the embedding's). Needs
            ``reshard_after_forward=True`` and an lm_head that is not tied to the embedding.
        step_in_backward: ``True``: each unit's optimizer step runs as soon as its reduced
            gradient shard is ready, in backward, straight from the reduce-scatter output
            (``model.optimizer_in_backward``). No fp32 gradient shards are held: ``T/W * 4`` bytes
            less. Refuses what needs whole gradients after the backward: ``clip_grad_norm_``,
            gradient accumulation (``no_sync``, a second backward before ``opt.step()``),
            :class:`yashard.ShardedGradScaler`, comm hooks, ``full_grads``. Needs an fp32
            ``reduce_dtype`` and ``on_nonfinite`` ``"raise"`` or ``"ignore"``.
        on_nonfinite: what a NaN/inf in the gradients (as the optimizer would step on them; where
            ``clip_grad_norm_`` ran, read off its per-layer norms, so a norm that overflows counts
            too) or in a layer's forward output does at the next optimizer step: ``"raise"``
            (:class:`yashard.NonFiniteError` naming the layer whose forward output, else whose
            gradients, first went non-finite, and the ranks), ``"skip"`` (a warning, and the
            optimizer skips the step: every master gradient is set to None), or ``"ignore"``. The
            same all-gather names, once, every trainable parameter no rank's backward gave a
            gradient since the last step (the optimizer steps it with a zero gradient: weight decay
            and momentum move it, where torch would skip it), and gives a shard none of whose
            parameters got one its ``.grad = None`` back (skipped, as torch). The check costs one small all-gather
            per step, which the host waits for (on CUDA the host then stops queuing kernels ahead of
            the GPU once per step; ``"ignore"`` with ``debug_collectives=False`` removes the wait
            and these checks). While a :class:`yashard.ShardedGradScaler`
            of the model exists, it handles non-finite gradients instead (fp16 loss scaling).
        debug_collectives: before every optimizer step, compare every rank's sequence of
            collectives (op, layer, size) since the last step, by hash, and raise
            :class:`yashard.CollectiveOrderError` at the first divergence. Off by default; cheap on.
        loss: ``"chunked"``: a grad-enabled call with ``labels`` computes the lm_head and the loss
            in chunks of ``loss_chunk_tokens`` tokens (:mod:`yashard.fused_head`), so the full
            logits and their fp32 gradients never exist; that call's ``output.logits`` has no values
            (:class:`yashard.fused_head.LogitsNotComputed`). Used for the families yashard lists
            (Llama, Mistral, Qwen2, Qwen3, Gemma 1-3); other models run the HF loss, logged at
            ``shard()``. ``"hf"``: the HF forward computes the logits and its loss, as unsharded.
        loss_chunk_tokens: tokens per chunk of the fused loss. Each chunk holds its logits in
            ``param_dtype`` and fp32: ``chunk * vocab * (2 + 4)`` bytes for bf16.
        collective_timeout: seconds any wait for a collective may take before it raises
            :class:`yashard.CollectiveError` naming the layer and phase (a dead or stalled rank).
            On CUDA only the waits the host makes anyway (checks, checkpoints, exports): a timed
            NCCL wait blocks the host, so the training collectives are left to the process
            group's timeout (NCCL's watchdog). ``None`` leaves every wait to that timeout.
    """

    param_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype | None = torch.float32
    checkpoint_layers: int = 0
    sync_module_states: bool = True
    shard_align: int = 16
    device: torch.device | str | None = None
    shard_group_size: int | None = None
    secondary_group_size: int | None = None
    quantized_weights: int | None = None
    quant_block: int = 4096
    reshard_after_forward: bool = True
    share_outer_slot: bool = False
    step_in_backward: bool = False
    on_nonfinite: str = "raise"
    debug_collectives: bool = False
    collective_timeout: float | None = 600.0
    loss: str = "chunked"
    loss_chunk_tokens: int = 1024

    def __post_init__(self) -> None:
        if self.param_dtype not in _FLOAT_DTYPES:
            raise ValueError(
                f"ShardConfig.param_dtype={dtype_name(self.param_dtype)} is not supported; "
                "use torch.float32, torch.bfloat16 or torch.float16"
            )
        if self.reduce_dtype is not None and self.reduce_dtype not in _FLOAT_DTYPES:
            raise ValueError(
                f"ShardConfig.reduce_dtype={dtype_name(self.reduce_dtype)} is not supported; "
                "use torch.float32, torch.bfloat16, torch.float16 or None (fp32)"
            )
        if self.param_dtype == torch.bfloat16 and self.reduce_dtype == torch.float16:
            raise ValueError(
                "ShardConfig.reduce_dtype=float16 cannot carry gradients of param_dtype=bfloat16 "
                "(fp16 overflows where bf16 does not); use reduce_dtype=torch.float32 or torch.bfloat16"
            )
        if isinstance(self.checkpoint_layers, bool) or not isinstance(self.checkpoint_layers, int):
            raise TypeError(
                f"ShardConfig.checkpoint_layers must be an int (number of layers), "
                f"got {type(self.checkpoint_layers).__name__}"
            )
        if self.checkpoint_layers < 0:
            raise ValueError(f"ShardConfig.checkpoint_layers must be >= 0, got {self.checkpoint_layers}")
        if isinstance(self.shard_align, bool) or not isinstance(self.shard_align, int) or self.shard_align < 1:
            raise ValueError(f"ShardConfig.shard_align must be a positive int, got {self.shard_align!r}")
        for name in ("shard_group_size", "secondary_group_size"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"ShardConfig.{name} must be a positive int (ranks per group) or None, got {v!r}")
        if self.quantized_weights not in (None, 4, 8) or isinstance(self.quantized_weights, bool):
            raise ValueError(
                f"ShardConfig.quantized_weights={self.quantized_weights!r} is not supported; use 8 (int8), "
                "4 (int4) or None (off)"
            )
        if isinstance(self.quant_block, bool) or not isinstance(self.quant_block, int) or not 2 <= self.quant_block <= 32768 \
                or self.quant_block % 2:
            raise ValueError(f"ShardConfig.quant_block must be an even int in [2, 32768], got {self.quant_block!r}")
        if not isinstance(self.reshard_after_forward, bool):
            raise TypeError(
                f"ShardConfig.reshard_after_forward must be a bool, got {type(self.reshard_after_forward).__name__}"
            )
        if not isinstance(self.share_outer_slot, bool):
            raise TypeError(f"ShardConfig.share_outer_slot must be a bool, got {type(self.share_outer_slot).__name__}")
        if self.share_outer_slot and not self.reshard_after_forward:
            raise ValueError(
                "ShardConfig.share_outer_slot=True puts the embedding and the lm_head into the layer slots, but "
                "reshard_after_forward=False gives every unit a buffer of its own, so there are none to share; "
                "drop share_outer_slot=True or reshard_after_forward=False"
            )
        if not self.reshard_after_forward and self.secondary_group_size is not None:
            raise ValueError(
                f"ShardConfig.secondary_group_size={self.secondary_group_size} (hpZ) keeps weight slices for the "
                "backward re-gathers, but reshard_after_forward=False keeps every unit's weights gathered, so there "
                "are none; drop secondary_group_size or use reshard_after_forward=True"
            )
        if self.loss not in ("chunked", "hf"):
            raise ValueError(f"ShardConfig.loss={self.loss!r}; use 'chunked' (the fused chunked loss) or 'hf' "
                             "(the HF forward's logits and loss)")
        c = self.loss_chunk_tokens
        if isinstance(c, bool) or not isinstance(c, int) or c < 1:
            raise ValueError(f"ShardConfig.loss_chunk_tokens must be a positive int (tokens per chunk), got {c!r}")
        if self.on_nonfinite not in ("raise", "skip", "ignore"):
            raise ValueError(f"ShardConfig.on_nonfinite={self.on_nonfinite!r}; use 'raise', 'skip' or 'ignore'")
        if not isinstance(self.step_in_backward, bool):
            raise TypeError(f"ShardConfig.step_in_backward must be a bool, got {type(self.step_in_backward).__name__}")
        if self.step_in_backward and self.wire_dtype != torch.float32:
            raise ValueError(
                f"ShardConfig(step_in_backward=True, reduce_dtype={dtype_name(self.reduce_dtype)}): the optimizer steps "
                "straight from the reduce-scatter output, which must be fp32 like the master shards it steps; "
                "use reduce_dtype=torch.float32 (the default) or drop step_in_backward"
            )
        if self.step_in_backward and self.on_nonfinite == "skip":
            raise ValueError(
                "ShardConfig(step_in_backward=True, on_nonfinite='skip'): each unit steps during the backward, before "
                "any rank can know whether another unit's gradients hold a NaN/inf, so the step cannot be skipped; "
                "use on_nonfinite='raise' (the default: the backward's step raises after the fact) or 'ignore', or "
                "drop step_in_backward"
            )
        if not isinstance(self.debug_collectives, bool):
            raise TypeError(f"ShardConfig.debug_collectives must be a bool, got {type(self.debug_collectives).__name__}")
        t = self.collective_timeout
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0):
            raise ValueError(f"ShardConfig.collective_timeout must be a positive number of seconds or None, got {t!r}")
        if t is not None and not t <= _MAX_TIMEOUT:  # (inf, nan: a wait cannot take it)
            raise ValueError(
                f"ShardConfig.collective_timeout={t!r} is longer than a wait can be bounded by (at most "
                f"{_MAX_TIMEOUT:.0f} s); pass None for no bound"
            )
        if self.device is not None:
            device = torch.device(self.device)
            if device.type not in ("cpu", "cuda"):
                raise ValueError(
                    f"ShardConfig.device={str(device)!r}: yashard trains on 'cpu' (gloo) or 'cuda' (NCCL) devices; "
                    "build the model on the meta device to shard it without memory (yashard initialises it), "
                    "and pass device='cpu', 'cuda' or None (auto)"
                )
            object.__setattr__(self, "device", device)

    @property
    def wire_dtype(self) -> torch.dtype:
        """The dtype gradients are reduced in (``reduce_dtype`` with ``None`` resolved)."""
        return self.reduce_dtype or torch.float32


def low_precision_dtype(dtypes) -> torch.dtype | None:
    """The one 16-bit dtype (bf16 or fp16) that every floating parameter has, else None: what
    ``shard()`` computes in when no ``ShardConfig`` says otherwise."""
    found = set(dtypes)
    return next(iter(found)) if len(found) == 1 and found <= {torch.bfloat16, torch.float16} else None
