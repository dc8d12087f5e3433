"""How a train rank gets its weights to the engines: one object per rank, one mode per run.

`--update-weights-mode` (resolved in `slime.arguments.validate`; `auto` picks per run shape):

- `distributed` (default without `--colocate`): rank 0 and the
  engines form a private process group (gloo on CPU, NCCL on GPU; SGLang's
  `/init_weights_update_group` + `/update_weights_from_distributed`), made once and reused;
  each bucket of at most `--update-weight-buffer-size` tensor bytes is announced over HTTP
  and broadcast. Before each push rank 0 checks that every engine still has the group (a
  restarted engine has not) and rebuilds it if not; a failed push drops the group (the next
  push builds a new one); a push to
  a subset of the engines (one restarted engine under --use-fault-tolerance) goes by `tensor`.
- `disk` (default with `--colocate` and the native engine): same-host hand-off by path. Each
  bucket is written as safetensors into shared memory (`/dev/shm` when present) and the engine
  loads it with `/update_weights_from_disk`, so the bytes cross processes through a RAM file
  instead of an HTTP body. With `--colocate` each rank hands the buckets to the engines placed
  on its own device (engine j sits on rank j x --rollout-num-gpus-per-engine), so this also
  works on several nodes. Native engine only (SGLang's disk load expects a whole model
  directory).
- `tensor`: safetensors bytes in the body of `/update_weights_from_tensor` (any engine that
  speaks the protocol, any host). The default with `--colocate` for SGLang/vLLM.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable

from torch import Tensor

from slime.training.weight_sync import (
    DEFAULT_TIMEOUT, broadcast_weights, init_broadcast_group, iter_buckets, sync_weights,
)

logger = logging.getLogger(__name__)

MODES = ("auto", "tensor", "distributed", "disk")
DISK_ENDPOINT = "/update_weights_from_disk"


def resolve_mode(mode: str, colocate: bool, rollout_backend: str) -> str:
    """The concrete mode for `--update-weights-mode auto` (others pass through)."""
    if mode != "auto":
        return mode
    if colocate:
        return "disk" if rollout_backend == "native" else "tensor"
    return "distributed"


def shm_dir() -> str | None:
    """/dev/shm when it is a writable directory (Linux), else None (the system temp dir)."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def push_by_path(named_weights: Iterable[tuple[str, Tensor]], engine_urls: list[str], weight_version,
                 buffer_size: int, *, send: bool = True, directory: str | None = None,
                 timeout: float = DEFAULT_TIMEOUT) -> dict[str, float]:
    """Write each bucket (<= buffer_size tensor bytes) as `<tmp>/bucket.safetensors` under
    `directory` (default /dev/shm) and have every engine load it by path; the cache is flushed
    after the last bucket. All ranks iterate `named_weights` (collective gathers); only
    `send=True` writes and posts. Returns sizes and times like `sync_weights`."""
    from safetensors.torch import save_file

    from slime.engines.client import EngineError, post_json

    t0 = time.perf_counter()
    if not send or not engine_urls:
        for _ in named_weights:
            pass
        return {"bytes": 0, "payload_bytes": 0, "buckets": 0, "seconds": time.perf_counter() - t0,
                "num_engines": len(engine_urls)}
    tensor_bytes = payload_bytes = n_buckets = 0
    tmp = tempfile.mkdtemp(prefix="slime-weights-", dir=directory if directory is not None else shm_dir())
    try:
        with ThreadPoolExecutor(max_workers=max(1, min(8, len(engine_urls)))) as pool:
            for bucket in iter_buckets(named_weights, buffer_size):
                bucket_dir = os.path.join(tmp, f"bucket_{n_buckets:05d}")
                os.mkdir(bucket_dir)
                path = os.path.join(bucket_dir, "bucket.safetensors")
                save_file({n: t.detach().to("cpu").contiguous() for n, t in bucket}, path)
                body = {"model_path": bucket_dir, "weight_version": str(weight_version)}
                futs = [(u, pool.submit(post_json, u, DISK_ENDPOINT, body, timeout)) for u in engine_urls]
                for url, fut in futs:
                    resp = fut.result()
                    if not resp.get("success", False):
                        raise EngineError(f"POST {url}{DISK_ENDPOINT} did not succeed: {resp!r}", url=url,
                                          endpoint=DISK_ENDPOINT)
                tensor_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
                payload_bytes += os.path.getsize(path)
                n_buckets += 1
                shutil.rmtree(bucket_dir, ignore_errors=True)
            for fut in [pool.submit(post_json, u, "/flush_cache", {}, timeout) for u in engine_urls]:
                fut.result()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"bytes": tensor_bytes, "payload_bytes": payload_bytes, "buckets": n_buckets,
            "seconds": time.perf_counter() - t0, "num_engines": len(engine_urls)}


