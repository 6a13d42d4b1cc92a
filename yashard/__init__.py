"""yashard: sharded data parallelism on fixed, preallocated, layer-alternating buffers."""

from .api import ShardedModel, from_pretrained, shard
from .config import ShardConfig
from .memory import MemoryPlan
from .runtime import OrderError

__all__ = ["shard", "from_pretrained", "ShardConfig", "ShardedModel", "MemoryPlan", "OrderError"]
__version__ = "0.1.0"
