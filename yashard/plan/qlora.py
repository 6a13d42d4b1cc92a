"""A QLoRA model on the meta device, for planning: a bitsandbytes 4-bit base with LoRA adapters,
no weight loaded, no tensor allocated (issue 43).

transformers' own bitsandbytes path replaces the decoder's linear layers with ``Linear4bit``, as
``from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True))`` does, and
keeps the same modules unconverted (the lm_head). Each 4-bit weight then gets, on the meta device,
the packed data and the ``QuantState`` tensors that ``bitsandbytes.functional.quantize_4bit``
makes, with their dtypes and shapes (:func:`quant_parts`): the records
(:func:`yashard.bnb4.record_of`) and so the plan are those of the real model. PEFT's
``get_peft_model`` adds the adapters. ``tests/test_plan_qlora.py`` checks the plan row for row
against a real tiny 4-bit PEFT model, and the parts against ``quantize_4bit`` on odd shapes.
"""

from __future__ import annotations

import torch

from ..bnb4 import is_params4bit

BLOCKSIZE = 64           # bitsandbytes' default 4-bit block (BitsAndBytesConfig has no field for it)
NESTED_BLOCKSIZE = 256   # double quantisation: the block of the absmax's own quantisation
NF4_CODE = 16            # the fp32 code table of NF4 (and FP4): one value per 4-bit code
NESTED_CODE = 256        # the fp32 code table of the 8-bit quantised absmax
STORAGES = {"uint8": torch.uint8, "bf16": torch.bfloat16}


