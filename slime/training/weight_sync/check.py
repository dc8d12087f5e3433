"""`--check-weight-update-equal`: every engine serves exactly the trainer's weights."""

from __future__ import annotations

from typing import Iterable

from torch import Tensor

from slime.engines.control import EngineControl
from slime.training.weight_sync.buckets import DEFAULT_TIMEOUT
from slime.utils.weights import compare_digests, tensor_digest


def check_engine_weights(named_weights: Iterable[tuple[str, Tensor]], engine_urls: list[str], check: bool = True,
                         timeout: float = DEFAULT_TIMEOUT) -> int:
    """Compare every engine's weight checksums (`EngineControl.weights_checksum`) with the digests
    of `named_weights` (full tensors, HF names). All ranks must iterate `named_weights` (it is a
    collective); only the rank with `check` talks to the engines. Returns the number of
    parameters compared per engine; raises RuntimeError naming the engine and the parameters
    that differ."""
    expected = {name: tensor_digest(t) for name, t in named_weights}
    if not check:
        return len(expected)
    for url in engine_urls:
        served = EngineControl(url, timeout=timeout).weights_checksum()
        differ = compare_digests(expected, served)
        if differ:
            raise RuntimeError(f"engine {url} serves weights that differ from the trainer's: {differ[:10]}"
                               f"{' ...' if len(differ) > 10 else ''} ({len(differ)} of {len(expected)})")
    return len(expected)
