"""Colocated training: the trainer gives its memory to the engines while they generate.

`Offloader(tensors)` frees the storage behind the trainer's parameters, optimizer state and
(if present) reference model, and `onload()` puts the exact bytes back. It works on storages,
not on modules: every tensor object (FSDP's DTensors and their local shards, the optimizer's
`exp_avg`/`exp_avg_sq`) stays the same Python object, so FSDP and the optimizer keep their
references and nothing is re-sharded or re-built.

Where the bytes go:
- on a CUDA device: pinned host memory (device memory goes back to the allocator and
  `torch.cuda.empty_cache()` returns it to the driver, so engines on the same GPU can use it);
- on a CPU-only machine there is no "device memory": parameters already live in host RAM.
  Offloading then spills the bytes to a file in a private temporary directory (`offload_dir`,
  default the system temp dir; keep it off /dev/shm, which is RAM) and frees the RAM, so the
  trainer process's resident set really shrinks while the engines generate. The kernel may
  keep the file in its page cache, which it reclaims under memory pressure.

Use `resident(method)` on methods that touch the weights: when called while offloaded they
onload first and offload again afterwards, so a stray call never reads freed memory.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import logging
import os
import time
from typing import Iterable

import psutil
import torch
from torch import Tensor

from slime.utils import run_dirs

logger = logging.getLogger(__name__)


def rss_bytes(pid: int | None = None) -> int:
    """Resident set size of a process (this one by default), from /proc via psutil."""
    return psutil.Process(pid).memory_info().rss


def trim_heap() -> None:
    """Give freed heap pages back to the OS (glibc keeps small freed blocks otherwise)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _local(t: Tensor) -> Tensor:
    from torch.distributed.tensor import DTensor  # here: the driver imports this module (slime.training.actor)

    return t._local_tensor if isinstance(t, DTensor) else t