def quant_parts(numel: int, *, double_quant: bool, quant_storage: torch.dtype = torch.uint8,
                blocksize: int = BLOCKSIZE) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """What ``quantize_4bit`` makes of a weight of ``numel`` elements, as ``{part: (dtype, shape)}``:
    the packed data, two codes a byte, in ``quant_storage``; one absmax per block (fp32, or uint8
    with double quantisation), the code table, and with double quantisation the offset and the
    nested state (its fp32 absmax per 256 blocks and its code table)."""
    nbytes = (numel + 1) // 2
    item = torch.empty((), dtype=quant_storage).element_size()
    if nbytes % item:
        raise ValueError(f"a 4-bit weight of {numel} elements packs into {nbytes} bytes, not a whole number of "
                         f"{quant_storage} elements: bitsandbytes cannot quantise it with that quant_storage; use uint8")
    blocks = -(-numel // blocksize)
    parts = {"data": (quant_storage, (nbytes // item, 1))}
    if not double_quant:
        parts["qs.absmax"] = (torch.float32, (blocks,))
        parts["qs.code"] = (torch.float32, (NF4_CODE,))
        return parts
    parts["qs.absmax"] = (torch.uint8, (blocks,))
    parts["qs.code"] = (torch.float32, (NF4_CODE,))
    parts["qs.offset"] = (torch.float32, ())
    parts["qs.state2.absmax"] = (torch.float32, (-(-blocks // NESTED_BLOCKSIZE),))
    parts["qs.state2.code"] = (torch.float32, (NESTED_CODE,))
    return parts


def _meta_4bit(module, *, double_quant: bool, quant_storage: torch.dtype, weight_dtype: torch.dtype):
    """A quantised ``Params4bit`` for ``module`` (a ``Linear4bit``) on the meta device, as if
    quantised from a weight in ``weight_dtype`` (its ``QuantState.dtype``: what it dequantises to)."""
    import bitsandbytes as bnb
    from bitsandbytes.functional import QuantState

    shape = torch.Size((module.out_features, module.in_features))
    parts = {k: torch.empty(s, dtype=d, device="meta")
             for k, (d, s) in quant_parts(shape.numel(), double_quant=double_quant, quant_storage=quant_storage).items()}
    nested = None
    if double_quant:
        nested = QuantState(absmax=parts["qs.state2.absmax"], code=parts["qs.state2.code"],
                            blocksize=NESTED_BLOCKSIZE, dtype=torch.float32)
    state = QuantState(absmax=parts["qs.absmax"], shape=shape, code=parts["qs.code"], blocksize=BLOCKSIZE,
                       quant_type="nf4", dtype=weight_dtype, offset=parts.get("qs.offset"), state2=nested)
    return bnb.nn.Params4bit(parts["data"], requires_grad=False, quant_state=state, blocksize=BLOCKSIZE,
                             compress_statistics=double_quant, quant_type="nf4", quant_storage=quant_storage,
                             module=module, bnb_quantized=True)


def qlora_model(config, *, rank: int = 16, alpha: int | None = None, targets="all-linear", double_quant: bool = True,
                quant_storage: torch.dtype = torch.uint8, param_dtype: torch.dtype = torch.bfloat16,
                compute_dtype: torch.dtype | None = None):
    """The PEFT model of an HF ``config`` on an NF4 base, on the meta device: the linear layers of
    the decoder in 4-bit (``double_quant``, ``quant_storage``), the other weights in
    ``param_dtype``, LoRA of ``rank`` on ``targets`` (PEFT's ``target_modules``: ``"all-linear"``
    or a list of module names). ``compute_dtype``: bitsandbytes' (default ``param_dtype``)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear
    from transformers.quantizers.base import HfQuantizer

    compute_dtype = compute_dtype or param_dtype
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=param_dtype)
    bnb_config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=double_quant,
                                    bnb_4bit_quant_storage=quant_storage, bnb_4bit_compute_dtype=compute_dtype)
    skip = HfQuantizer.get_modules_to_not_convert(model, None, getattr(model, "_keep_in_fp32_modules", None))
    model = replace_with_bnb_linear(model, modules_to_not_convert=skip, quantization_config=bnb_config)
    for module in model.modules():
        if type(module).__name__ == "Linear4bit":
            module.weight = _meta_4bit(module, double_quant=double_quant, quant_storage=quant_storage,
                                       weight_dtype=param_dtype)
    model.is_loaded_in_4bit = True
    with torch.device("meta"):
        return get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, target_modules=targets,
                                                lora_dropout=0.0))


def dequantized_bytes(model, param_bytes: int) -> int:
    """The largest 4-bit weight dequantised: ``MatMul4Bit.backward`` makes it whole in its
    ``QuantState.dtype``, then casts it to the compute dtype when that differs
    (bitsandbytes 0.50 ``autograd/_functions.py:384``), one weight at a time."""
    out = 0
    for p in model.parameters():
        state = getattr(p, "quant_state", None) if is_params4bit(p) else None
        if state is not None:
            s = state.dtype.itemsize
            out = max(out, torch.Size(state.shape).numel() * (s + (param_bytes if s != param_bytes else 0)))
    return out


def adapters_of_layer(model) -> tuple[int, int, int]:
    """Of one decoder layer: its LoRA modules, their largest rank and its trained elements."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layer = base.model.layers[0]
    mods = [m for m in layer.modules() if isinstance(m, LoraLayer)]
    rank = max((r for m in mods for r in m.r.values()), default=0)
    return len(mods), rank, sum(p.numel() for p in layer.parameters() if p.requires_grad)


def qlora_activations(acts, shape, model, param_bytes: int):
    """``acts`` (:func:`yashard.plan.activations.activations` of the base) for QLoRA.

    - A 4-bit layer saves no input (``MatMul4Bit.forward`` keeps ``(None, B)``, bitsandbytes 0.50
      ``autograd/_functions.py:357``); a LoRA module's ``lora_A`` saves that same input, so with LoRA
      on all linear layers the base's count stands; with fewer targets it is an upper bound.
    - Each LoRA module keeps its ``r``-wide hidden, ``n*r*p``, for ``lora_B``.
    - A layer's weight gradients are its adapters' only.
    - The MLP's backward: down_proj makes no weight gradient, ``h*i*p`` less; one dequantised
      weight (:func:`dequantized_bytes`) is counted on top of the ``Mul``'s backward instead. It
      exists in down_proj's backward, just before: an upper bound."""
    from dataclasses import replace

    mods, rank, trained = adapters_of_layer(model)
    n, p = acts.tokens, param_bytes
    return replace(acts, layer=acts.layer + mods * n * rank * p, layer_grads=trained * p,
                   mlp_transient=acts.mlp_transient - shape.hidden * shape.intermediate * p
                   + dequantized_bytes(model, p))
