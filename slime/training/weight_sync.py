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
