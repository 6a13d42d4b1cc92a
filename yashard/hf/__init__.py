"""yashard with the Hugging Face training stack.

* :class:`Accelerator`: ``accelerate.Accelerator`` that shards the model instead of wrapping it in DDP.
* :class:`Trainer`: ``transformers.Trainer`` on a sharded model; the user's ``TrainingArguments`` as they are.
* :class:`SFTTrainer`: TRL's ``SFTTrainer`` the same way (needs ``trl``).
* :func:`sharded_trainer`: the same for any other subclass of ``transformers.Trainer``.

Needs ``accelerate`` (``pip install yashard[hf]``); imported only when used (``import yashard`` does not).
"""

from __future__ import annotations

try:
    import accelerate  # noqa: F401
except ImportError as e:  # (a clear message instead of one deep inside the trainer's imports)
    raise ImportError("yashard.hf needs Hugging Face Accelerate: pip install 'yashard[hf]' "
                      "(accelerate, trl, peft, datasets)") from e

from .accelerator import Accelerator  # noqa: E402
from .trainer import ShardedTrainerMixin, Trainer, shard_config_from_args, sharded_trainer  # noqa: E402

__all__ = ["Accelerator", "Trainer", "SFTTrainer", "ShardedTrainerMixin", "sharded_trainer", "shard_config_from_args"]


def __getattr__(name: str):
    if name == "SFTTrainer":  # (TRL is imported only when asked for)
        try:
            from trl import SFTTrainer as _SFTTrainer
        except ImportError as e:
            raise ImportError("yashard.hf.SFTTrainer needs TRL: pip install 'yashard[hf]' (accelerate, trl, peft, "
                              "datasets)") from e

        return sharded_trainer(_SFTTrainer)
    raise AttributeError(f"module 'yashard.hf' has no attribute {name!r}")
