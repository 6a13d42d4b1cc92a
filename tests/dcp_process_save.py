"""``dcp.async_save`` in its process mode (``AsyncCheckpointerType.PROCESS``) with yashard's
SnapshotStager: a spawned background process per rank receives the staged state dict (pickled) and
writes it. Run with torchrun (the harness's ranks are daemonic and cannot have children):
``torchrun --nproc_per_node 2 tests/dcp_process_save.py CHECKPOINT_DIR WEIGHTS_FILE``. An optimizer
step runs between async_save and waiting for it; rank 0 writes the full weights at the async_save
call to WEIGHTS_FILE."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(path: str, weights_file: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    import yashard
    from models import batches, build
    from yashard.dcp import SnapshotStager

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    sm = yashard.shard(build("llama", seed=3))
    opt = torch.optim.AdamW(sm.param_groups(0.1), lr=1e-2)
    before = sm.full_state_dict()
    fut = dcp.async_save({"model": sm.sharded_state_dict()}, checkpoint_id=path, async_stager=SnapshotStager(),
                         async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    ids = batches(1, 2 * world, 8, 96)[0].chunk(world)[rank]
    sm(input_ids=ids, labels=ids).loss.backward()
    opt.step()                       # the masters change while the background process may still be writing
    fut.result()
    if rank == 0:
        torch.save(before, weights_file)
    # stop the background process now (DCP otherwise does it when the interpreter exits, which
    # os._exit skips: the process would see its pipe close and print an EOFError)
    import torch.distributed.checkpoint._async_process_executor as executor

    executor._CHECKPOINT_PROCESS = None
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":  # the background process is spawned: it imports this file again
    main(*sys.argv[1:])
