"""yashard: sharded data parallelism on fixed, preallocated, layer-alternating buffers."""

from .api import ShardedModel, from_pretrained, shard
from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .collectives import CollectiveError
from .config import ShardConfig
from .grad_scaler import ShardedGradScaler
from .guards import CollectiveOrderError, NonFiniteError
from .hf_export import export_hf
from .memory import MemoryPlan
from .runtime import OrderError
from .stub import ShardedStub

__all__ = ["shard", "from_pretrained", "ShardConfig", "ShardedModel", "MemoryPlan", "OrderError",
           "save_checkpoint", "load_checkpoint", "export_hf", "CheckpointError", "CollectiveError",
           "CollectiveOrderError", "NonFiniteError", "ShardedGradScaler", "ShardedStub"]
__version__ = "0.1.0"