class WeightPusher:
    """One train rank's end of the weight sync (`args.update_weights_mode`, already resolved)."""

    def __init__(self, args, rank: int):
        self.args = args
        self.rank = rank
        self.mode = args.update_weights_mode
        self._group = None  # distributed: the broadcast group, made on the first push

    def _my_engines(self, engine_urls: list[str]) -> list[str]:
        """disk + colocate over all engines: the engines on this rank's device; else rank 0 sends all."""
        args = self.args
        if self.mode == "disk" and args.colocate and len(engine_urls) == args.num_engines:
            per = args.rollout_num_gpus_per_engine
            return [u for j, u in enumerate(engine_urls) if j * per == self.rank]
        return list(engine_urls) if self.rank == 0 else []

    def push(self, named_weights: Iterable[tuple[str, Tensor]], engine_urls: list[str],
             weight_version) -> dict[str, float]:
        """Collective over the train ranks. Returns {"bytes", "buckets", "seconds", "num_engines", ...}."""
        args = self.args
        size = args.update_weight_buffer_size
        mode = self.mode
        if mode == "distributed" and (len(engine_urls) != getattr(args, "num_engines", len(engine_urls)) or (
                self._group is not None and list(engine_urls) != self._group.engine_urls)):
            mode = "tensor"  # a subset (e.g. one restarted engine): the group is for all of them,
            self.close()  # which is stale now (its old process was a member): the next full push builds one
        if mode == "tensor":
            return sync_weights(named_weights, engine_urls, weight_version, size, send=self.rank == 0)
        if mode == "disk":
            mine = self._my_engines(engine_urls)
            stats = push_by_path(named_weights, mine, weight_version, size, send=bool(mine))
            stats["num_engines"] = len(engine_urls)
            return stats
        if mode != "distributed":
            raise ValueError(f"unknown --update-weights-mode {mode!r}")
        if self.rank != 0:
            return broadcast_weights(named_weights, engine_urls, weight_version, size, send=False)
        if self._group is not None and not self._group_intact():
            self.close()  # an engine was restarted (--use-fault-tolerance) and left the group
        if self._group is None:
            self._group = self._new_group(engine_urls)
        try:
            return broadcast_weights(named_weights, engine_urls, weight_version, size, group=self._group,
                                     sessions=args.rollout_backend == "sglang")
        except Exception:
            self.close()  # e.g. an engine left the group: the next push builds a new one
            raise

    def _group_intact(self) -> bool:
        """Whether every engine still has the group (engines that report their groups in
        /get_server_info, as the native one does; others are assumed to)."""
        from slime.engines.client import EngineError, get_json

        for url in self._group.engine_urls:
            try:
                groups = get_json(url, "/get_server_info", timeout=30).get("weight_update_groups")
            except EngineError:
                return False
            if groups is not None and self._group.group_name not in groups:
                return False
        return True

    def _new_group(self, engine_urls: list[str]):
        import uuid

        # SGLang and vLLM engines join with one rank per tensor-parallel worker; a native engine with one
        args = self.args
        tp = 1
        if args.rollout_backend == "sglang":
            tp = args.rollout_num_gpus_per_engine
        elif args.rollout_backend == "vllm":  # --vllm-tensor-parallel-size, else the engine's GPUs
            vllm_args = getattr(args, "vllm_args", None) or {}
            tp = int(vllm_args.get("tensor_parallel_size", args.rollout_num_gpus_per_engine))
        return init_broadcast_group(engine_urls, master_address=_this_host(engine_urls),
                                    group_name=f"slime_weights_{uuid.uuid4().hex[:8]}", tp_size=tp)

    def close(self) -> None:
        if self._group is not None:
            try:
                self._group.close()
            except Exception as e:  # noqa: BLE001 - best effort at shutdown
                logger.warning("closing the weight group: %s", e)
            self._group = None


def _this_host(engine_urls: list[str]) -> str:
    """The address engines reach rank 0 at: loopback when every engine is on loopback, else this
    node's IP as Ray sees it."""
    from urllib.parse import urlparse

    hosts = {urlparse(u).hostname for u in engine_urls}
    if hosts <= {"127.0.0.1", "localhost"}:
        return "127.0.0.1"
    import ray

    return ray.util.get_node_ip_address()
