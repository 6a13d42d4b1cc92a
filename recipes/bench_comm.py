"""Count the collectives any engine issues, with their sizes, from the dispatcher.

Every ``torch.distributed`` collective, whether called from Python (FSDP2, FSDP1, DeepSpeed,
yashard) or from C++ (DDP's reducer calls ``ProcessGroup::allreduce``, which dispatches the
``c10d::allreduce_`` op), goes through a ``c10d::*`` (or ``_c10d_functional::*``) operator of the
PyTorch dispatcher. :class:`CollectiveCounter` is a ``TorchDispatchMode`` that sees each of those
calls with its real tensor arguments (shapes and dtypes, TensorLists included) and its process
group, so one mechanism counts every engine alike. The profiler was the other candidate; on gloo
it emits no ``record_param_comms`` events and its ``c10d::*`` events carry no dtype for TensorList
arguments, so it cannot give bytes.

Sizes follow yashard's collective log (``yashard/collectives.py``): a collective's *payload* is the
size of its full tensor: the gathered output of an all-gather, the input of a reduce-scatter or an
all-to-all, the tensor of an all-reduce or a broadcast. :func:`ring_bytes_sent` turns a payload
into the bytes one rank sends with the bandwidth-optimal (ring) algorithm, which is what NCCL
moves; gloo runs a reduce-scatter as an all-reduce of the full tensor, so on CPU it moves more.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# dispatcher op (namespace-less, overload-less name) -> kind of collective
_KINDS = {
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce", "all_reduce_coalesced": "all_reduce", "all_reduce_coalesced_": "all_reduce",
    "_allgather_base_": "all_gather", "allgather_": "all_gather", "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather", "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather", "all_gather_into_tensor_out": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "alltoall_base_": "all_to_all", "alltoall_": "all_to_all", "all_to_all_single": "all_to_all",
    "broadcast_": "broadcast", "broadcast": "broadcast",
    "reduce_": "reduce", "gather_": "gather", "scatter_": "scatter",
    "send": "p2p", "recv_": "p2p", "recv_any_source_": "p2p",
    "barrier": "barrier", "monitored_barrier_": "barrier",
}
# which arguments hold the payload, per kind ("output*" / "input*" / the in-place "tensor(s)")
_PAYLOAD_ARGS = {
    "all_gather": ("output",), "reduce_scatter": ("input",), "all_to_all": ("input",),
    "all_reduce": ("tensor", "input"), "broadcast": ("tensor", "input"), "reduce": ("tensor", "input"),
    "gather": ("input",), "scatter": ("output",), "p2p": ("tensor",), "barrier": (),
}


def collective_kind(op_name: str) -> str | None:
    """The kind of collective (``all_gather``, ``reduce_scatter``, ``all_reduce``, ``all_to_all``,
    ``broadcast``, ``reduce``, ``gather``, ``scatter``, ``p2p``, ``barrier``) of a dispatcher op name
    such as ``"c10d::_allgather_base_"`` or ``"_c10d_functional::all_reduce"``; None if the op is not
    a collective (``wait_tensor``, ``_wrap_tensor_autograd``, ...)."""
    return _KINDS.get(op_name.split("::")[-1].split(".")[0])


def payload_bytes(kind: str, args: dict[str, int], group_size: int) -> int:
    """Payload of one collective of ``kind`` (see the module docstring) from ``args``: bytes of the
    tensors of each tensor-valued argument, by argument name (``{"output_tensor": 800,
    "input_tensor": 400}``). A functional all-gather has no output argument: its payload is its
    input times the group size."""
    prefixes = _PAYLOAD_ARGS[kind]
    picked = [b for name, b in args.items() if name.startswith(prefixes)] if prefixes else []
    if kind == "all_gather" and not picked:
        return sum(b for name, b in args.items() if name.startswith("input")) * group_size
    return sum(picked)


def ring_bytes_sent(kind: str, payload: int, group_size: int) -> float:
    """Bytes one rank sends for a collective of ``payload`` bytes over ``group_size`` ranks with the
    bandwidth-optimal algorithms (ring all-gather / reduce-scatter / all-to-all: (g-1)/g of the
    payload; all-reduce = reduce-scatter + all-gather: 2(g-1)/g; pipelined broadcast: (g-1)/g on
    average; point-to-point: all of it). A group of one sends nothing."""
    g = group_size
    if g <= 1 or kind == "barrier":
        return 0.0
    if kind == "p2p":
        return float(payload)
    factor = 2.0 if kind == "all_reduce" else 1.0
    return factor * payload * (g - 1) / g


class Call(NamedTuple):
    """One collective seen by :class:`CollectiveCounter`."""

    kind: str
    op: str
    payload: int
    group_size: int


def _tensor_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _group_size(func, args, kwargs, default: int) -> int:
    import torch.distributed as dist

    for a, value in zip(func._schema.arguments, list(args) + [kwargs.get(a.name) for a in
                                                             func._schema.arguments[len(args):]]):
        if value is None:
            continue
        if a.name == "group_size" and isinstance(value, int):
            return value
        if "ProcessGroup" in str(a.type):
            try:
                return dist.ProcessGroup.unbox(value).size()
            except Exception:  # noqa: BLE001 - an unboxable group: fall back to the world size
                return default
        if a.name == "group_name" and isinstance(value, str):
            try:
                return dist.distributed_c10d._resolve_process_group(value).size()
            except Exception:  # noqa: BLE001
                return default
    return default


class CollectiveCounter(TorchDispatchMode):
    """``with CollectiveCounter() as c: ...`` records every collective dispatched inside the block
    (this thread and the autograd threads it drives) in ``c.calls``; the ops themselves run
    unchanged. Slows every operator down (Python dispatch): never use it inside a timed region."""

    def __init__(self):
        super().__init__()
        self.calls: list[Call] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in ("c10d", "_c10d_functional", "deepspeed"):
            kind = collective_kind(func._schema.name) if func.namespace != "deepspeed" else (
                "all_reduce" if "all_reduce" in func._schema.name else None)
            if kind is not None:
                import torch.distributed as dist

                world = dist.get_world_size() if dist.is_initialized() else 1
                g = _group_size(func, args, kwargs, world)
                named = {a.name: _tensor_bytes(v) for a, v in zip(func._schema.arguments, args)}
                named.update({k: _tensor_bytes(v) for k, v in kwargs.items()})
                self.calls.append(Call(kind, func._schema.name, payload_bytes(kind, named, g), g))
        return func(*args, **kwargs)


def summarize(calls: Iterable[Call], steps: int) -> dict:
    """Per-step totals of ``calls`` recorded over ``steps`` steps: ``count`` (collectives, barriers
    excluded), ``payload`` and ``ring_sent`` (bytes), and ``by_kind`` {kind: [count, payload]}."""
    calls = [c for c in calls if c.kind != "barrier"]
    by_kind: Counter = Counter()
    by_bytes: Counter = Counter()
    for c in calls:
        by_kind[c.kind] += 1
        by_bytes[c.kind] += c.payload
    return {
        "count": len(calls) / steps,
        "payload": sum(c.payload for c in calls) / steps,
        # a receive sends nothing: its bytes are the peer's send
        "ring_sent": sum(0.0 if "recv" in c.op else ring_bytes_sent(c.kind, c.payload, c.group_size)
                         for c in calls) / steps,
        "by_kind": {k: [by_kind[k] / steps, by_bytes[k] / steps] for k in sorted(by_kind)},
    }


def summarize_log(records, steps: int, group_sizes: dict[str, int]) -> dict:
    """The same per-step totals as :func:`summarize` from yashard's collective log records
    ``(op, unit, numel, nbytes, group)``; ``group_sizes`` maps the log's group labels to sizes."""
    calls = [Call(op, op, nbytes, group_sizes.get(group, 1)) for op, _unit, _numel, nbytes, group in records]
    return summarize(calls, steps)


