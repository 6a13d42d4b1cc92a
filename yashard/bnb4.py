"""bitsandbytes 4-bit weights (QLoRA's frozen base) as packed byte records.

A ``Params4bit`` is its packed codes plus a ``QuantState`` (block scales, code table, and with
double quantisation a nested state). yashard keeps each one as one record of bytes
(:mod:`yashard.packed`) in a byte unit: sharded, gathered and shown as bytes, a quarter of bf16's
traffic. :class:`Rebuild` turns a record's bytes in a slot back into a ``Params4bit`` whose data and
quantisation state are views of those bytes, so bitsandbytes computes exactly as on the unsharded
model. bitsandbytes is not imported: the classes are read off the weights themselves.
"""

from __future__ import annotations

import copy

import torch

from .packed import PART_ALIGN, Record, record

# What transformers' other quantizers put in a model, by the class name of a weight or a module:
# what to tell a user who shards one.
OTHER_QUANTIZED = {
    "Int8Params": "bitsandbytes 8-bit (load_in_8bit)",
    "Linear8bitLt": "bitsandbytes 8-bit (load_in_8bit)",
    "AffineQuantizedTensor": "torchao",
    "TorchAOBaseTensor": "torchao",
    "QuantLinear": "GPTQ (auto-gptq / gptqmodel)",
    "WQLinear_GEMM": "AWQ",
    "WQLinear_GEMV": "AWQ",
    "WQLinear_Exllama": "AWQ",
    "HQQLinear": "HQQ",
    "FP8Linear": "FP8",
}


def is_params4bit(p: torch.Tensor) -> bool:
    """A bitsandbytes ``Params4bit``, quantised or not (read by its class name: bitsandbytes is not imported)."""
    return type(p).__name__ == "Params4bit"


def is_4bit(p: torch.Tensor) -> bool:
    """A bitsandbytes ``Params4bit`` that is quantised (it carries its ``quant_state``)."""
    return is_params4bit(p) and getattr(p, "quant_state", None) is not None


def _tensors(state) -> list[tuple[str, torch.Tensor]]:
    """The tensor attributes of a ``QuantState`` and of its nested ``state2``, by path."""
    out = [(f"qs.{k}", v) for k, v in vars(state).items() if torch.is_tensor(v)]
    nested = getattr(state, "state2", None)
    if nested is not None:
        out += [(f"qs.state2.{k}", v) for k, v in vars(nested).items() if torch.is_tensor(v)]
    return out


def parts_of(p: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of every tensor a 4-bit weight is made of: its packed data first."""
    return [("data", p.detach())] + _tensors(p.quant_state)


def record_of(p: torch.Tensor) -> Record:
    """The byte record of a 4-bit weight."""
    return record([(n, t.element_size(), tuple(t.shape)) for n, t in parts_of(p)], PART_ALIGN)


def pack(p: torch.Tensor, rec: Record, out: torch.Tensor) -> None:
    """Write a 4-bit weight's parts, as bytes, into ``out`` (uint8, ``rec.nbytes`` long; what lies
    between the parts is zeroed)."""
    out.zero_()
    for (name, t), part in zip(parts_of(p), rec.parts):
        if part.nbytes:
            out.narrow(0, part.offset, part.nbytes).copy_(t.contiguous().reshape(-1).view(torch.uint8))


class Rebuild:
    """Turns a record's bytes (a uint8 view of a slot) into a ``Params4bit`` whose data and
    quantisation state are views of them, with everything else of the original weight: its class,
    block size, quant type, storage dtype, module, and the state's shape, dtype and flags. Holds no
    tensor of the original."""

    def __init__(self, p: torch.Tensor, rec: Record):
        self.record = rec
        self.cls = type(p)
        self.dtypes = {name: t.dtype for name, t in parts_of(p)}
        self.kwargs = dict(blocksize=getattr(p, "blocksize", None), compress_statistics=getattr(p, "compress_statistics", True),
                           quant_type=getattr(p, "quant_type", "nf4"), quant_storage=getattr(p, "quant_storage", p.dtype),
                           module=getattr(p, "module", None), bnb_quantized=True)
        self.state = copy.copy(p.quant_state)
        nested = getattr(self.state, "state2", None)
        self.nested = copy.copy(nested) if nested is not None else None
        for name, _ in _tensors(p.quant_state):
            setattr(self.nested if name.startswith("qs.state2.") else self.state, name.rsplit(".", 1)[1], None)
        self.state.state2 = self.nested
        self.numel = int(torch.Size(p.quant_state.shape).numel())

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each part of the record in ``flat`` (its uint8 bytes), viewed in its own dtype and shape."""
        return {part.name: flat.narrow(0, part.offset, part.nbytes).view(self.dtypes[part.name]).reshape(part.shape)
                for part in self.record.parts}

    def __call__(self, flat: torch.Tensor) -> torch.Tensor:
        views = self.views(flat)
        state = copy.copy(self.state)
        if self.nested is not None:
            state.state2 = copy.copy(self.nested)
        for name, v in views.items():
            if name != "data":
                setattr(state.state2 if name.startswith("qs.state2.") else state, name.rsplit(".", 1)[1], v)
        return self.cls(views["data"], requires_grad=False, quant_state=state, **self.kwargs)

