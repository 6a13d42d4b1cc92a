"""The peak memory of yashard's peers on the same model and batch: FSDP2 and DeepSpeed ZeRO-3.

Pure functions of the model's shapes (:class:`~yashard.plan.activations.ModelShape`) and the
activation estimate; each returns a :class:`~yashard.plan.activations.Peak`, so the command line
and ``recipes/plan_check.py`` put them next to yashard's.

**FSDP2** (``torch.distributed.fsdp.fully_shard``, torch 2.13), wrapped as torchtitan wraps it:
one ``fully_shard`` per decoder layer, then one on the root (the embedding, the final norm and the
lm_head). :func:`fsdp2_peak` replays one training step, allocation by allocation, by the rules of
``torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py`` and ``_fsdp_collectives.py``:

- between steps a rank holds its fp32 parameter shards and AdamW's two moments, ``12 N/W`` bytes;
  ``zero_grad(set_to_none=True)`` frees the gradient shards (``FSDPParamGroup.post_backward``
  creates them at each reduction);
- an all-gather allocates the group's flat output, ``P*p``; the copy-out allocates the unsharded
  parameters, ``P*p`` again. In forward the flat output is kept until the next group's copy-out
  (``wait_for_unshard``: ``comm_ctx.all_gather_state``), in backward it is freed at once;
- the root is not resharded after forward (``reshard_after_forward=None`` is False for the root):
  its unsharded parameters stay from its gather to the end of the backward, and so do its
  unsharded gradients (the lm_head's first, the embedding's last);
- in backward each layer prefetches the next one's all-gather (``_backward_prefetch``); the root's
  pre-backward prefetches the last layer;
- a layer's unsharded gradients, ``P*p``, all exist at its post-backward. There it reshards, copies
  them into a reduce-scatter input in the reduce dtype, ``P*r`` (``foreach_reduce``), frees them,
  allocates the output, ``P/W*r``, which becomes the gradient shard, and keeps the input until the
  next group's post-backward (``comm_ctx.reduce_scatter_states``, one buffer by default);
- over gloo, both collectives stage a temporary the size of the unsharded tensor (measured with
  ``recipes/plan_check.py``); NCCL does not.

**DeepSpeed ZeRO-3**: :func:`deepspeed_zero3_peak` takes the model states from DeepSpeed's own
estimator, ``deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs`` without offload:
``4 * largest_layer_params + 18 * N/W``, where a "layer" is the module with the most parameters of
its own (for Llama, the embedding or the lm_head). On top come the stage-3 defaults of
``deepspeed/runtime/zero/config.py``: parameters under ``stage3_param_persistence_threshold`` (1e5
elements) stay whole on every rank; ``stage3_prefetch_bucket_size`` (5e7 elements) of gathered
parameters run ahead of the module in use; ``reduce_bucket_size`` (5e8 elements) is the gradient
reduction buffer; ``stage3_max_live_parameters`` (1e9) caps the gathered parameters, and a layer
stays gathered from its forward to its backward when fewer than ``stage3_max_reuse_distance`` (1e9)
parameters are fetched in between. Not measured
here: DeepSpeed is not installed on the check machine.
"""

from __future__ import annotations

from .activations import Activations, ModelShape, Moment, Peak

# DeepSpeed's stage-3 defaults, in elements (deepspeed/runtime/zero/config.py)
DS_PERSISTENCE_THRESHOLD = 100_000
DS_PREFETCH_BUCKET = 50_000_000
DS_REDUCE_BUCKET = 500_000_000
DS_MAX_LIVE_PARAMETERS = 1_000_000_000
DS_MAX_REUSE_DISTANCE = 1_000_000_000


class _Timeline:
    """Bytes alive, step by step, and the highest point each named moment reached."""

    def __init__(self, start: int):
        self.now = start
        self.moments: list[Moment] = []

    def add(self, nbytes: int) -> None:
        self.now += nbytes

    def mark(self, name: str, extra: int = 0) -> None:
        """A moment: what is alive now plus ``extra`` bytes that exist only at that moment."""
        self.moments.append(Moment(name, self.now + extra))