def compare_with_log(log: dict, counter: dict, tolerance: int = 1024) -> str:
    """One sentence comparing yashard's own collective log with the dispatch counter, both as
    returned by :func:`summarize`. The bytes this rank sends (``ring_sent``) must agree, within
    ``tolerance`` bytes (the runtime's step-check all-gather, which the log leaves out). Sent bytes
    are the measure that does not depend on how a collective is carried out: on gloo yashard runs
    its all-gathers and two-rank reduce-scatters as sends and receives (a W-rank all-gather is
    W-1 sends and W-1 receives of one shard), so payloads and counts differ from the log's, and
    each kind is listed from both sides."""
    def kinds(s):
        return ", ".join(f"{k} {n:g}" for k, (n, _b) in s["by_kind"].items()) or "none"
    same = abs(log["ring_sent"] - counter["ring_sent"]) <= tolerance
    return (f"its collective log has {log['ring_sent'] / 2**20:.2f} MiB sent per step, the dispatch counter "
            f"{counter['ring_sent'] / 2**20:.2f} MiB ({'same bytes' if same else 'DIFFERENT BYTES'}); "
            f"payload: log {log['payload'] / 2**20:.2f} MiB, counter {counter['payload'] / 2**20:.2f} MiB; "
            f"collectives by kind: log {kinds(log)}; counter {kinds(counter)} (the counter counts "
            "operators: on gloo an all-gather or a two-rank reduce-scatter is sends and receives, and the "
            "runtime's step check adds one small all-gather that the log leaves out)")
