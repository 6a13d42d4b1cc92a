"""The errors yashard raises for its own reasons, and the helper that names things in them."""

from __future__ import annotations


class OrderError(RuntimeError):
    """A unit ran out of the order the fixed buffers require."""


class NonFiniteError(FloatingPointError):
    """A NaN or inf reached the gradients (``ShardConfig(on_nonfinite="raise")``)."""


class CollectiveOrderError(RuntimeError):
    """Ranks issued different sequences of collectives (``ShardConfig(debug_collectives=True)``)."""


def some_names(names: list[str], shown: int = 3) -> str:
    """``"a, b, c and 4 more"``: the first few of ``names`` for an error message."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more
