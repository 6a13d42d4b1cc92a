"""recipes/pretrain.py, killed with SIGKILL on every rank when step ``YASHARD_TEST_KILL_AT`` starts
(0-based; steps before it completed, checkpoints included). Run with torchrun like the recipe."""

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "recipes"))

import pretrain  # noqa: E402
import train  # noqa: E402
import train_loop  # noqa: E402  (the loop, and the lr_at it calls, live there)

KILL_AT = int(os.environ["YASHARD_TEST_KILL_AT"])
_lr_at = train_loop.lr_at


def lr_at(step, **kw):
    if step == KILL_AT:
        os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no flush: like kill -9 or a lost node
    return _lr_at(step, **kw)


train_loop.lr_at = lr_at

if __name__ == "__main__":
    pretrain.main()
    train.exit_now()
