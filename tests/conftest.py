import os
import socket
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="module")
def pg():
    """A 1-rank gloo process group in this process, for a module's single-rank tests."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():  # pragma: no cover - someone else owns the group
        yield dist.group.WORLD
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: intra-op threads only contend (10x slower on a busy machine)
    try:
        yield dist.group.WORLD
    finally:
        torch.set_num_threads(threads)
        dist.destroy_process_group()
