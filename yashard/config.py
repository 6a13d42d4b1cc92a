"""User-facing configuration."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _dtype_name(d: object) -> str:
    return str(d).replace("torch.", "")


@dataclass(frozen=True)
class ShardConfig:
    """How :func:`yashard.shard` shards and runs a model.

    Attributes:
        param_dtype: dtype of the gathered weights and of the forward/backward compute
            (``torch.float32``, ``torch.bfloat16`` or ``torch.float16``). Master weights, their
            gradients and the optimizer state are always fp32.
        reduce_dtype: dtype of the gradient buffers and of gradients on the wire. The reduction is
            a SUM followed by a division by the world size in fp32 (post-divide). ``None`` means
            fp32. fp16 with bf16 params is rejected (fp16 overflows where bf16 does not); a reduce
            dtype narrower than fp32 trades gradient precision for bandwidth.
        checkpoint_layers: how many decoder layers (counted from the first) recompute their
            activations in backward instead of storing them. 0 disables activation checkpointing;
            a value larger than the number of layers is an error at :func:`yashard.shard` time.
        sync_module_states: broadcast rank 0's initial weights to every rank before sharding, so
            ranks that built the model with different seeds still train one model.
        shard_align: every shard is a multiple of this many elements (alignment for the
            collectives; 1 means no extra padding).
        device: device for buffers and compute. ``None`` picks the current CUDA device when the
            process group uses NCCL, else the CPU.
    """

    param_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype | None = torch.float32
    checkpoint_layers: int = 0
    sync_module_states: bool = True
    shard_align: int = 16
    device: torch.device | str | None = None

    def __post_init__(self) -> None:
        if self.param_dtype not in _FLOAT_DTYPES:
            raise ValueError(
                f"ShardConfig.param_dtype={_dtype_name(self.param_dtype)} is not supported; "
                "use torch.float32, torch.bfloat16 or torch.float16"
            )
        if self.reduce_dtype is not None and self.reduce_dtype not in _FLOAT_DTYPES:
            raise ValueError(
                f"ShardConfig.reduce_dtype={_dtype_name(self.reduce_dtype)} is not supported; "
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
        if self.device is not None:
            object.__setattr__(self, "device", torch.device(self.device))

    @property
    def wire_dtype(self) -> torch.dtype:
        """The dtype gradients are reduced in (``reduce_dtype`` with ``None`` resolved)."""
        return self.reduce_dtype or torch.float32
