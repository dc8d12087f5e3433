"""The process group that carries weights from a trainer (rank 0) to engines (ranks 1..N).

Both ends build it the way SGLang's engines do (`init_custom_process_group`), so a trainer's
group meets a native engine and a real SGLang engine alike: a TCPStore at
`master_address:master_port` (rank 0 hosts it, on a socket bound to that address only:
`slime.utils.dist.tcp_store`), the store wrapped in `PrefixStore(group_name)`, and the group made
by torch's `_new_process_group_helper` (gloo on CPU with its sockets on `bind_address`, NCCL on GPU). It needs no `torch.distributed.init_process_group`: the trainer
keeps its own FSDP group and the engine process has none.
"""

from __future__ import annotations

import datetime
import socket

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper

from slime.utils.dist import gloo_at, tcp_store


def new_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
              backend: str = "gloo", timeout_s: float = 600.0, device: torch.device | None = None,
              bind_address: str | None = None, listener: socket.socket | None = None):
    """Join (rank > 0) or host (rank 0) the group; blocks until all `world_size` ranks joined.
    `bind_address`: where this rank's gloo sockets listen (default: torch's gloo, which binds the
    address the machine's hostname resolves to); `listener`:
    rank 0's socket bound to master_address:master_port (made here when None).

    Returns (process group, store): `pg.broadcast(tensor, root).wait()`; keep the store alive.
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and device is not None and device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = tcp_store(master_address, int(master_port), rank, world_size, timeout, listener)
    name = gloo_at(bind_address) if backend == "gloo" and bind_address else backend
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(name), PrefixStore(group_name, store),
                                      group_name=group_name, timeout=timeout)
    return pg, store  # keep the store alive as long as the group


def destroy_group(pg) -> None:
    """Shut a group made by `new_group` down and unregister it (its name can be used again).

    `_new_process_group_helper` with no global ranks records no rank mapping, which torch's
    `destroy_process_group` expects to delete: give it an empty one first."""
    c10d._world.pg_group_ranks.setdefault(pg, {})
    dist.destroy_process_group(pg)
