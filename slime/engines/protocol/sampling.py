"""`sampling_params` of `POST /generate`: `SamplingParams` and its validation.

SGLang's keys are accepted; the ones the native engine does not implement are accepted
only at their neutral value. `slime.engines.protocol` re-exports every public name here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from slime.engines.protocol.errors import ProtocolError, is_int, is_number

DEFAULT_MAX_NEW_TOKENS = 128


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    seed: int | None = None
    no_stop_trim: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def logprob_temperature(self) -> float:
        """The T of `log_softmax(logits / T)` used for sampling and reported log-probs."""
        return self.temperature if self.temperature > 0 else 1.0


# Keys SGLang accepts that the native engine supports only at their neutral value.
_NEUTRAL_SAMPLING_KEYS = {
    "min_new_tokens": 0,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "n": 1,
    "regex": None,
    "json_schema": None,
    "ebnf": None,
    "structural_tag": None,
    "custom_params": None,
    "logit_bias": None,
}

_SAMPLING_KEYS = {
    "temperature",
    "top_p",
    "top_k",
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "seed",
    "sampling_seed",  # newer SGLang's name for the per-request seed (alias of seed)
    "no_stop_trim",
    "spaces_between_special_tokens",  # accepted; a no-op for fast tokenizers
}


def _bool(d: dict, key: str, default: bool, prefix: str) -> bool:
    v = d.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ProtocolError(prefix + key, f"must be a boolean, got {type(v).__name__}")
    return v


def parse_sampling_params(raw: Any, prefix: str = "sampling_params.") -> SamplingParams:
    """Validate a `sampling_params` dict into `SamplingParams` (None -> defaults)."""
    name = prefix.rstrip(".")
    if raw is None:
        return SamplingParams()
    if not isinstance(raw, dict):
        raise ProtocolError(name, f"must be an object, got {type(raw).__name__}")
    for key, value in raw.items():
        if key in _SAMPLING_KEYS:
            continue
        if key in _NEUTRAL_SAMPLING_KEYS:
            if value is None or value == _NEUTRAL_SAMPLING_KEYS[key]:
                continue
            raise ProtocolError(
                prefix + key,
                f"is not supported by this engine (only {_NEUTRAL_SAMPLING_KEYS[key]!r} is accepted)",
            )
        raise ProtocolError(prefix + str(key), "unknown sampling parameter")
    sp = SamplingParams()

    t = raw.get("temperature", 1.0)
    if t is None:
        t = 1.0
    if not is_number(t) or t < 0:
        raise ProtocolError(prefix + "temperature", f"must be a finite number >= 0, got {t!r}")
    sp.temperature = float(t)

    p = raw.get("top_p", 1.0)
    if p is None:
        p = 1.0
    if not is_number(p) or not (0.0 < p <= 1.0):
        raise ProtocolError(prefix + "top_p", f"must be a number in (0, 1], got {p!r}")
    sp.top_p = float(p)

    k = raw.get("top_k", -1)
    if k is None:
        k = -1
    if isinstance(k, float) and k.is_integer():
        k = int(k)
    if not is_int(k) or (k != -1 and k < 1):
        raise ProtocolError(prefix + "top_k", f"must be -1 (off) or an integer >= 1, got {k!r}")
    sp.top_k = k

    m = raw.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    if m is None:
        m = DEFAULT_MAX_NEW_TOKENS
    if not is_int(m) or m < 0:
        raise ProtocolError(prefix + "max_new_tokens", f"must be an integer >= 0, got {m!r}")
    sp.max_new_tokens = m

    stop = raw.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise ProtocolError(prefix + "stop", "must be a string or a list of strings")
    if any(s == "" for s in stop):
        raise ProtocolError(prefix + "stop", "must not contain empty strings")
    sp.stop = list(stop)

    sti = raw.get("stop_token_ids")
    if sti is None:
        sti = []
    if not isinstance(sti, list) or not all(is_int(x) and x >= 0 for x in sti):
        raise ProtocolError(prefix + "stop_token_ids", "must be a list of non-negative integers")
    sp.stop_token_ids = list(sti)

    sp.ignore_eos = _bool(raw, "ignore_eos", False, prefix)
    sp.skip_special_tokens = _bool(raw, "skip_special_tokens", True, prefix)
    sp.no_stop_trim = _bool(raw, "no_stop_trim", False, prefix)

    _bool(raw, "spaces_between_special_tokens", True, prefix)
    seed_key = "seed" if raw.get("seed") is not None or raw.get("sampling_seed") is None else "sampling_seed"
    seed = raw.get(seed_key)
    if seed is not None and not is_int(seed):
        raise ProtocolError(prefix + seed_key, f"must be an integer or null, got {seed!r}")
    if seed is not None and not (-(2**63) <= seed < 2**64):
        raise ProtocolError(prefix + seed_key, "out of range for a 64-bit seed")
    sp.seed = seed
    return sp
