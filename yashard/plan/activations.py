"""Activation memory of one training micro-batch, and the peak it implies for yashard (issue 36).

A pure function of the model's shapes: what autograd keeps from the forward to the backward, and
the transients of the backward, for Llama-style decoders (Llama, Mistral, Qwen2, Qwen3, Gemma:
RMSNorm, rotary attention, a gated MLP, an untied or tied lm_head, transformers' causal-LM loss;
other model types are refused, :data:`FAMILIES`). Notation: ``n =
micro_batch * seq`` tokens, ``p`` bytes per element of the compute dtype, ``h`` hidden size,
``i`` intermediate size, ``V`` vocabulary, ``H``/``K`` attention/key-value heads of size ``d``.

What one decoder layer keeps, by op (counted with a saved-tensor hook on transformers 5.24, torch
2.13, and as RSS on CPU: ``recipes/plan_check.py``):

- each RMSNorm: its input as fp32 ``n*h*4`` (the input itself in fp32, an fp32 copy otherwise),
  the normalised input and the scaled output ``n*h*p`` each, and the ``n*4`` inverse root;
- attention, ``sdpa`` or ``flash_attention_2``: rotated q ``n*H*d*p``, rotated k and v ``n*K*d*p``
  each, the output ``n*H*d*p`` (o_proj saves the same tensor), the log-sum-exp ``b*H*s*4``;
- attention, ``eager``: q, and k and v repeated to ``H`` heads, ``n*H*d*p`` each; the softmax
  probabilities ``b*H*s*s*4`` and their copy in ``p`` when ``p`` is not 4; the output, ``n*H*d*p``;
- the MLP: gate output, its activation, up output and their product, ``4*n*i*p``;
- a checkpointed layer keeps only its input, ``n*h*p``, and recomputes the rest in its backward;
- Qwen3 normalises q and k per head: its input in fp32 and its output in ``p``, ``n*(H+K)*d*(4+p)``,
  and the inverse roots, ``n*(H+K)*4``; ``d`` is the config's ``head_dim``, not ``h/H``;
- Gemma's RMSNorm keeps its normalised input in fp32, ``n*h*4`` instead of ``n*h*p``, and its
  ``1 + weight`` in fp32, ``h*4``; its embedding scale keeps a scalar in ``p``; it ties the lm_head.

The head keeps the final norm's tensors, as above, and the log-probabilities ``n*V*4``: the loss
upcasts the logits. The logits themselves, ``n*V*p``, stay alive with the model's output. Shared
by all: the token ids and the shifted labels, ``n*8`` each, and the rotary tables, ``2*s*d*p``.

The backward of a layer rises above its recomputed activations while the MLP's ``Mul`` backward
runs (``mlp_transient``): down_proj's backward has freed the product and made its input gradient
and its weight gradient, and the ``Mul`` backward makes the gradients of its two inputs, so
``2*n*i*p + h*i*p`` sit on top, plus ``2*n*h*p`` of the layer's input and output gradients. The
gate and up weight gradients come only after the ``Mul``'s saved tensors are freed (autograd frees
a node's saved tensors after it runs). Measured on CPU, peak inside ``aten::mul``: within 0.1% at
the 70B ratios and 3% at the 8B ratios (``shared/reference/peak-memory-audit.md``, section 5).

``loss="chunked"`` (:data:`LOSSES`): the lm_head and the cross-entropy run on ``loss_chunks``
sequence chunks, as torchtitan's ``ChunkedLossWrapper`` (``torchtitan/components/loss.py:501``,
8 chunks by default at ``:544``) and yashard's fused linear cross-entropy do. Neither the full
logits nor their fp32 log-probabilities or gradients exist: ``logits`` and the head's
log-probabilities are 0, and ``loss_chunk`` is one chunk's logits, log-probabilities and CE
gradients, ``c*V*(p + 12)`` for ``c = n / loss_chunks`` tokens (the full loss's terms at ``c``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

ATTENTION = ("sdpa", "flash_attention_2", "eager")
# How the loss runs: the HF model's own (full logits, upcast to fp32) or in sequence chunks.
LOSSES = ("hf", "chunked")
LOSS_CHUNKS = 8  # torchtitan's ChunkedLossWrapper.Config.num_chunks (torchtitan/components/loss.py:544)
# The model types whose layers keep what :func:`activations` counts; others are refused.
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma")


@dataclass(frozen=True)
class ModelShape:
    """The sizes the activation and peak estimates read: dimensions from the HF config, element
    counts from the parameters (a decoder layer's, the embedding's, the lm_head's)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    layer_numel: int          # every parameter of one decoder layer
    layer_matrix_numel: int   # its parameters with two or more dimensions
    largest_matrix: int       # the largest single parameter of a layer
    embed_numel: int
    lm_head_numel: int        # 0 when tied to the embedding
    other_numel: int          # the rest: final norm, biases outside the layers
    total_numel: int
    layer_params: tuple[int, ...] = ()   # the element count of each parameter of one decoder layer
    other_params: tuple[int, ...] = ()   # of each parameter counted in other_numel
    family: str = "llama"                # the config's model_type


def shape_of(model_or_config) -> ModelShape:
    """The :class:`ModelShape` of an ``nn.Module`` (read only), a transformers config, or the path
    of a ``config.json`` or a folder holding one (built on the meta device)."""
    import torch
    from torch import nn

    model = model_or_config
    if not isinstance(model, nn.Module):
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = AutoConfig.from_pretrained(os.fspath(model)) if isinstance(model, (str, os.PathLike)) else model
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
    cfg = model.config
    layer = model.model.layers[0]
    layer_params = list(layer.parameters())
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is None or head.weight is embed
    total = sum(p.numel() for p in model.parameters())
    layers = cfg.num_hidden_layers
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    layer_numel = sum(p.numel() for p in layer_params)
    lm_head = 0 if tied else head.weight.numel()
    inside = {id(p) for p in layer_params} | {id(embed)} | ({id(head.weight)} if head is not None else set())
    in_layers = {id(p) for block in model.model.layers for p in block.parameters()}
    other = tuple(p.numel() for p in model.parameters() if id(p) not in inside and id(p) not in in_layers)
    return ModelShape(
        hidden=cfg.hidden_size, intermediate=cfg.intermediate_size, layers=layers, heads=heads,
        kv_heads=getattr(cfg, "num_key_value_heads", None) or heads, head_dim=head_dim, vocab=cfg.vocab_size,
        tied=tied, layer_numel=layer_numel, layer_matrix_numel=sum(p.numel() for p in layer_params if p.dim() >= 2),
        largest_matrix=max(p.numel() for p in layer_params), embed_numel=embed.numel(), lm_head_numel=lm_head,
        other_numel=total - layers * layer_numel - embed.numel() - lm_head, total_numel=total,
        layer_params=tuple(p.numel() for p in layer_params), other_params=other,
        family=getattr(cfg, "model_type", None) or "")


@dataclass(frozen=True)
class Activations:
    """Bytes of one micro-batch's activations, per rank."""

    tokens: int               # n = micro_batch * seq
    layer: int                # kept by a decoder layer that is not checkpointed
    checkpointed: int         # kept by a checkpointed layer: its input
    checkpoint_layers: int    # the first this many layers are checkpointed
    layers: int
    head: int                 # the final norm's tensors and the fp32 log-probabilities
    logits: int               # n*V*p, held by the model's output
    loss_forward: int         # the fp32 copy of the logits while the loss runs (0 in fp32)
    loss_backward: int        # the loss's backward: the log-probabilities' gradient and the logits' one, fp32
    layer_grads: int          # one layer's weight gradients in p: autograd holds them all at the layer's end
    mlp_transient: int        # above the recomputed layer in the MLP's Mul backward: 2*n*i*p + h*i*p + 2*n*h*p
    io: int                   # a layer's input or output gradient, n*h*p
    loss: str = "hf"          # LOSSES
    loss_chunk: int = 0       # chunked: one chunk's logits, fp32 log-probabilities and CE gradients
    loss_chunks: int = 1      # chunked: how many sequence chunks

    @property
    def chunked(self) -> bool:
        return self.loss == "chunked"

    def kept(self, k: int) -> int:
        """What layer ``k`` keeps from its forward to its backward."""
        return self.checkpointed if k < self.checkpoint_layers else self.layer

    def in_backward(self, k: int) -> int:
        """What of layer ``k`` is alive in its backward: its activations, recomputed when it is
        checkpointed, on top of the input the checkpoint keeps."""
        return self.layer + (self.checkpointed if k < self.checkpoint_layers else 0)

    @property
    def layers_kept(self) -> int:
        return sum(self.kept(k) for k in range(self.layers))

    @property
    def forward_end(self) -> int:
        """Everything alive when the forward returns: the layers', the head's and the logits."""
        return self.layers_kept + self.head + self.logits


def activations(shape: ModelShape, *, seq: int, micro_batch: int, param_bytes: int, checkpoint_layers: int = 0,
                attention: str = "sdpa", loss: str = "hf", loss_chunks: int = LOSS_CHUNKS) -> Activations:
    """The activation estimate of one micro-batch of ``micro_batch`` sequences of ``seq`` tokens in
    a compute dtype of ``param_bytes`` bytes, the first ``checkpoint_layers`` layers checkpointed,
    the loss the HF model's own (``loss="hf"``) or in ``loss_chunks`` sequence chunks
    (``loss="chunked"``)."""
    if attention not in ATTENTION:
        raise ValueError(f"attention={attention!r}: the estimate knows {', '.join(map(repr, ATTENTION))}")
    if loss not in LOSSES:
        raise ValueError(f"loss={loss!r}: the estimate knows {', '.join(map(repr, LOSSES))}")
    if not isinstance(loss_chunks, int) or loss_chunks < 1:
        raise ValueError(f"loss_chunks={loss_chunks!r}: the number of sequence chunks of the loss, an int >= 1")
    if min(seq, micro_batch, param_bytes) < 1 or checkpoint_layers < 0:
        raise ValueError("seq, micro_batch and param_bytes must be >= 1, checkpoint_layers >= 0")
    if shape.family not in FAMILIES:
        raise ValueError(f"the activation estimate models {', '.join(FAMILIES)} decoders, not model_type="
                         f"{shape.family!r} (its norms, attention or MLP keep other tensors); estimate its "
                         "activations by measuring one step")
    n, p, h, i = micro_batch * seq, param_bytes, shape.hidden, shape.intermediate
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    gemma = shape.family == "gemma"
    # Gemma's RMSNorm keeps its normalised input in fp32 (not in p) and its (1 + weight) in fp32
    norm = n * h * 4 + (n * h * 4 if gemma else n * h * p) + n * h * p + n * 4 + (h * 4 if gemma else 0)
    if attention == "eager":
        repeated = q if shape.kv_heads != shape.heads else kv
        probs = micro_batch * shape.heads * seq * seq
        attn = n * q * p + 2 * n * repeated * p + probs * 4 + (probs * p if p != 4 else 0) + n * q * p
    else:
        attn = n * q * p + 2 * n * kv * p + n * q * p + micro_batch * shape.heads * seq * 4
    if shape.family == "qwen3":  # q and k normalised per head: the input in fp32, the output in p, a root per row
        attn += n * (q + kv) * (4 + p) + n * (shape.heads + shape.kv_heads) * 4
    layer = 2 * norm + attn + 4 * n * i * p
    v = shape.vocab
    shared = 16 * n + 2 * seq * shape.head_dim * p + 4 + (p if gemma else 0)  # ids, labels, rope, Gemma's scale
    common = dict(tokens=n, layer=layer, checkpointed=n * h * p, checkpoint_layers=min(checkpoint_layers, shape.layers),
                  layers=shape.layers, layer_grads=shape.layer_matrix_numel * p,
                  mlp_transient=2 * n * i * p + h * i * p + 2 * n * h * p, io=n * h * p)
    if loss == "chunked":
        chunk = -(-n // loss_chunks)
        return Activations(**common, head=norm + shared, logits=0, loss_forward=0, loss_backward=0, loss="chunked",
                           loss_chunk=chunk * v * (p + 12), loss_chunks=loss_chunks)
    return Activations(**common, head=norm + n * v * 4 + shared, logits=n * v * p, loss_forward=n * v * 4 if p != 4 else 0,
                       loss_backward=2 * n * v * 4)


@dataclass(frozen=True)
class Moment:
    """One point of a training step and the bytes alive there, per rank."""

    name: str
    bytes: int


@dataclass(frozen=True)
class Peak:
    """The moments of a step an engine's peak can sit at; ``bytes`` is the highest."""

    engine: str
    moments: tuple[Moment, ...]
    state: int                # held between steps: model state, optimizer state, fixed buffers

    @property
    def bytes(self) -> int:
        return max(m.bytes for m in self.moments)

    @property
    def at(self) -> str:
        return max(self.moments, key=lambda m: m.bytes).name


FUSED_CHUNK_TOKENS = 1024  # yashard's fused loss: tokens per chunk (ShardConfig.loss_chunk_tokens, issue 42)


def yashard_peak(state: int, shape: ModelShape, acts: Activations, *, step_in_backward_saves: int = 0,
                 loss_chunk_tokens: int = FUSED_CHUNK_TOKENS, head_trains: bool = True) -> Peak:
    """yashard's peak: ``state`` (the memory plan and AdamW's moments, held from step one) plus the
    activations and the backward's transients. Nothing of yashard's own is allocated in a step, so
    the candidates are the forward's end, the loss's backward, the lm_head's backward (its weight
    gradient, ``V*h*p``, before it is copied into the slot) and each layer's backward: autograd
    computes all of a layer's weight gradients, ``p`` each, before the nodes that copy them into
    the gradient slot run, while the MLP's ``Mul`` backward (``acts.mlp_transient``), or a
    checkpointed layer's recompute, come on top of the lower layers' activations.

    With a chunked loss (yashard's fused linear cross-entropy, chunks of ``loss_chunk_tokens``
    tokens) the loss's moment is one chunk of ``c`` tokens: its logits in ``p``, their fp32 upcast
    and fp32 log-probabilities, ``c*V*(p + 8)``, over the hidden states' gradient in ``p``; the
    lm_head's weight gradient is added into its gradient slot, so no lm_head moment, and no logits
    stay alive in the layers' backward.

    ``step_in_backward_saves``: the bytes of ``state`` that the optimizer step in backward removes,
    the fp32 gradient shards (``4 N/W``, :func:`yashard.plan.grad_shard_bytes`): each unit steps
    from the reduce-scatter output it already holds, so no buffer replaces them.

    ``head_trains=False``: a frozen lm_head (QLoRA's), whose backward makes no weight gradient."""
    if step_in_backward_saves < 0 or step_in_backward_saves > state:
        raise ValueError(f"step_in_backward_saves={step_in_backward_saves}: the fp32 gradient shards' bytes, between 0 "
                         f"and the state ({state})")
    state -= step_in_backward_saves
    fwd = state + acts.forward_end
    p = acts.io // (acts.tokens * shape.hidden)
    if acts.chunked:
        if not isinstance(loss_chunk_tokens, int) or loss_chunk_tokens < 1:
            raise ValueError(f"loss_chunk_tokens={loss_chunk_tokens!r}: the fused loss's tokens per chunk, an int >= 1")
        chunk = min(acts.tokens, loss_chunk_tokens) * shape.vocab * (p + 8)
        moments = [Moment("forward end", fwd), Moment("loss (one chunk)", fwd + acts.io + chunk)]
    else:
        head_grad = shape.vocab * shape.hidden * p if head_trains else 0
        moments = [
            Moment("forward end", fwd + acts.loss_forward),
            Moment("loss backward", fwd + acts.loss_backward),
            Moment("lm_head backward", fwd - acts.head + acts.logits + head_grad + acts.io),
        ]
    below = acts.layers_kept
    for k in reversed(range(shape.layers)):
        below -= acts.kept(k)
        base = state + below + acts.logits
        moments.append(Moment(f"layer {k} backward", base + max(
            acts.in_backward(k) + acts.mlp_transient,  # in the MLP's Mul backward
            acts.layer_grads + 2 * acts.io)))       # at the layer's end
    return Peak("yashard", tuple(moments), state)
