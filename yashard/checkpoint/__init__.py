"""Sharded checkpoints: every rank saves its own flat pieces; a load at any world size reads back
exactly the ranges it owns.

* :mod:`yashard.checkpoint.format`: the on-disk format (the save directories, shard files, tensor
  keys and ``index.json``), reading and checking an index, and :func:`agree`;
* :mod:`yashard.checkpoint.save`: :func:`save_checkpoint` and its atomic protocol;
* :mod:`yashard.checkpoint.load`: :func:`load_checkpoint`.
"""

from .format import (CheckpointError, agree, check_extra, coverage_problem, decode_value, describe_params,
                     encode_value, overlaps, params_diff, read_index, resolve_checkpoint)
from .load import load_checkpoint
from .save import save_checkpoint

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "resolve_checkpoint", "read_index", "agree",
           "check_extra", "coverage_problem", "decode_value", "describe_params", "encode_value", "overlaps",
           "params_diff"]
