"""`--update-weights-mode distributed` (the default without --colocate): weights over a process group.

Rank 0 and the engines form a private process group (gloo on CPU, NCCL on GPU), independent of the
trainer's own: rank 0 hosts it and every engine joins through `/init_weights_update_group`
(SGLang's protocol; `EngineControl.init_weights_update_group`), engine i's tensor-parallel worker r
as rank 1 + i x ranks_per_engine + r (`EngineKind.weight_group_ranks`). For each bucket rank 0
announces the names, dtypes and shapes (`/update_weights_from_distributed`, `flush_cache` true on
the last bucket only: vLLM applies the buckets then) and broadcasts the tensors in that order.
With SGLang (`EngineKind.weight_update_sessions`) a push is wrapped in its begin/end weight-update
session.

The group is made on the first push and reused. Before each push rank 0 checks that every engine
still has it (a restarted engine has not; engines that report their groups in
`/get_server_info`, as the native one does) and rebuilds it if not; a failed push drops it (the
next push builds a new one). A push to a subset of the engines (one engine restarted under
--use-fault-tolerance) cannot use the group, which spans all of them: it goes by the `tensor`
transport this one holds for that, with a warning naming the engines.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Iterable

import torch
from torch import Tensor

from slime.engines.control import EngineControl, EngineError
from slime.engines.native.weight_group import destroy_group, new_group
from slime.training.weight_sync.buckets import (
    DEFAULT_TIMEOUT, Bucket, BucketCounts, engine_pool, push_buckets,
)
from slime.training.weight_sync.tensor import TensorTransport
from slime.utils.net import listening_socket, node_address

logger = logging.getLogger(__name__)

CONTROL_TIMEOUT = 30.0  # seconds for the group checks and teardown calls


class BroadcastGroup:
    """The trainer's end (rank 0) of a weight-broadcast group with `engine_urls` (ranks 1..N).

    Built with `init_broadcast_group`; `close()` it at the end. `store` (the rendezvous TCPStore)
    must stay alive as long as the group."""

    def __init__(self, pg, engine_urls: list[str], group_name: str, backend: str, device: torch.device,
                 store=None):
        self.pg = pg
        self.engine_urls = list(engine_urls)
        self.group_name = group_name
        self.backend = backend
        self.device = device
        self.store = store

    def close(self, timeout: float = CONTROL_TIMEOUT) -> None:
        for url in self.engine_urls:
            try:
                EngineControl(url, timeout=timeout).destroy_weights_update_group(self.group_name)
            except EngineError as e:
                logger.warning("could not destroy weight group on %s: %s", url, e)
        if self.pg is not None:
            destroy_group(self.pg)
        self.pg = None
        self.store = None


def init_broadcast_group(engine_urls: list[str], *, master_address: str | None = None, master_port: int | None = None,
                         group_name: str = "slime_weight_sync", backend: str | None = None,
                         timeout: float = DEFAULT_TIMEOUT, tp_size: int = 1) -> BroadcastGroup:
    """Create the broadcast group: every engine is asked to join (`init_weights_update_group`) while
    this process joins as rank 0; engine i's tensor-parallel rank r joins as 1 + i * tp_size + r
    (SGLang adds its TP rank to the rank_offset it is given; the native engine has one rank).
    backend: gloo (CPU tensors) or nccl (CUDA tensors); default nccl when CUDA is available.
    master_address: this node's address (`node_address()`: what the engines reach it at; the store
    and the gloo sockets bind it only); master_port: default a port the OS picks."""
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    master_address = master_address or node_address()
    listener = None
    if master_port is None:
        listener = listening_socket(master_address)
        master_port = listener.getsockname()[1]
    world_size = 1 + len(engine_urls) * tp_size
    engines = [EngineControl(url, timeout=timeout) for url in engine_urls]
    with engine_pool(len(engines), most=16) as pool:
        futs = [pool.submit(e.init_weights_update_group, master_address, master_port, 1 + i * tp_size, world_size,
                            group_name, backend) for i, e in enumerate(engines)]
        pg, store = new_group(master_address, master_port, 0, world_size, group_name, backend, timeout,
                              bind_address=master_address, listener=listener)
        for fut in futs:
            fut.result()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    return BroadcastGroup(pg, engine_urls, group_name, backend, device, store)


class DistributedTransport:
    """Rank 0 broadcasts every bucket over the group; the other ranks only iterate the weights.

    num_engines: the run's engines (a push to fewer goes by `tensor`); ranks_per_engine: ranks one
    engine joins the group with; sessions: SGLang's begin/end weight-update calls; backend: the
    group's (default nccl with CUDA, else gloo)."""

    def __init__(self, buffer_size: int, rank: int, *, num_engines: int, ranks_per_engine: int = 1,
                 sessions: bool = False, backend: str | None = None, timeout: float = DEFAULT_TIMEOUT):
        self.buffer_size = buffer_size
        self.rank = rank
        self.num_engines = num_engines
        self.ranks_per_engine = ranks_per_engine
        self.sessions = sessions
        self.backend = backend
        self.timeout = timeout
        self.engine_urls: list[str] = []
        self.group: BroadcastGroup | None = None  # rank 0: made on the first push
        self.partial = TensorTransport(buffer_size, rank, timeout=timeout)  # for pushes to a subset
        self._use_partial = False

    def connect(self, engine_urls: list[str]) -> None:
        urls = list(engine_urls)
        why = None
        if len(urls) != self.num_engines:
            why = f"a subset of the {self.num_engines} engines (e.g. restarted under --use-fault-tolerance)"
        elif self.group is not None and urls != self.group.engine_urls:
            why = f"not the engines of the broadcast group ({self.group.engine_urls})"
        self._use_partial = why is not None
        if self._use_partial:
            if self.rank == 0:
                logger.warning("pushing weights to %s by tensor instead of the broadcast group: %s, and the "
                               "group spans all engines", urls, why)
            self.close()  # the group is stale now (an old member left); the next full push builds one
            self.partial.connect(urls)
        self.engine_urls = urls

    def push(self, named_weights: Iterable[tuple[str, Tensor]], weight_version) -> dict[str, float]:
        """Collective over the train ranks. Returns {"bytes": tensor bytes per engine, "buckets",
        "seconds", "num_engines"} (zero counts on the ranks that do not send); a push to a subset
        returns the `tensor` transport's stats."""
        if self._use_partial:
            return self.partial.push(named_weights, weight_version)
        if self.rank != 0:
            t0 = time.perf_counter()
            counts = push_buckets(named_weights, self.buffer_size, None)
        else:
            if self.group is not None and not self._group_intact():
                self.close()  # an engine was restarted (--use-fault-tolerance) and left the group
            if self.group is None:
                self.group = init_broadcast_group(
                    self.engine_urls, backend=self.backend,
                    group_name=f"slime_weights_{uuid.uuid4().hex[:8]}", timeout=self.timeout,
                    tp_size=self.ranks_per_engine)
            t0 = time.perf_counter()
            try:
                counts = self._broadcast(named_weights, weight_version)
            except Exception:
                self.close()  # e.g. an engine left the group: the next push builds a new one
                raise
        return {"bytes": counts.bytes, "buckets": counts.buckets, "seconds": time.perf_counter() - t0,
                "num_engines": len(self.engine_urls)}

    def _broadcast(self, named_weights: Iterable[tuple[str, Tensor]], weight_version) -> BucketCounts:
        group = self.group
        engines = [EngineControl(url, timeout=self.timeout) for url in group.engine_urls]
        if self.sessions:  # SGLang >= 0.5.23 refuses updates outside a session (older ones have none: fine)
            for e in engines:
                e.begin_weight_update()
        with engine_pool(len(engines), most=16) as pool:
            def send(bucket: Bucket, last: bool) -> int:
                tensors = [t.detach().to(group.device).contiguous() for _, t in bucket]
                names = [n for n, _ in bucket]
                dtypes, shapes = [t.dtype for t in tensors], [list(t.shape) for t in tensors]
                futs = [pool.submit(e.update_weights_from_distributed, names, dtypes, shapes, group.group_name,
                                    weight_version, last) for e in engines]
                works = [group.pg.broadcast(t, 0) for t in tensors]
                deadline = time.monotonic() + self.timeout
                while not all(w.is_completed() for w in works):
                    # an engine that refused the bucket never receives: fail fast instead of hanging
                    for fut in futs:
                        if fut.done() and fut.exception() is not None:
                            raise fut.exception()
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"weight broadcast did not complete within {self.timeout}s")
                    time.sleep(0.001)
                for w in works:
                    w.wait()
                for fut in futs:
                    fut.result()
                return 0

            counts = push_buckets(named_weights, self.buffer_size, send)
        if self.sessions:
            for e in engines:
                e.end_weight_update()
        return counts

    def _group_intact(self) -> bool:
        """Whether every engine still has the group (engines that report their groups in their
        server info, as the native one does; others are assumed to)."""
        for url in self.group.engine_urls:
            try:
                groups = EngineControl(url, timeout=CONTROL_TIMEOUT).server_info().get("weight_update_groups")
            except EngineError:
                return False
            if groups is not None and self.group.group_name not in groups:
                return False
        return True

    def close(self) -> None:
        if self.group is not None:
            try:
                self.group.close()
            except Exception as e:  # noqa: BLE001 - best effort at shutdown
                logger.warning("closing the weight group: %s", e)
            self.group = None