def _bytes_view(storage: torch.UntypedStorage) -> Tensor:
    """A uint8 tensor over the whole storage (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _host_buffer(storage: torch.UntypedStorage) -> memoryview:
    """The bytes of a CPU storage as a writable memoryview (no copy; unlike `.numpy()` this
    leaves the storage resizable)."""
    return memoryview((ctypes.c_char * storage.nbytes()).from_address(storage.data_ptr())).cast("B")


class Offloader:
    """Frees and restores the storages behind a set of tensors (see the module docstring)."""

    def __init__(self, offload_dir: str | None = None):
        self.offload_dir = offload_dir
        self._stash: list[tuple[torch.UntypedStorage, int, object]] | None = None
        self._dir: str | None = None
        self.offloaded_bytes = 0

    @property
    def is_offloaded(self) -> bool:
        return self._stash is not None

    @staticmethod
    def _storages(tensors: Iterable[Tensor], kept: list[int],
                  device: torch.device | None = None) -> list[torch.UntypedStorage]:
        """The distinct storages to free (those on `device` only, when given); sizes of those that
        cannot be freed go to `kept` (a shard whose storage was pinned, e.g. by `.numpy()`)."""
        seen: dict[tuple[str, int], torch.UntypedStorage] = {}
        for t in tensors:
            if t is None:
                continue
            local = _local(t)
            if device is not None and local.device.type != device.type:
                continue  # already off the device (a GPU run's host-resident reference model or offloaded optimizer)
            if not local.untyped_storage().resizable():
                # e.g. a frozen reference model memory-mapped from its safetensors file: give it
                # its own (resizable) memory once, then it offloads like everything else
                if local is not t:  # FSDP aliases the shard's storage: it stays where it is
                    kept.append(local.untyped_storage().nbytes())
                    continue
                with torch.no_grad():
                    t.data = t.data.clone()
            st = local.untyped_storage() if local is not t else t.untyped_storage()
            if st.nbytes() == 0:
                continue
            seen.setdefault((str(st.device), st.data_ptr()), st)
        return list(seen.values())

    def offload(self, tensors: Iterable[Tensor], device: torch.device | None = None) -> dict[str, float]:
        """Move the bytes of every distinct storage behind `tensors` off the device and free it.
        `device`: the training device; storages elsewhere are already off it and stay (on a GPU,
        the reference model and `--optimizer-cpu-offload`'s state live in pinned host memory).
        Returns {"bytes", "seconds"}; a second call while offloaded does nothing."""
        start = time.perf_counter()
        if self._stash is not None:
            return {"bytes": 0, "seconds": 0.0}
        kept: list[int] = []
        storages = self._storages(tensors, kept, device)
        if kept:
            logger.warning("offload: %d storages (%d bytes) cannot be resized and stay resident", len(kept), sum(kept))
        stash = []
        total = 0
        f = None
        try:
            for st in storages:
                n = st.nbytes()
                if st.device.type == "cpu":
                    if f is None:
                        self._dir = run_dirs.private_dir("slime-offload-", self.offload_dir)
                        f = open(os.path.join(self._dir, "state.bin"), "wb")
                    offset = f.tell()
                    f.write(_host_buffer(st))
                    where: object = offset
                else:
                    host = torch.empty(n, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
                    host.copy_(_bytes_view(st), non_blocking=False)
                    where = host
                stash.append((st, n, where))
                total += n
        finally:
            if f is not None:
                f.close()
        if any(st.device.type == "cuda" for st, _, _ in stash):
            torch.cuda.synchronize()
        for st, _, _ in stash:
            st.resize_(0)
        self._stash = stash
        self.offloaded_bytes = total
        if any(st.device.type == "cuda" for st, _, _ in stash):
            torch.cuda.empty_cache()
        trim_heap()
        return {"bytes": total, "kept_bytes": sum(kept), "seconds": time.perf_counter() - start}

    def onload(self) -> dict[str, float]:
        """Give every freed storage its bytes back (same size, same contents). Returns
        {"bytes", "seconds"}; does nothing when not offloaded."""
        start = time.perf_counter()
        if self._stash is None:
            return {"bytes": 0, "seconds": 0.0}
        total = 0
        f = open(os.path.join(self._dir, "state.bin"), "rb") if self._dir else None
        try:
            for st, n, where in self._stash:
                st.resize_(n)
                if isinstance(where, int):
                    f.seek(where)
                    got = f.readinto(_host_buffer(st))
                    if got != n:
                        raise RuntimeError(f"offload file {f.name} is short: read {got} of {n} bytes")
                else:
                    _bytes_view(st).copy_(where, non_blocking=False)
                total += n
        finally:
            if f is not None:
                f.close()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._stash = None
        if self._dir is not None:
            run_dirs.release(self._dir)
            self._dir = None
        return {"bytes": total, "seconds": time.perf_counter() - start}

    def close(self) -> None:
        if self._dir is not None:
            run_dirs.release(self._dir)
            self._dir = None
        self._stash = None


def backend_tensors(backend) -> list[Tensor]:
    """Everything a training backend keeps per rank: parameters, gradients, optimizer state, the
    frozen reference model and OPD teacher (`model`, `optimizer`, `ref_model`, `teacher_model` of a
    `TrainBackend`), and the megatron backend's fp32 main copies under --bf16 (`main_params`)."""
    out: list[Tensor] = []
    for module in (backend.model, backend.ref_model, getattr(backend, "teacher_model", None)):
        if module is None:
            continue
        for p in module.parameters():
            out.append(p)
            if p.grad is not None:
                out.append(p.grad)
        out.extend(b for b in module.buffers())
    for state in backend.optimizer.state.values():
        out.extend(v for v in state.values() if isinstance(v, Tensor))
    main_params = getattr(backend, "main_params", None)  # megatron --bf16: the fp32 main copies
    if main_params is not None:
        out.extend(main_params.tensors())
    return out


def resident(method=None, *, stay: bool = False):
    """Decorator for TrainActor methods that read or write the weights: when the actor is
    offloaded (its `_offloader`, an Offloader or None, holds the bytes), onload for the call and
    offload again afterwards. `stay=True` (methods whose result may alias the weights
    in-process, such as `full_state`) leaves it onloaded."""
    if method is None:
        return functools.partial(resident, stay=stay)

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        off = self._offloader
        if off is None or not off.is_offloaded:
            return method(self, *args, **kwargs)
        self.onload()
        if stay:
            return method(self, *args, **kwargs)
        try:
            return method(self, *args, **kwargs)
        finally:
            self.offload()

    return wrapper
