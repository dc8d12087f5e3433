"""torch.distributed rendezvous that binds one address, never every interface.

torch's `tcp://` rendezvous starts the TCPStore server on all interfaces, and torch's `gloo`
backend binds the address the machine's hostname resolves to. slime's process groups (the train
group; the weight-sync group of a trainer and its engines) instead:
- host the store on a socket the caller bound to its node's address (`listening_socket`), handed
  to the store by file descriptor (no window in which another process could take the port);
- use `gloo_at(address)`: torch's gloo with its device bound to `address`.
"""

from __future__ import annotations

import datetime
import socket

import torch.distributed as dist
from torch.distributed import ProcessGroupGloo, TCPStore

# the address a process that is not a Ray worker (the vLLM engine's workers) binds its gloo sockets to
BIND_ADDRESS_ENV = "SLIME_BIND_ADDRESS"

_GLOO_BACKENDS: dict[str, str] = {}


def gloo_at(address: str) -> str:
    """The name of a backend that is torch's gloo with its sockets bound to `address` (registered
    once per address and process)."""
    if address not in _GLOO_BACKENDS:
        name = "gloo_at_" + "".join(c if c.isalnum() else "_" for c in address)

        def create(store, rank: int, size: int, timeout: datetime.timedelta):
            options = ProcessGroupGloo._Options()
            options._timeout = timeout
            options._devices = [ProcessGroupGloo.create_device(hostname=address)]
            return ProcessGroupGloo(store, rank, size, options)

        dist.Backend.register_backend(name, create, devices=["cpu"])
        _GLOO_BACKENDS[address] = name
    return _GLOO_BACKENDS[address]


def backend_for(device_type: str, address: str) -> str:
    """The process-group backend of a group on `device_type` whose CPU sockets bind `address`."""
    gloo = gloo_at(address)
    return f"cpu:{gloo},cuda:nccl" if device_type == "cuda" else gloo


def tcp_store(host: str, port: int, rank: int, world_size: int, timeout: datetime.timedelta,
              listener: socket.socket | None = None) -> TCPStore:
    """Rank 0 serves the store on `listener` (bound to host:port by the caller; made here when
    None), the other ranks connect to host:port."""
    if rank != 0:
        return TCPStore(host, port, world_size, False, timeout=timeout)
    if listener is None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(128)
    port = listener.getsockname()[1]
    # the store owns the descriptor from here on (detach: Python will not close it)
    return TCPStore(host, port, world_size, True, timeout=timeout, wait_for_workers=False,
                    master_listen_fd=listener.detach())


def init_process_group(device_type: str, rank: int, world_size: int, host: str, port: int,
                       timeout: datetime.timedelta, listener: socket.socket | None = None,
                       bind_address: str | None = None) -> None:
    """The default process group over a store at host:port (rank 0 serves it); this rank's gloo
    sockets bind `bind_address` (default `host`, right for rank 0; other ranks give their own)."""
    store = tcp_store(host, port, rank, world_size, timeout, listener)
    dist.init_process_group(backend_for(device_type, bind_address or host), store=store, rank=rank,
                            world_size=world_size, timeout=timeout)
