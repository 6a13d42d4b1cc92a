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
"""

from __future__ import annotations

import os
from dataclasses import dataclass

ATTENTION = ("sdpa", "flash_attention_2", "eager")
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
    mlp_backward: int         # the MLP's activation gradients in flight, 2*n*i*p
    io: int                   # a layer's input or output gradient, n*h*p

    def kept(self, k: int) -> int:
        """What layer ``k`` keeps from its forward to its backward."""
        return self.checkpointed if k < self.checkpoint_layers else self.layer

    @property
    def layers_kept(self) -> int:
        return sum(self.kept(k) for k in range(self.layers))

    @property
    def forward_end(self) -> int:
        """Everything alive when the forward returns: the layers', the head's and the logits."""
        return self.layers_kept + self.head + self.logits


def activations(shape: ModelShape, *, seq: int, micro_batch: int, param_bytes: int, checkpoint_layers: int = 0,
                attention: str = "sdpa") -> Activations:
    """The activation estimate of one micro-batch of ``micro_batch`` sequences of ``seq`` tokens in
    a compute dtype of ``param_bytes`` bytes, the first ``checkpoint_layers`` layers checkpointed."""
    if attention not in ATTENTION:
        raise ValueError(f"attention={attention!r}: the estimate knows {', '.join(map(repr, ATTENTION))}")
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
    return Activations(
        tokens=n, layer=layer, checkpointed=n * h * p, checkpoint_layers=min(checkpoint_layers, shape.layers),
        layers=shape.layers, head=norm + n * v * 4 + 16 * n + 2 * seq * shape.head_dim * p + 4 + (p if gemma else 0), logits=n * v * p, loss_forward=n * v * 4 if p != 4 else 0,
        loss_backward=2 * n * v * 4, layer_grads=shape.layer_matrix_numel * p, mlp_backward=2 * n * i * p, io=n * h * p)


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


def yashard_peak(state: int, shape: ModelShape, acts: Activations) -> Peak:
    """yashard's peak: ``state`` (the memory plan and AdamW's moments, held from step one) plus the
    activations and the backward's transients. Nothing of yashard's own is allocated in a step, so
    the candidates are the forward's end, the loss's backward, the lm_head's backward (its weight
    gradient, ``V*h*p``, before it is copied into the slot) and each layer's backward: autograd
    computes all of a layer's weight gradients, ``p`` each, before the nodes that copy them into
    the gradient slot run, while the MLP's activation gradients, or a checkpointed layer's
    recompute, come on top of the lower layers' activations."""
    fwd = state + acts.forward_end
    p = acts.logits // (acts.tokens * shape.vocab)
    head_grad = shape.vocab * shape.hidden * p
    moments = [
        Moment("forward end", fwd + acts.loss_forward),
        Moment("loss backward", fwd + acts.loss_backward),
        Moment("lm_head backward", fwd - acts.head + acts.logits + head_grad + acts.io),
    ]
    below = acts.layers_kept
    for k in reversed(range(shape.layers)):
        below -= acts.kept(k)
        base = state + below + acts.logits
        mlp = min(3 * shape.largest_matrix, shape.layer_matrix_numel)  # the MLP's three weights
        moments.append(Moment(f"layer {k} backward", base + max(
            acts.layer + mlp * p + acts.mlp_backward,  # in the MLP's backward
            acts.layer_grads + 2 * acts.io)))                                       # at the layer's end
    return Peak("yashard", tuple(moments), state)
