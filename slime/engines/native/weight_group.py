"""A private process group for broadcasting weights from a trainer to engines.

The trainer (rank 0) and every engine (ranks 1..N) meet at a `TCPStore` on
`master_address:master_port` and build a process group object from it directly
(`ProcessGroupGloo` on CPU, `ProcessGroupNCCL` on GPU), so the group needs no
`torch.distributed.init_process_group` and does not touch (or require) a default group:
the trainer keeps its own FSDP group and the engine process has none.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist


def new_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
              backend: str = "gloo", timeout_s: float = 600.0, device: torch.device | None = None):
    """Join (rank > 0) or host (rank 0) the group; blocks until all `world_size` ranks joined.

    Returns (process group, store): `pg.broadcast(tensor, root).wait()`; keep the store alive.
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, int(master_port), world_size, is_master=(rank == 0), timeout=timeout,
                          wait_for_workers=False)
    store = dist.PrefixStore(f"slime_weights/{group_name}", store)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=master_address)]
        pg = dist.ProcessGroupGloo(store, rank, world_size, opts)
    else:
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
        if device is not None and device.type == "cuda":
            torch.cuda.set_device(device)
    return pg, store  # keep the store alive as long as the group
