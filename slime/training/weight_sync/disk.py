"""`--update-weights-mode disk`: same-host hand-off by path (the default with --colocate and the
native engine; native engine only, as SGLang's disk load expects a whole model directory).

Each bucket is written as `bucket.safetensors` into its own directory under the run's weight
directory (`slime.engines.auth.run_weights_dir`: in `/dev/shm` when present, mode 0700, the only
place the run's engines load from besides its output and checkpoints), every engine loads it with `/update_weights_from_disk`
(`EngineControl.update_weights_from_disk`), and the directory is removed; the bytes cross
processes through a RAM file instead of an HTTP body. The prefix cache is flushed once, after the
last bucket (`flush_cache`; the native engine's disk load does not flush by itself).

With --colocate (and a push to all engines) each rank hands the buckets to the engines placed on
its own device, engine j sitting on rank j x --rollout-num-gpus-per-engine, so this also works on
several nodes; otherwise rank 0 feeds every engine.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from functools import partial
from itertools import count
from typing import Iterable

from safetensors.torch import save_file
from torch import Tensor

from slime.engines.control import EngineControl
from slime.utils import run_dirs
from slime.training.weight_sync.buckets import (
    DEFAULT_TIMEOUT, Bucket, call_all, engine_pool, push_buckets,
)


def own_directory(path: str) -> str:
    """`path` as a directory of this user only (created 0700), held by this process
    (`slime.utils.run_dirs`: removed by the last holder, or by a later start after a crash);
    refuses one someone else made."""
    run_dirs.sweep_once(os.path.dirname(os.path.abspath(path)))
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if not os.path.isdir(path) or os.path.islink(path) or st.st_uid != os.getuid():
        raise PermissionError(f"{path} exists and is not a directory of this user; remove it")
    return run_dirs.hold(path)


class DiskTransport:
    """The ranks with engines on their device (or rank 0) write buckets and have those engines load them.

    num_engines: the run's engines; gpus_per_engine: --rollout-num-gpus-per-engine when colocated
    (each rank feeds its own engines), None otherwise (rank 0 feeds all); directory: where the
    buckets go (the run's weight directory, which its engines are told to accept)."""

    def __init__(self, buffer_size: int, rank: int, *, num_engines: int, gpus_per_engine: int | None = None,
                 directory: str, timeout: float = DEFAULT_TIMEOUT):
        self.buffer_size = buffer_size
        self.rank = rank
        self.num_engines = num_engines
        self.gpus_per_engine = gpus_per_engine
        self.directory = directory
        self.timeout = timeout
        self.engine_urls: list[str] = []
        self.engines: list[EngineControl] = []  # the ones this rank feeds

    def connect(self, engine_urls: list[str]) -> None:
        self.engine_urls = list(engine_urls)
        if self.gpus_per_engine is not None and len(engine_urls) == self.num_engines:
            mine = [u for j, u in enumerate(engine_urls) if j * self.gpus_per_engine == self.rank]
        else:
            mine = list(engine_urls) if self.rank == 0 else []
        self.engines = [EngineControl(url, timeout=self.timeout) for url in mine]

    def push(self, named_weights: Iterable[tuple[str, Tensor]], weight_version) -> dict[str, float]:
        """Collective over the train ranks. Returns {"bytes": tensor bytes per engine, "payload_bytes":
        file bytes per engine, "buckets", "seconds", "num_engines": all engines pushed to} (zero
        counts on ranks that feed no engine)."""
        t0 = time.perf_counter()
        if not self.engines:
            counts = push_buckets(named_weights, self.buffer_size, None)
        else:
            tmp = tempfile.mkdtemp(prefix="push-", dir=own_directory(self.directory))
            try:
                with engine_pool(len(self.engines)) as pool:
                    numbers = count()

                    def send(bucket: Bucket, last: bool) -> int:
                        bucket_dir = os.path.join(tmp, f"bucket_{next(numbers):05d}")
                        os.mkdir(bucket_dir)
                        path = os.path.join(bucket_dir, "bucket.safetensors")
                        save_file({n: t.detach().to("cpu").contiguous() for n, t in bucket}, path)
                        call_all(pool, [partial(e.update_weights_from_disk, bucket_dir, weight_version, False)
                                        for e in self.engines])
                        size = os.path.getsize(path)
                        shutil.rmtree(bucket_dir, ignore_errors=True)
                        return size

                    counts = push_buckets(named_weights, self.buffer_size, send)
                    call_all(pool, [e.flush_cache for e in self.engines])
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        return {"bytes": counts.bytes, "payload_bytes": counts.payload_bytes, "buckets": counts.buckets,
                "seconds": time.perf_counter() - t0, "num_engines": len(self.engine_urls)}

    def close(self) -> None:
        self.engines = []
        run_dirs.release(self.directory)  # removed unless another rank of the run still holds it