def fsdp2_peak(shape: ModelShape, acts: Activations, *, world: int, param_bytes: int, reduce_bytes: int = 4,
               backend: str = "nccl") -> Peak:
    """FSDP2's peak per rank for one micro-batch (see the module docstring for the rules), with
    fp32 parameters, ``param_bytes`` compute (``MixedPrecisionPolicy.param_dtype``), gradients
    reduced in ``reduce_bytes``, fused AdamW. Parameters are padded to a multiple of ``world``
    rows, which is left out."""
    w, p, r = world, param_bytes, reduce_bytes
    gloo = backend == "gloo" and w > 1
    layer = shape.layer_numel
    root = shape.total_numel - shape.layers * layer
    state = 12 * shape.total_numel // w
    t = _Timeline(state)
    staging = (lambda numel, b: numel * b) if gloo else (lambda numel, b: 0)

    def gather(name: str, numel: int, kept_output: int) -> None:
        t.add(numel * p)                                  # the flat all-gather output
        t.mark(name + ": all-gather", staging(numel, p) + kept_output)

    # forward: the root's gather, then each layer's; the previous flat output waits for the copy-out
    gather("forward root", root, 0)
    t.add(root * p)                                       # the root's unsharded parameters, kept
    kept = root * p                                       # the root's flat output, kept in forward
    for k in range(shape.layers):
        t.add(layer * p)
        t.mark(f"forward layer {k}: all-gather", staging(layer, p))
        t.add(-kept)                                      # the previous flat output, freed
        t.add(layer * p)                                  # copy-out: this layer's unsharded parameters
        kept = layer * p
        t.add(acts.kept(k))
        t.mark(f"forward layer {k}")
        t.add(-layer * p)                                 # resharded after forward
    t.add(acts.head + acts.logits)
    t.mark("forward end (loss)", acts.loss_forward)
    t.add(-kept)                                          # the root's post-forward frees the last flat output

    # backward: the root prefetches the last layer; the loss and the lm_head run on the root's weights
    gather_out = layer * p
    t.add(gather_out)
    t.mark("backward: prefetch of the last layer", staging(layer, p))
    t.mark("loss backward", acts.loss_backward)
    t.add(-acts.head + shape.lm_head_numel * p)           # the lm_head's unsharded gradient stays
    t.mark("lm_head backward", acts.logits + acts.io)
    retained = 0
    for k in reversed(range(shape.layers)):
        t.mark(f"layer {k} pre-backward: copy-out", layer * p)
        # (the unsharded parameters replace the flat output: the same size)
        if k > 0:
            t.add(layer * p)
            t.mark(f"layer {k} pre-backward: prefetch of layer {k - 1}", staging(layer, p))
        # in the MLP's backward: the layer's activations (recomputed when checkpointed), the MLP's
        # weight gradients and its activation gradients; at the end, all of its unsharded gradients
        mlp = min(3 * shape.largest_matrix, shape.layer_matrix_numel) * p
        t.mark(f"layer {k} backward (MLP)", acts.layer - acts.kept(k) + mlp + acts.mlp_backward)
        t.add(-acts.kept(k))
        t.add(layer * p)
        t.mark(f"layer {k} backward end", 2 * acts.io)
        t.add(-layer * p)                                 # post-backward: reshard
        t.add(-retained)                                  # the previous reduce-scatter input, freed
        t.add(layer * r)                                  # the reduce-scatter input, copied in
        t.add(-layer * p)                                 # the unsharded gradients, freed
        t.add(layer * r // w)                             # the output: the gradient shard
        t.mark(f"layer {k} reduce-scatter", staging(layer, r))
        retained = layer * r
    # the embedding's gradient, then the root's reduction at the end of the backward
    t.add(shape.embed_numel * p + (root - shape.embed_numel - shape.lm_head_numel) * p)
    t.mark("embedding backward", acts.io)
    t.add(-root * p)                                      # the root reshards
    t.add(-retained + root * r)
    t.add(-root * p + root * r // w)
    t.mark("root reduce-scatter", staging(root, r))
    return Peak("fsdp2", tuple(t.moments), state)


def fsdp2_forward_end(shape: ModelShape, acts: Activations, *, param_bytes: int) -> int:
    """What FSDP2 adds from a step's start to its forward's end: the activations and the root's
    unsharded parameters, kept for the backward."""
    return acts.forward_end + (shape.total_numel - shape.layers * shape.layer_numel) * param_bytes


def deepspeed_estimator_bytes(shape: ModelShape, world: int) -> int:
    """DeepSpeed's own estimate of ZeRO-3's model states per GPU without offload
    (``estimate_zero3_model_states_mem_needs``): ``4 * largest_layer_params + 18 * N/W``."""
    largest = max(shape.embed_numel, shape.lm_head_numel, shape.largest_matrix)
    return 4 * largest + 18 * shape.total_numel // world


def deepspeed_kept_layers(shape: ModelShape) -> int:
    """How many of the last layers ZeRO-3 keeps gathered from their forward to their backward:
    those with fewer than ``stage3_max_reuse_distance`` parameters fetched in between (the layers
    above them and the lm_head, twice)."""
    between, kept = shape.lm_head_numel, 0
    for _ in range(shape.layers):
        if 2 * between > DS_MAX_REUSE_DISTANCE:
            break
        kept += 1
        between += shape.layer_matrix_numel
    return kept


def deepspeed_zero3_peak(shape: ModelShape, acts: Activations, *, world: int, param_bytes: int) -> Peak:
    """ZeRO-3's peak per rank: DeepSpeed's estimator for the model states, the replicated small
    parameters, the gathered parameters (the module in use plus the prefetch bucket, capped by
    ``stage3_max_live_parameters``) and the last layers kept for their backward, the reduce bucket in ``param_bytes``, and the activations as
    for the other engines (the largest of the loss's backward and a layer's weight gradients)."""
    p = param_bytes
    state = deepspeed_estimator_bytes(shape, world)
    small = (shape.layer_numel - shape.layer_matrix_numel) * shape.layers + shape.other_numel
    kept = deepspeed_kept_layers(shape) * shape.layer_matrix_numel
    live = min(DS_MAX_LIVE_PARAMETERS, kept + max(shape.embed_numel, shape.lm_head_numel, shape.layer_numel)
               + DS_PREFETCH_BUCKET) * p
    bucket = min(DS_REDUCE_BUCKET, shape.total_numel) * p
    base = state + small * p + bucket
    fwd = base + acts.forward_end
    moments = (Moment("forward end", fwd + live + acts.loss_forward),
               Moment("loss backward", fwd + live + acts.loss_backward),
               Moment("layer backward", base + live + acts.forward_end - acts.head + acts.layer_grads + acts.mlp_backward))
    return Peak("deepspeed-zero3", moments, state + small * p + bucket)
