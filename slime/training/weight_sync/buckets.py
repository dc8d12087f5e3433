"""The one bucket loop every weight transport pushes through.

The named weights are grouped, in order, into buckets of at most `--update-weight-buffer-size`
bytes of tensor data (a tensor larger than the buffer travels alone). The sending rank hands each
bucket to its transport together with whether it is the last one (the bucket that carries
`flush_cache: true`, and the one after which vLLM applies what it received), so the loop looks one
bucket ahead. Ranks that send nothing still iterate the weights to the end: gathering a full
tensor from its shards is a collective over the train ranks.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

from torch import Tensor

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 600.0  # seconds per engine call of a push

Bucket = list[tuple[str, Tensor]]
# send(bucket, last) -> the bytes that went over the wire for it (0 when the transport does not count them)
SendBucket = Callable[[Bucket, bool], int]


@dataclass
class BucketCounts:
    """What one push sent: tensor bytes, serialized bytes (transports that serialize) and buckets."""

    bytes: int = 0
    payload_bytes: int = 0
    buckets: int = 0


def tensor_bytes(bucket: Bucket) -> int:
    return sum(t.numel() * t.element_size() for _, t in bucket)


def iter_buckets(named_tensors: Iterable[tuple[str, Tensor]], buffer_size: int) -> Iterator[Bucket]:
    """Group (name, tensor) pairs in order into lists whose tensor bytes sum to <= buffer_size
    (a tensor bigger than the buffer forms a bucket by itself). Names must be unique."""
    bucket: Bucket = []
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


def push_buckets(named_weights: Iterable[tuple[str, Tensor]], buffer_size: int,
                 send: SendBucket | None) -> BucketCounts:
    """Iterate `named_weights` to the end; on the sending rank (`send` given) call
    `send(bucket, last)` for every bucket in order, `last` True for the final one only.
    `send=None`: a rank that only takes part in the collective gathers (counts stay 0)."""
    counts = BucketCounts()
    if send is None:
        for _ in named_weights:
            pass
        return counts
    buckets = iter_buckets(named_weights, buffer_size)
    bucket = next(buckets, None)
    while bucket is not None:
        following = next(buckets, None)
        counts.payload_bytes += send(bucket, following is None)
        counts.bytes += tensor_bytes(bucket)
        counts.buckets += 1
        bucket = following
    return counts


def call_all(pool: ThreadPoolExecutor, calls: list[Callable[[], Any]]) -> list[Any]:
    """Run one call per engine concurrently; their results in order. The first failure (in order)
    is raised once every earlier call has finished."""
    return [fut.result() for fut in [pool.submit(call) for call in calls]]


def engine_pool(n_engines: int, most: int = 8) -> ThreadPoolExecutor:
    """Threads for calling `n_engines` engines at once (at most `most`)."""
    return ThreadPoolExecutor(max_workers=max(1, min(most, n_engines)))
