"""Trainer -> engines weight sync over HTTP (`/update_weights_from_tensor`).

Every rank iterates the named weights (gathering full tensors is collective); rank 0
packs them into buckets of at most `buffer_size` bytes of tensor data (a single
tensor larger than the buffer travels alone), serializes each bucket with
`safetensors.torch.save` and POSTs it to every engine:

    POST {url}/update_weights_from_tensor?weight_version=V&flush_cache=false
    Content-Type: application/octet-stream, body = safetensors bytes

with `flush_cache=true` on the last bucket. The engine copies each tensor in place
by its Hugging Face name (tied weights are sent once, under the parameter's name)
and answers `{"success": true, "weight_version": "V"}`.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Iterator

from torch import Tensor

logger = logging.getLogger(__name__)

ENDPOINT = "/update_weights_from_tensor"
DEFAULT_TIMEOUT = 600.0


def iter_buckets(named_tensors: Iterable[tuple[str, Tensor]], buffer_size: int) -> Iterator[list[tuple[str, Tensor]]]:
    """Group (name, tensor) pairs in order into lists whose tensor bytes sum to <= buffer_size
    (a tensor bigger than the buffer forms a bucket by itself). Names must be unique."""
    bucket: list[tuple[str, Tensor]] = []
    size = 0
    seen: set[str] = set()
    for name, t in named_tensors:
        if name in seen:
            raise ValueError(f"weight {name!r} appears twice")
        seen.add(name)
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > buffer_size:
            yield bucket
            bucket, size = [], 0
        if nbytes > buffer_size:
            logger.warning("weight %s (%d bytes) is larger than the sync buffer (%d bytes); sent alone",
                           name, nbytes, buffer_size)
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket


def serialize_bucket(bucket: list[tuple[str, Tensor]]) -> bytes:
    from safetensors.torch import save

    return save({name: t.detach().to("cpu").contiguous() for name, t in bucket})


def _post_all(engine_urls: list[str], data: bytes, params: dict, timeout: float, pool: ThreadPoolExecutor) -> None:
    from slime.engines.client import EngineError, post_bytes

    def one(url: str) -> None:
        resp = post_bytes(url, ENDPOINT, data, params=params, timeout=timeout)
        if not isinstance(resp, dict) or not resp.get("success", False):
            raise EngineError(f"POST {url}{ENDPOINT} did not succeed: {resp!r}", url=url, endpoint=ENDPOINT)

    for fut in [pool.submit(one, url) for url in engine_urls]:
        fut.result()


def sync_weights(
    named_weights: Iterable[tuple[str, Tensor]],
    engine_urls: list[str],
    weight_version: int | str,
    buffer_size: int,
    *,
    send: bool = True,
    timeout: float = DEFAULT_TIMEOUT,
) -> dict[str, float]:
    """Push weights to every engine in buckets; returns sizes and times.

    named_weights: (HF name, full tensor) pairs. Every rank must iterate them (the
        gathers are collective); only the rank with `send=True` talks to the engines.
    returns {"bytes": tensor bytes sent per engine, "payload_bytes": serialized bytes per
        engine, "buckets": n, "seconds": wall time, "num_engines": n} (zeros on non-senders
        except seconds).
    """
    t0 = time.perf_counter()
    if not send:
        for _ in named_weights:
            pass
        return {"bytes": 0, "payload_bytes": 0, "buckets": 0, "seconds": time.perf_counter() - t0,
                "num_engines": len(engine_urls)}

    tensor_bytes = payload_bytes = n_buckets = 0
    pending: bytes | None = None
    with ThreadPoolExecutor(max_workers=max(1, min(8, len(engine_urls)))) as pool:
        for bucket in iter_buckets(named_weights, buffer_size):
            data = serialize_bucket(bucket)
            tensor_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
            if pending is not None:
                _post_all(engine_urls, pending, {"weight_version": str(weight_version), "flush_cache": False},
                          timeout, pool)
            pending = data
            payload_bytes += len(data)
            n_buckets += 1
        if pending is not None:
            _post_all(engine_urls, pending, {"weight_version": str(weight_version), "flush_cache": True},
                      timeout, pool)
    return {"bytes": tensor_bytes, "payload_bytes": payload_bytes, "buckets": n_buckets,
            "seconds": time.perf_counter() - t0, "num_engines": len(engine_urls)}


# ---------------------------------------------------------------- trainer -> engines over a process group
DIST_INIT_ENDPOINT = "/init_weights_update_group"
DIST_ENDPOINT = "/update_weights_from_distributed"


class BroadcastGroup:
    """The trainer's end (rank 0) of a weight-broadcast group with `engine_urls` (ranks 1..N).

    Built with `init_broadcast_group`; reuse it for every update and `close()` it at the end.
    The group is a private TCPStore + process group (gloo on CPU, NCCL on GPU), independent
    of the trainer's own default process group.
    """

    def __init__(self, pg, engine_urls: list[str], group_name: str, backend: str, device):
        self.pg = pg
        self.engine_urls = list(engine_urls)
        self.group_name = group_name
        self.backend = backend
        self.device = device

    def close(self, timeout: float = 30.0) -> None:
        from slime.engines.client import EngineError, post_json
        from slime.engines.native.weight_group import destroy_group

        for url in self.engine_urls:
            try:
                post_json(url, "/destroy_weights_update_group", {"group_name": self.group_name}, timeout=timeout)
            except EngineError as e:
                logger.warning("could not destroy weight group on %s: %s", url, e)
        if self.pg is not None:
            destroy_group(self.pg)
        self.pg = None
        self.store = None


def init_broadcast_group(
    engine_urls: list[str],
    *,
    master_address: str = "127.0.0.1",
    master_port: int | None = None,
    group_name: str = "slime_weight_sync",
    backend: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    tp_size: int = 1,
) -> BroadcastGroup:
    """Create the broadcast group: POST /init_weights_update_group to every engine while this
    process joins as rank 0; engine i's tensor-parallel rank r joins as 1 + i * tp_size + r
    (SGLang adds its TP rank to the rank_offset it is given; the native engine has one rank).
    backend: gloo (CPU tensors) or nccl (CUDA tensors); default nccl when CUDA is available."""
    import torch

    from slime.engines.client import EngineError, post_json
    from slime.engines.native.weight_group import new_group

    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if master_port is None:
        from slime.engines.launcher import free_port

        master_port = free_port(master_address)
    world_size = 1 + len(engine_urls) * tp_size
    with ThreadPoolExecutor(max_workers=max(1, min(16, len(engine_urls)))) as pool:
        futs = [pool.submit(post_json, url, DIST_INIT_ENDPOINT, {
            "master_address": master_address, "master_port": master_port, "rank_offset": 1 + i * tp_size,
            "world_size": world_size, "group_name": group_name, "backend": backend}, timeout)
            for i, url in enumerate(engine_urls)]
        pg, store = new_group(master_address, master_port, 0, world_size, group_name, backend, timeout)
        for url, fut in zip(engine_urls, futs):
            resp = fut.result()
            if not resp.get("success", False):
                raise EngineError(f"POST {url}{DIST_INIT_ENDPOINT} did not succeed: {resp!r}", url=url,
                                  endpoint=DIST_INIT_ENDPOINT)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    group = BroadcastGroup(pg, engine_urls, group_name, backend, device)
    group.store = store
    return group


def broadcast_weights(
    named_weights: Iterable[tuple[str, Tensor]],
    engine_urls: list[str],
    weight_version: int | str,
    buffer_size: int = 512 << 20,
    *,
    group: BroadcastGroup | None = None,
    send: bool = True,
    timeout: float = DEFAULT_TIMEOUT,
    sessions: bool = False,
    **group_kwargs,
) -> dict[str, float]:
    """Push weights to every engine over a process group (SGLang's
    `/update_weights_from_distributed` protocol); returns sizes and times like `sync_weights`.
    `sessions`: wrap the push in SGLang's `/begin_weight_update` ... `/end_weight_update`
    (SGLang >= 0.5.23 refuses updates outside one; a server without them answers 404, fine).

    For each bucket (<= buffer_size tensor bytes) rank 0 POSTs the names/dtypes/shapes to
    every engine and broadcasts the tensors in that order; the engines receive them and copy
    them in place (the native engine and SGLang per bucket; vLLM when the last bucket, the one
    with `flush_cache: true`, has arrived). `group`: a `BroadcastGroup` from `init_broadcast_group` (made here, and
    closed at the end, when None; `group_kwargs` go to `init_broadcast_group`). Every rank
    must iterate `named_weights` (gathers are collective); only `send=True` talks to engines.
    """
    from slime.engines.client import EngineError, post_json

    t0 = time.perf_counter()
    if not send:
        for _ in named_weights:
            pass
        return {"bytes": 0, "buckets": 0, "seconds": time.perf_counter() - t0, "num_engines": len(engine_urls)}
    own = group is None
    if own:
        group = init_broadcast_group(engine_urls, timeout=timeout, **group_kwargs)
    tensor_bytes = n_buckets = 0
    if sessions:
        _session_call(engine_urls, "/begin_weight_update", timeout)
    try:
        buckets = iter_buckets(named_weights, buffer_size)
        bucket = next(buckets, None)
        with ThreadPoolExecutor(max_workers=max(1, min(16, len(engine_urls)))) as pool:
            while bucket is not None:
                following = next(buckets, None)  # flush_cache marks the last bucket (vLLM applies them then)
                tensors = [t.detach().to(group.device).contiguous() for _, t in bucket]
                payload = {
                    "names": [n for n, _ in bucket],
                    "dtypes": [str(t.dtype).replace("torch.", "") for t in tensors],
                    "shapes": [list(t.shape) for t in tensors],
                    "group_name": group.group_name,
                    "weight_version": str(weight_version),
                    "flush_cache": following is None,
                }
                futs = [pool.submit(post_json, url, DIST_ENDPOINT, payload, timeout) for url in engine_urls]
                works = [group.pg.broadcast(t, 0) for t in tensors]
                deadline = time.monotonic() + timeout
                while not all(w.is_completed() for w in works):
                    # an engine that refused the bucket never receives: fail fast instead of hanging
                    for fut in futs:
                        if fut.done() and fut.exception() is not None:
                            raise fut.exception()
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"weight broadcast did not complete within {timeout}s")
                    time.sleep(0.001)
                for w in works:
                    w.wait()
                for url, fut in zip(engine_urls, futs):
                    resp = fut.result()
                    if not resp.get("success", False):
                        raise EngineError(f"POST {url}{DIST_ENDPOINT} did not succeed: {resp!r}", url=url,
                                          endpoint=DIST_ENDPOINT)
                tensor_bytes += sum(t.numel() * t.element_size() for t in tensors)
                n_buckets += 1
                bucket = following
        if sessions:
            _session_call(engine_urls, "/end_weight_update", timeout)
    finally:
        if own:
            group.close()
    return {"bytes": tensor_bytes, "buckets": n_buckets, "seconds": time.perf_counter() - t0,
            "num_engines": len(engine_urls)}


def _session_call(engine_urls: list[str], path: str, timeout: float) -> None:
    """POST an SGLang weight-update session call to every engine; 404 means the server has none."""
    from slime.engines.client import EngineError, post_json

    for url in engine_urls:
        try:
            post_json(url, path, {}, timeout)
        except EngineError as e:
            if getattr(e, "status", None) != 404:
                raise


def check_engine_weights(named_weights, engine_urls: list[str], check: bool = True, timeout: float = 600.0) -> int:
    """`--check-weight-update-equal`: compare every engine's `/weights_checksum` with the digests
    of `named_weights` (full tensors, HF names). All ranks must iterate `named_weights` (it is a
    collective); only the rank with `check` talks to the engines. Returns the number of
    parameters compared per engine; raises RuntimeError naming the engine and the parameters
    that differ."""
    from slime.engines.client import get_json
    from slime.utils.weights import compare_digests, tensor_digest

    expected = {name: tensor_digest(t) for name, t in named_weights}
    if not check:
        return len(expected)
    for url in engine_urls:
        served = get_json(url, "/weights_checksum", timeout=timeout)["checksums"]
        differ = compare_digests(expected, served)
        if differ:
            raise RuntimeError(f"engine {url} serves weights that differ from the trainer's: {differ[:10]}"
                               f"{' ...' if len(differ) > 10 else ''} ({len(differ)} of {len(expected)})")
    return len(expected)

