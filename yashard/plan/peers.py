"""The peak memory of yashard's peers on the same model and batch: FSDP2 and DeepSpeed ZeRO-3.

Pure functions of the model's shapes (:class:`~yashard.plan.activations.ModelShape`) and the
activation estimate; each returns a :class:`~yashard.plan.activations.Peak`, so the command line
and ``recipes/plan_check.py`` put them next to yashard's.

**FSDP2** (``torch.distributed.fsdp.fully_shard``, torch 2.13). By default it is wrapped as
torchtitan wraps it since its PR #1094 (2025-07), to its HEAD b5bcd76 (2026-08): the embedding
alone, resharded after forward; each decoder layer; ``[norm, lm_head]`` one group with
``reshard_after_forward=False``; ``fully_shard(model)`` last, owning no parameter
(``torchtitan/distributed/fsdp.py:252-265``, the same in its HF-transformers backend). A tied
model is one group of the embedding, the norm and the lm_head, kept (``fsdp.py:238-250``).
``root_group=True`` (``--fsdp2-root-group``) is the older wrapping: each layer, then the root
holding the embedding, the norm and the lm_head, not resharded after forward
(``reshard_after_forward=None`` is False for the root: ``_fully_shard.py:246``).
:func:`fsdp2_peak` replays one training step, allocation by allocation:

- between steps a rank holds its fp32 parameter shards and AdamW's two moments, ``12 N/W`` bytes;
  ``zero_grad(set_to_none=True)`` frees the gradient shards (``FSDPParamGroup.post_backward``
  creates them at each reduction);
- an all-gather allocates the group's flat output, ``P*p``; the copy-out allocates the unsharded
  parameters, ``P*p`` again. In forward the flat output is kept until the next group's copy-out
  (``wait_for_unshard``: ``comm_ctx.all_gather_state``), in backward it is freed at once;
- pre-backward hooks go on every grad-requiring tensor of a wrapped module's output
  (``_fsdp_state.py:434-452``). With the root wrapping the root's hook sits on the loss the HF
  model returns: it fires before the loss's backward and prefetches the last layer
  (``_fsdp_param_group.py:795``). With torchtitan's the root owns nothing, and the hook of
  ``[norm, lm_head]`` sits on the logits: the prefetch comes after the loss's backward;
- the group holding the lm_head keeps its unsharded parameters and gradients to its
  post-backward: the backward's end for the root, right after the final norm's backward for
  ``[norm, lm_head]``;
- a group's unsharded gradients, ``P*p``, all exist at its post-backward. There it reshards, drops
  the previous reduce-scatter input (``_fsdp_param_group.py:647-659``, one buffer by default),
  allocates a reduce-scatter input in the reduce dtype, ``P*r``, and copies the gradients in while
  they live (the copy-in moment, ``_fsdp_collectives.py:597-606``), frees them, allocates the
  output, ``P/W*r``, which becomes the gradient shard, and keeps the input until the next group's
  post-backward;
- a layer's backward rises above its recomputed activations by ``acts.mlp_transient`` (see
  :mod:`yashard.plan.activations`);
- ``loss="chunked"``: torchtitan's ``ChunkedLossWrapper`` (``torchtitan/components/loss.py``)
  after the model's forward: the lm_head kept gathered (``:663``), one backward per chunk into its
  unsharded bf16 gradient (``:696``), the hidden states' gradient accumulated in fp32
  (``GradAccumulator``, ``:639``), one reduce-scatter at the last chunk (``:665``, ``:680``), then
  ``lm_head.reshard()`` (``:706``); the decoder's backward starts at the final norm, whose group
  gathers again;
- over gloo, both collectives stage a temporary the size of the unsharded tensor (measured with
  ``recipes/plan_check.py``); NCCL does not;
- with gradient accumulation every micro-batch after the first starts with the gradient shards of
  the earlier ones, ``4 N/W`` in fp32; each reduction's output is then added into them and freed
  (``foreach_reduce``: ``sharded_param.grad += ...``) instead of becoming them.

**DeepSpeed ZeRO-3** (0.19.8, stage-3 defaults, a client AdamW): :func:`deepspeed_zero3_peak`
counts what ``DeepSpeedZeroOptimizer_Stage3`` and its parameter coordinator allocate (the rules are
in its docstring and :func:`deepspeed_state_bytes`'s), with the defaults of
``deepspeed/runtime/zero/config.py``: parameters under ``stage3_param_persistence_threshold`` (1e5
elements) stay whole on every rank; ``stage3_prefetch_bucket_size`` (5e7 elements) of gathered
parameters run ahead; a gathered module stays gathered until its next use when that comes within
``stage3_max_reuse_distance`` (1e9) elements of the trace; ``stage3_max_live_parameters`` (1e9)
caps only the prefetches (``partitioned_param_coordinator.py:453``): a module's own gather is
whole; gradients go through a ``reduce_bucket_size`` (5e8 elements)
bucket. ``loss="chunked"``: torchtitan's chunked loss run on it (DeepSpeed has none of its own).
Measured on CPU at world 2 (``recipes/plan_check.py``): within 3% on the benchmark models.
DeepSpeed's own estimator (:func:`deepspeed_estimator_bytes`, ``18 N/W`` plus the largest layer)
leaves out the bucket, the persistent parameters and the gathered ones, and is kept for reference.
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
               backend: str = "nccl", accumulating: bool = False, root_group: bool = False) -> Peak:
    """FSDP2's peak per rank for one micro-batch (see the module docstring for the rules), with
    fp32 parameters, ``param_bytes`` compute (``MixedPrecisionPolicy.param_dtype``), gradients
    reduced in ``reduce_bytes``, fused AdamW. Parameters are padded to a multiple of ``world``
    rows, which is left out. ``accumulating``: a micro-batch after the first of a step, which
    starts with the fp32 gradient shards of the earlier ones. ``root_group``: the old wrapping
    (the root holds the embedding, the final norm and the lm_head) instead of torchtitan's."""
    w, p, r = world, param_bytes, reduce_bytes
    gloo = backend == "gloo" and w > 1
    layer = shape.layer_numel
    outer = shape.total_numel - shape.layers * layer      # embedding, final norm, lm_head, the rest
    head_numel = shape.lm_head_numel or shape.embed_numel  # the lm_head's weight (tied: the embedding's)
    # The group holding the lm_head stays gathered, with its gradients, to the backward's end: the
    # root (root_group), or torchtitan's one group of a tied model (fsdp.py:238-250). Otherwise the
    # embedding is its own group and [norm, lm_head] another (fsdp.py:252-265).
    to_end = root_group or shape.tied
    embed = 0 if to_end else shape.embed_numel
    head = outer - embed                                  # the group holding the lm_head
    state = 12 * shape.total_numel // w
    t = _Timeline(state + (4 * shape.total_numel // w if accumulating else 0))
    staging = (lambda numel, b: numel * b) if gloo else (lambda numel, b: 0)
    hidden_grad = acts.tokens * shape.hidden * 4          # chunked: the fp32 hidden-state gradient, accumulated

    def reduce_output(name: str, numel: int, extra: int) -> None:
        """The reduce-scatter's output: the new gradient shard, or, accumulating, a temporary
        (cast to fp32 first if reduced in another dtype) added into the shard and freed."""
        out = numel * r // w + (numel * 4 // w if accumulating and r != 4 else 0)
        t.add(out)
        t.mark(name, extra)
        if accumulating:
            t.add(-out)

    retained = 0

    def post_backward(name: str, params: int, grads: int, reshard: bool = True) -> None:
        """A group's post-backward (_fsdp_param_group.py:588-690): reshard, drop the previous
        reduce-scatter input (:647-659), allocate the fp32 input and copy the bf16 gradients in
        while they live (_fsdp_collectives.py:597-606), free them, the output becomes the shard."""
        nonlocal retained
        if reshard:
            t.add(-params * p)
        t.add(-retained)
        t.add(grads * r)
        t.mark(f"{name} reduce-scatter: copy-in")
        t.add(-grads * p)
        reduce_output(f"{name} reduce-scatter", grads, staging(grads, r))
        retained = grads * r

    # forward: each group's all-gather output waits for the next group's copy-out
    kept = 0

    def forward_gather(name: str, numel: int) -> None:
        nonlocal kept
        t.add(numel * p)
        t.mark(f"forward {name}: all-gather", staging(numel, p))
        t.add(-kept)                                      # the previous flat output, freed
        t.add(numel * p)                                  # copy-out: the unsharded parameters
        kept = numel * p

    if to_end:
        forward_gather("root" if root_group else "embedding, norm and lm_head", head)
    else:
        forward_gather("embedding", embed)
        t.add(-embed * p)                                 # resharded after forward
    for k in range(shape.layers):
        forward_gather(f"layer {k}", layer)
        t.add(acts.kept(k))
        t.mark(f"forward layer {k}")
        t.add(-layer * p)                                 # resharded after forward
    if not to_end:
        forward_gather("norm and lm_head", head)          # reshard_after_forward=False: kept
    t.add(acts.head + acts.logits)
    if not acts.chunked:
        t.mark("forward end (loss)", acts.loss_forward)
    t.add(-kept)                                          # the root's post-forward frees the last flat output
    if acts.chunked:
        # torchtitan's ChunkedLossWrapper (components/loss.py:620-712), after the model's forward:
        # the lm_head kept gathered, a backward per chunk into the unsharded bf16 lm_head gradient,
        # the hidden-state gradient accumulated in fp32 (GradAccumulator, :639), one reduce-scatter
        # at the last chunk (set_requires_gradient_sync, :665 and :680), then lm_head.reshard() (:706)
        t.mark("forward end")
        t.add(hidden_grad)
        t.mark("loss: first chunk", acts.loss_chunk)
        t.add(head_numel * p)                             # the lm_head's unsharded gradient, accumulated
        head_grads = head_numel
        t.mark("loss: a later chunk", acts.loss_chunk)
        if not to_end:
            post_backward("lm_head (last chunk)", 0, head_numel, reshard=False)
            head_grads = 0
            t.add(-head * p)                              # lm_head.reshard()
        t.add(-hidden_grad + acts.io)                     # the accumulated gradient, cast to p, saved for the backward
        # the decoder's backward starts at the final norm: its group's pre-backward re-gathers it
        if not to_end:
            t.add(head * p)
            t.mark("final norm pre-backward: all-gather", staging(head, p))
        t.add(layer * p)
        t.mark("final norm backward: prefetch of the last layer", staging(layer, p) + acts.io)
        t.add(-acts.io - acts.head)                       # (the final norm's saved tensors, freed)
        if not to_end:
            t.add((head - head_numel) * p)                # the final norm's gradient
            post_backward("norm", head, head - head_numel)
    else:
        if root_group:
            # the root's pre-backward hook sits on the loss (_fsdp_state.py:434-452): it fires
            # before the loss's backward and prefetches the last layer (_fsdp_param_group.py:795)
            t.add(layer * p)
            t.mark("backward: prefetch of the last layer", staging(layer, p))
        t.mark("loss backward", acts.loss_backward)
        if not root_group:
            # the hook of the lm_head's group sits on the logits: after the loss's backward
            t.add(layer * p)
            t.mark("lm_head pre-backward: prefetch of the last layer", staging(layer, p))
        t.add(-acts.head + head_numel * p)                # the lm_head's unsharded gradient
        head_grads = head_numel
        t.mark("lm_head backward", acts.logits + acts.io)
        if not to_end:
            t.add((head - head_numel) * p)                # the final norm's gradient
            post_backward("norm and lm_head", head, head)
    for k in reversed(range(shape.layers)):
        t.mark(f"layer {k} pre-backward: copy-out", layer * p)
        # (the unsharded parameters replace the flat output: the same size)
        if k > 0:
            t.add(layer * p)
            t.mark(f"layer {k} pre-backward: prefetch of layer {k - 1}", staging(layer, p))
        elif embed:
            t.add(embed * p)
            t.mark("layer 0 pre-backward: prefetch of the embedding", staging(embed, p))
        # in the MLP's Mul backward: the layer's activations (recomputed when checkpointed) and the
        # rise above them (acts.mlp_transient); at the end, all of its unsharded gradients
        t.mark(f"layer {k} backward (MLP)", acts.in_backward(k) - acts.kept(k) + acts.mlp_transient)
        t.add(-acts.kept(k))
        t.add(layer * p)
        t.mark(f"layer {k} backward end", 2 * acts.io)
        post_backward(f"layer {k}", layer, layer)
    if embed:
        t.add(embed * p)
        t.mark("embedding backward", acts.io)
        post_backward("embedding", embed, embed)
    else:
        # the root's (or the tied group's) gradients: the embedding's, then its reduction at the end
        t.add((head - head_grads) * p)                   # the embedding's and the final norm's
        t.mark("embedding backward", acts.io)
        post_backward("root" if root_group else "embedding, norm and lm_head", head, head)
    return Peak("fsdp2", tuple(t.moments), state)


def fsdp2_forward_end(shape: ModelShape, acts: Activations, *, param_bytes: int, root_group: bool = False) -> int:
    """What FSDP2 adds from a step's start to its forward's end: the activations and the unsharded
    parameters of the group holding the lm_head, kept for the backward (the root's, or torchtitan's
    ``[norm, lm_head]``)."""
    outer = shape.total_numel - shape.layers * shape.layer_numel
    kept = outer if root_group or shape.tied else outer - shape.embed_numel
    return acts.forward_end + kept * param_bytes


def deepspeed_estimator_bytes(shape: ModelShape, world: int) -> int:
    """DeepSpeed's own estimate of ZeRO-3's model states per GPU without offload
    (``estimate_zero3_model_states_mem_needs``): ``4 * largest_layer_params + 18 * N/W``. Printed
    for reference; :func:`deepspeed_zero3_peak` counts what ZeRO-3 really allocates."""
    largest = max(shape.embed_numel, shape.lm_head_numel, shape.largest_matrix)
    return 4 * largest + 18 * shape.total_numel // world


def _persistent(numel: int) -> bool:
    """Kept whole on every rank, never gathered: under ``stage3_param_persistence_threshold``."""
    return numel < DS_PERSISTENCE_THRESHOLD


def deepspeed_gathered_numel(shape: ModelShape) -> tuple[int, int, int]:
    """Elements ZeRO-3 gathers for one decoder layer, the embedding and the lm_head (the
    parameters at or above the persistence threshold)."""
    layer = sum(n for n in shape.layer_params if not _persistent(n)) if shape.layer_params else shape.layer_matrix_numel
    return (layer, 0 if _persistent(shape.embed_numel) else shape.embed_numel,
            0 if _persistent(shape.lm_head_numel) else shape.lm_head_numel)


def deepspeed_persistent_numel(shape: ModelShape) -> int:
    """Elements every rank holds whole: the parameters under the persistence threshold."""
    layer, embed, head = deepspeed_gathered_numel(shape)
    return shape.total_numel - shape.layers * layer - embed - head


def deepspeed_kept_layers(shape: ModelShape) -> int:
    """How many of the last layers ZeRO-3 keeps gathered from their forward to their backward:
    those whose next use comes before ``stage3_max_reuse_distance`` elements of the step's trace
    (the layers above them and the lm_head, forward and backward)."""
    between, kept = shape.lm_head_numel, 0
    for _ in range(shape.layers):
        if 2 * between > DS_MAX_REUSE_DISTANCE:
            break
        kept += 1
        between += shape.layer_numel
    return kept


def deepspeed_state_bytes(shape: ModelShape, *, world: int, param_bytes: int, reduce_bytes: int,
                          backend: str = "nccl") -> int:
    """What ZeRO-3 holds between steps (``DeepSpeedZeroOptimizer_Stage3``, DeepSpeed 0.19.8):
    the parameter partitions in ``p`` (``lp_param_buffer``), an fp32 master copy (a separate copy
    in fp32 too: ``self.device`` is a string, so the dtype-and-device test that would share it
    fails), the gradient partitions in the gradient accumulation dtype, ``p`` by default
    (``grad_partitions_flat_buffer``), AdamW's two fp32 moments, ``(2p + 12) N/W``; the
    persistent parameters whole, ``p`` each; and the gradient bucket, ``torch.empty(reduce_bucket_size)``
    in the communication dtype: allocated whole on a GPU, on the CPU resident only as far as
    gradients were written into it (every gradient of the step, up to the bucket's size)."""
    p, r = param_bytes, reduce_bytes
    bucket = DS_REDUCE_BUCKET if backend == "nccl" else min(DS_REDUCE_BUCKET, shape.total_numel)
    return (2 * p + 12) * shape.total_numel // world + deepspeed_persistent_numel(shape) * p + bucket * r


def deepspeed_zero3_peak(shape: ModelShape, acts: Activations, *, world: int, param_bytes: int,
                         reduce_bytes: int | None = None, backend: str = "nccl") -> Peak:
    """ZeRO-3's peak per rank with its stage-3 defaults and a client AdamW (DeepSpeed 0.19.8):
    the state (:func:`deepspeed_state_bytes`), then the moments of a step.

    - Forward: each module's parameters are gathered, ``p`` each, and stay gathered into the
      backward when their next use is under ``stage3_max_reuse_distance`` elements away (the last
      layers and the lm_head; on small models everything); ``stage3_prefetch_bucket_size``
      elements of the others run ahead; ``stage3_max_live_parameters`` caps the prefetch only.
    - Backward: a module's gathered parameters are released after its backward (their next use is
      the next step). Its weight gradients, ``p`` each, are copied into the bucket and freed.
    - The bucket is reduce-scattered when full and at the backward's end (``reduce_scatter_coalesced``):
      its interleaved copy (``torch.cat``), bucket x ``r``, and over gloo a staging copy as large.
    - The optimizer step: the fp32 gradient partition (``flatten(...).to(fp32)``), ``4 N/W``, and
      in a low-precision dtype the flattened copy before the cast, ``p N/W``.

    ``reduce_bytes``: the communication dtype's size (``communication_data_type``; DeepSpeed's
    default is the model's dtype). Measured on CPU: ``recipes/plan_check.py``."""
    p = param_bytes
    r = p if reduce_bytes is None else reduce_bytes
    gloo = backend == "gloo" and world > 1
    state = deepspeed_state_bytes(shape, world=world, param_bytes=p, reduce_bytes=r, backend=backend)
    layer, embed, head = deepspeed_gathered_numel(shape)
    kept = deepspeed_kept_layers(shape)
    embed_kept = 2 * (shape.layers * shape.layer_numel + shape.lm_head_numel) <= DS_MAX_REUSE_DISTANCE
    released = shape.layers - kept

    def live(required: int, prefetch: int) -> int:
        """Gathered bytes: the parameters a module needs now or keeps by reuse distance, whole,
        and the prefetch, which stops at ``stage3_max_live_parameters`` (only prefetches are
        capped: partitioned_param_coordinator.py:453, DeepSpeed 0.19.8)."""
        return (required + max(0, min(prefetch, DS_PREFETCH_BUCKET, DS_MAX_LIVE_PARAMETERS - required))) * p

    # at the forward's end: the kept layers, the lm_head, the embedding if kept, and the prefetch
    # of the first layers the backward re-gathers
    fwd_gathered = live(kept * layer + head + (embed if embed_kept else 0), released * layer)
    fwd = state + acts.forward_end
    if acts.chunked:
        # torchtitan's ChunkedLossWrapper run on it: per chunk, the lm_head's backward into its
        # gradient (p), the hidden states' gradient accumulated in fp32
        loss = fwd + fwd_gathered + acts.tokens * shape.hidden * 4 + acts.loss_chunk
        moments = [Moment("forward end", fwd + fwd_gathered), Moment("loss: first chunk", loss),
                   Moment("loss: a later chunk", loss + shape.vocab * shape.hidden * p)]
    else:
        moments = [Moment("forward end", fwd + fwd_gathered + acts.loss_forward),
                   Moment("loss backward", fwd + fwd_gathered + acts.loss_backward)]
    below, bucket = acts.layers_kept, head
    full = DS_REDUCE_BUCKET
    for k in reversed(range(shape.layers)):
        below -= acts.kept(k)
        # gathered: this layer, the kept layers under it, the embedding if kept, and the prefetch
        # of the released layers under it
        under_released = max(0, min(k, released))
        under_kept = k - under_released
        gathered = live(layer + under_kept * layer + (embed if embed_kept else 0), under_released * layer)
        base = state + below + acts.logits + gathered
        moments.append(Moment(f"layer {k} backward", base + max(acts.in_backward(k) + acts.mlp_transient,
                                                                acts.layer_grads + 2 * acts.io)))
        if bucket + shape.layer_numel > full:  # the bucket is full: reduce-scattered before this layer's gradients
            moments.append(Moment(f"layer {k} backward: bucket reduce-scatter",
                                  base + acts.kept(k) + full * r * (2 if gloo else 1)))
            bucket = 0
        bucket += shape.layer_numel
    bucket += shape.embed_numel + shape.other_numel
    moments.append(Moment("backward end: bucket reduce-scatter", state + min(bucket, full) * r * (2 if gloo else 1)))
    n_w = shape.total_numel // world
    moments.append(Moment("optimizer step", state + 4 * n_w + (p * n_w if p != 4 else 0)))
    return Peak("deepspeed-zero3", tuple(moments), state)


def deepspeed_forward_end(shape: ModelShape, acts: Activations, *, param_bytes: int) -> int:
    """What ZeRO-3 adds from a step's start to its forward's end: the activations and the
    parameters it keeps gathered for the backward (on models whose whole trace is under
    ``stage3_max_reuse_distance``: every gathered parameter)."""
    peak = deepspeed_zero3_peak(shape, acts, world=1, param_bytes=param_bytes)
    state = peak.state
    return next(m.bytes for m in peak.moments if m.name == "forward end") - state - acts.loss_forward
