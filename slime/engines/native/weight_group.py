"""The process group that carries weights from a trainer (rank 0) to engines (ranks 1..N).

Both ends build it the way SGLang's engines do (`init_custom_process_group`), so a trainer's
group meets a native engine and a real SGLang engine alike: torch's `tcp://` rendezvous on
`master_address:master_port` (rank 0 hosts the TCPStore), the store wrapped in
`PrefixStore(group_name)`, and the group made by torch's `_new_process_group_helper`
(gloo on CPU, NCCL on GPU). It needs no `torch.distributed.init_process_group`: the trainer
keeps its own FSDP group and the engine process has none.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, rendezvous


def new_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
              backend: str = "gloo", timeout_s: float = 600.0, device: torch.device | None = None):
    """Join (rank > 0) or host (rank 0) the group; blocks until all `world_size` ranks joined.

    Returns (process group, store): `pg.broadcast(tensor, root).wait()`; keep the store alive.
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and device is not None and device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    store, _, _ = next(rendezvous(f"tcp://{master_address}:{int(master_port)}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
                                      group_name=group_name, timeout=timeout)
    return pg, store  # keep the store alive as long as the group


def destroy_group(pg) -> None:
    """Shut a group made by `new_group` down and unregister it (its name can be used again).

    `_new_process_group_helper` with no global ranks records no rank mapping, which torch's
    `destroy_process_group` expects to delete: give it an empty one first."""
    c10d._world.pg_group_ranks.setdefault(pg, {})
    dist.destroy_process_group(pg)
