"""`--update-weights-mode tensor`: safetensors bytes in the body of `/update_weights_from_tensor`.

Rank 0 serializes each bucket with `safetensors.torch.save` and sends it to every engine
(`EngineControl.update_weights_from_tensor`, Content-Type application/octet-stream), with
`flush_cache` true on the last bucket only. The engine copies each tensor in place by its Hugging
Face name (tied weights are sent once, under the parameter's name). Works with any engine that
speaks the protocol, on any host; the default with --colocate for vLLM.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Iterable

from safetensors.torch import save
from torch import Tensor

from slime.engines.control import EngineControl
from slime.training.weight_sync.buckets import (
    DEFAULT_TIMEOUT, Bucket, call_all, engine_pool, push_buckets,
)


def serialize_bucket(bucket: Bucket) -> bytes:
    return save({name: t.detach().to("cpu").contiguous() for name, t in bucket})


class TensorTransport:
    """Rank 0 posts every bucket to every engine; the other ranks only iterate the weights."""

    def __init__(self, buffer_size: int, rank: int, *, timeout: float = DEFAULT_TIMEOUT):
        self.buffer_size = buffer_size
        self.rank = rank
        self.timeout = timeout
        self.engines: list[EngineControl] = []

    def connect(self, engine_urls: list[str]) -> None:
        self.engines = [EngineControl(url, timeout=self.timeout) for url in engine_urls]

    def push(self, named_weights: Iterable[tuple[str, Tensor]], weight_version) -> dict[str, float]:
        """Collective over the train ranks. Returns {"bytes": tensor bytes sent per engine,
        "payload_bytes": serialized bytes per engine, "buckets", "seconds", "num_engines"}
        (zero counts on the ranks that do not send)."""
        t0 = time.perf_counter()
        if self.rank != 0:
            counts = push_buckets(named_weights, self.buffer_size, None)
        else:
            with engine_pool(len(self.engines)) as pool:
                def send(bucket: Bucket, last: bool) -> int:
                    data = serialize_bucket(bucket)
                    call_all(pool, [partial(e.update_weights_from_tensor, data, weight_version, last)
                                    for e in self.engines])
                    return len(data)

                counts = push_buckets(named_weights, self.buffer_size, send)
        return {"bytes": counts.bytes, "payload_bytes": counts.payload_bytes, "buckets": counts.buckets,
                "seconds": time.perf_counter() - t0, "num_engines": len(self.engines)}

    def close(self) -> None:
        self.engines = []
