"""yashard: sharded data parallelism on fixed, preallocated, layer-alternating buffers."""

from .api import from_pretrained, shard
from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .collectives import CollectiveError
from .config import ShardConfig
from .errors import CollectiveOrderError, NonFiniteError, OrderError
from .grad_scaler import ShardedGradScaler
from .hf_export import export_hf
from .memory import MemoryPlan
from .peft_adapter import save_adapter
from .plan import plan
from .sharded_model import ShardedModel
from .step_in_backward import OptimizerInBackward
from .stub import ShardedStub
from .version import __version__

__all__ = ["shard", "from_pretrained", "plan", "ShardConfig", "ShardedModel", "MemoryPlan", "OrderError",
           "save_checkpoint", "load_checkpoint", "export_hf", "CheckpointError", "CollectiveError",
           "CollectiveOrderError", "NonFiniteError", "ShardedGradScaler", "ShardedStub", "save_adapter",
           "OptimizerInBackward"]
