"""The HTTP protocol slime speaks to inference engines: SGLang's native API.

Pure functions (no torch, no aiohttp): request validation and response building for
`POST /generate` and the control endpoints. The embedded native engine uses them on
the server side; rollout code builds payloads of this shape and can send them to a
real SGLang server, the native engine or a router in front of either.

`POST /generate` body::

    {"input_ids": [int, ...]  |  "text": str,
     "sampling_params": {temperature, top_p, top_k, max_new_tokens, stop,
                         stop_token_ids, ignore_eos, skip_special_tokens, seed,
                         no_stop_trim},
     "return_logprob": bool, "rid": str | None}

Response::

    {"text": str, "output_ids": [int, ...],
     "meta_info": {"id": rid,
                   "finish_reason": {"type": "stop" | "length" | "abort",
                                     "matched": int | str | None, ["length": n]},
                   "prompt_tokens": int, "completion_tokens": int,
                   ["output_token_logprobs": [[logprob, token_id, None], ...]],
                   "weight_version": str}}

Log-prob definition: log-prob of the sampled token under
`log_softmax(logits / T)` with `T = temperature if temperature > 0 else 1.0`,
computed in fp32 before any top-k / top-p truncation.

Validation errors raise `ProtocolError(field, message)`; servers answer them with
HTTP 400 and `error_body(err)`.
"""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass, field
from typing import Any

DEFAULT_MAX_NEW_TOKENS = 128

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"


class ProtocolError(ValueError):
    """A malformed request. `field` names the offending field (dotted path)."""

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}" if field else message)


def error_body(message: str | Exception, field: str | None = None) -> dict:
    """The JSON body of an error response (SGLang's shape, plus the field name)."""
    if isinstance(message, ProtocolError):
        field = message.field if field is None else field
        message = str(message)
    body: dict[str, Any] = {"message": str(message)}
    if field:
        body["param"] = field
    return {"error": body}


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


@dataclass
class GenerateInput:
    """One validated generation request. Exactly one of `input_ids` / `text` is set
    until the server tokenizes the text (then `input_ids` is filled in)."""

    rid: str
    sampling_params: SamplingParams
    input_ids: list[int] | None = None
    text: str | None = None
    return_logprob: bool = False
    return_text_in_logprobs: bool = False


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

# Top-level keys of POST /generate. Keys after the first block are accepted only at
# their neutral value (they exist in SGLang; the native engine does not implement them).
_TOP_KEYS = {"input_ids", "text", "sampling_params", "return_logprob", "rid", "return_text_in_logprobs"}
_NEUTRAL_TOP_KEYS = {
    "stream": False,
    "logprob_start_len": None,  # -1 / None / 0 accepted (see below)
    "top_logprobs_num": 0,
    "image_data": None,
    "lora_path": None,
    "custom_logit_processor": None,
    "return_hidden_states": False,
    "bootstrap_host": None,
    "bootstrap_port": None,
    "bootstrap_room": None,
    "data_parallel_rank": None,
    # sglang-router re-serializes /generate with these defaults of SGLang's GenerateReqInput
    "model": None,
    "log_metrics": True,
    "background": False,
    "no_logs": False,
    "return_bytes": False,
    "return_entropy": False,
}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


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
    if not _is_number(t) or t < 0:
        raise ProtocolError(prefix + "temperature", f"must be a finite number >= 0, got {t!r}")
    sp.temperature = float(t)

    p = raw.get("top_p", 1.0)
    if p is None:
        p = 1.0
    if not _is_number(p) or not (0.0 < p <= 1.0):
        raise ProtocolError(prefix + "top_p", f"must be a number in (0, 1], got {p!r}")
    sp.top_p = float(p)

    k = raw.get("top_k", -1)
    if k is None:
        k = -1
    if isinstance(k, float) and k.is_integer():
        k = int(k)
    if not _is_int(k) or (k != -1 and k < 1):
        raise ProtocolError(prefix + "top_k", f"must be -1 (off) or an integer >= 1, got {k!r}")
    sp.top_k = k

    m = raw.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    if m is None:
        m = DEFAULT_MAX_NEW_TOKENS
    if not _is_int(m) or m < 0:
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
    if not isinstance(sti, list) or not all(_is_int(x) and x >= 0 for x in sti):
        raise ProtocolError(prefix + "stop_token_ids", "must be a list of non-negative integers")
    sp.stop_token_ids = list(sti)

    sp.ignore_eos = _bool(raw, "ignore_eos", False, prefix)
    sp.skip_special_tokens = _bool(raw, "skip_special_tokens", True, prefix)
    sp.no_stop_trim = _bool(raw, "no_stop_trim", False, prefix)

    _bool(raw, "spaces_between_special_tokens", True, prefix)
    seed_key = "seed" if raw.get("seed") is not None or raw.get("sampling_seed") is None else "sampling_seed"
    seed = raw.get(seed_key)
    if seed is not None and not _is_int(seed):
        raise ProtocolError(prefix + seed_key, f"must be an integer or null, got {seed!r}")
    if seed is not None and not (-(2**63) <= seed < 2**64):
        raise ProtocolError(prefix + seed_key, "out of range for a 64-bit seed")
    sp.seed = seed
    return sp


def parse_json_body(raw: bytes | str) -> Any:
    """Decode a JSON request body, raising ProtocolError('body', ...) when malformed."""
    try:
        if isinstance(raw, bytes):
            raw = raw.decode("utf-8")
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError("body", f"malformed JSON: {e}") from None


def _check_ids(ids: Any, name: str) -> list[int]:
    if not isinstance(ids, list):
        raise ProtocolError(name, f"must be a list of token ids, got {type(ids).__name__}")
    if not ids:
        raise ProtocolError(name, "must not be empty")
    for i, x in enumerate(ids):
        if not _is_int(x) or x < 0:
            raise ProtocolError(f"{name}[{i}]", f"must be a non-negative integer token id, got {x!r}")
    return ids


def parse_generate_request(body: Any) -> tuple[list[GenerateInput], bool]:
    """Validate a decoded `/generate` body.

    Returns `(inputs, is_batch)`: SGLang's batch form (`input_ids` a list of lists or
    `text` a list of strings, with `sampling_params`/`rid` either shared or one per
    item) yields several inputs and a list response.
    """
    if not isinstance(body, dict):
        raise ProtocolError("body", f"must be a JSON object, got {type(body).__name__}")
    for key, value in body.items():
        if key in _TOP_KEYS:
            continue
        if key in _NEUTRAL_TOP_KEYS:
            neutral = _NEUTRAL_TOP_KEYS[key]
            if key == "logprob_start_len" and (value is None or (_is_int(value) and value in (-1, 0))):
                continue
            if value is None or value == neutral:
                continue
            raise ProtocolError(key, f"is not supported by this engine (only {neutral!r} is accepted)")
        raise ProtocolError(str(key), "unknown field")

    has_ids = body.get("input_ids") is not None
    has_text = body.get("text") is not None
    if has_ids and has_text:
        raise ProtocolError("input_ids", "give either input_ids or text, not both")
    if not has_ids and not has_text:
        raise ProtocolError("input_ids", "one of input_ids or text is required")

    if has_ids:
        ids = body["input_ids"]
        is_batch = isinstance(ids, list) and len(ids) > 0 and isinstance(ids[0], list)
        if is_batch:
            prompts = [("ids", _check_ids(x, f"input_ids[{i}]")) for i, x in enumerate(ids)]
        else:
            prompts = [("ids", _check_ids(ids, "input_ids"))]
    else:
        text = body["text"]
        is_batch = isinstance(text, list)
        if is_batch:
            if not text:
                raise ProtocolError("text", "must not be empty")
            for i, t in enumerate(text):
                if not isinstance(t, str) or not t:
                    raise ProtocolError(f"text[{i}]", "must be a non-empty string")
            prompts = [("text", t) for t in text]
        else:
            if not isinstance(text, str):
                raise ProtocolError("text", f"must be a string, got {type(text).__name__}")
            if not text:
                raise ProtocolError("text", "must not be empty")
            prompts = [("text", text)]

    n = len(prompts)
    sp_raw = body.get("sampling_params")
    if isinstance(sp_raw, list):
        if not is_batch or len(sp_raw) != n:
            raise ProtocolError("sampling_params", "a list of sampling_params needs a batch of the same length")
        sps = [parse_sampling_params(s, f"sampling_params[{i}].") for i, s in enumerate(sp_raw)]
    else:
        sps = [parse_sampling_params(sp_raw) for _ in range(n)]

    return_logprob = body.get("return_logprob", False)
    if return_logprob is None:
        return_logprob = False
    if isinstance(return_logprob, list) and is_batch and len(return_logprob) == n:
        rls = return_logprob
    else:
        rls = [return_logprob] * n
    for v in rls:
        if not isinstance(v, bool):
            raise ProtocolError("return_logprob", f"must be a boolean, got {v!r}")
    rtl = body.get("return_text_in_logprobs", False)
    if rtl is None:
        rtl = False
    if not isinstance(rtl, bool):
        raise ProtocolError("return_text_in_logprobs", f"must be a boolean, got {rtl!r}")

    rid = body.get("rid")
    if is_batch:
        if rid is None:
            rids = [uuid.uuid4().hex for _ in range(n)]
        elif isinstance(rid, list) and len(rid) == n and all(isinstance(r, str) and r for r in rid):
            rids = list(rid)
        else:
            raise ProtocolError("rid", "for a batch, rid must be a list of non-empty strings, one per item")
    else:
        if rid is None:
            rids = [uuid.uuid4().hex]
        elif isinstance(rid, str) and rid:
            rids = [rid]
        else:
            raise ProtocolError("rid", f"must be a non-empty string, got {rid!r}")

    inputs = []
    for (kind, prompt), sp, rl, r in zip(prompts, sps, rls, rids):
        gi = GenerateInput(rid=r, sampling_params=sp, return_logprob=rl, return_text_in_logprobs=rtl)
        if kind == "ids":
            gi.input_ids = list(prompt)
        else:
            gi.text = prompt
        inputs.append(gi)
    return inputs, is_batch


def check_prompt(input_ids: list[int], vocab_size: int, max_context_length: int, name: str = "input_ids") -> None:
    """Check token ids are in the vocabulary and the prompt fits the context."""
    if not input_ids:
        raise ProtocolError(name, "must not be empty (the prompt tokenized to nothing)")
    for i, x in enumerate(input_ids):
        if x >= vocab_size:
            raise ProtocolError(f"{name}[{i}]", f"token id {x} is out of the vocabulary (size {vocab_size})")
    if len(input_ids) >= max_context_length:
        raise ProtocolError(
            name,
            f"the prompt has {len(input_ids)} tokens, which does not fit the model's context length "
            f"({max_context_length} tokens)",
        )


def finish_stop(matched: int | str | None) -> dict:
    return {"type": FINISH_STOP, "matched": matched}


def finish_length(length: int) -> dict:
    return {"type": FINISH_LENGTH, "length": length, "matched": None}


def finish_abort(message: str | None = None) -> dict:
    d: dict[str, Any] = {"type": FINISH_ABORT, "matched": None}
    if message:
        d["message"] = message
    return d


def build_generate_response(
    *,
    rid: str,
    text: str,
    output_ids: list[int],
    finish_reason: dict,
    prompt_tokens: int,
    weight_version: str,
    output_token_logprobs: list[float] | None = None,
    return_logprob: bool = False,
    logprob_token_texts: list[str] | None = None,
    extra_meta: dict | None = None,
) -> dict:
    """The `/generate` response for one request."""
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": finish_reason,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(output_ids),
        "weight_version": weight_version,
    }
    if return_logprob:
        lps = output_token_logprobs or []
        if logprob_token_texts is not None:
            meta["output_token_logprobs"] = [
                [float(lp), int(t), s] for lp, t, s in zip(lps, output_ids, logprob_token_texts)
            ]
        else:
            meta["output_token_logprobs"] = [[float(lp), int(t), None] for lp, t in zip(lps, output_ids)]
    if extra_meta:
        meta.update(extra_meta)
    return {"text": text, "output_ids": list(output_ids), "meta_info": meta}


def parse_abort_request(body: Any) -> tuple[str | None, bool]:
    """`/abort_request` body -> (rid, abort_all)."""
    if not isinstance(body, dict):
        raise ProtocolError("body", "must be a JSON object")
    for key in body:
        if key not in ("rid", "abort_all", "abort_message"):
            raise ProtocolError(str(key), "unknown field")
    abort_all = body.get("abort_all", False)
    if not isinstance(abort_all, bool):
        raise ProtocolError("abort_all", "must be a boolean")
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise ProtocolError("rid", "must be a string")
    if not abort_all and not rid:
        raise ProtocolError("rid", "give a rid or abort_all: true")
    return rid, abort_all


def parse_weight_version(value: Any, name: str = "weight_version") -> str | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ProtocolError(name, "must be a string")
    value = str(value)
    if not value:
        raise ProtocolError(name, "must not be empty")
    return value


def parse_bool_param(value: str | None, name: str, default: bool) -> bool:
    """A boolean query-string parameter ('true'/'false'/'1'/'0')."""
    if value is None or value == "":
        return default
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ProtocolError(name, f"must be true or false, got {value!r}")


def parse_update_weights_from_disk(body: Any) -> tuple[str, str | None]:
    """`/update_weights_from_disk` body -> (model_path, weight_version)."""
    if not isinstance(body, dict):
        raise ProtocolError("body", "must be a JSON object")
    for key in body:
        if key not in ("model_path", "weight_version", "load_format", "flush_cache", "abort_all_requests"):
            raise ProtocolError(str(key), "unknown field")
    path = body.get("model_path")
    if not isinstance(path, str) or not path:
        raise ProtocolError("model_path", "must be a non-empty string (a Hugging Face model directory)")
    lf = body.get("load_format")
    if lf not in (None, "auto", "safetensors"):
        raise ProtocolError("load_format", "only 'auto' / 'safetensors' is supported")
    return path, parse_weight_version(body.get("weight_version"))


def _only_keys(body: Any, allowed: set[str]) -> dict:
    if not isinstance(body, dict):
        raise ProtocolError("body", f"must be a JSON object, got {type(body).__name__}")
    for key in body:
        if key not in allowed:
            raise ProtocolError(str(key), "unknown field")
    return body


def _opt_bool(body: dict, key: str, default: bool) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ProtocolError(key, f"must be a boolean, got {v!r}")
    return v


def _group_name(body: dict) -> str:
    g = body.get("group_name", "weight_update_group")
    if g is None:
        g = "weight_update_group"
    if not isinstance(g, str) or not g:
        raise ProtocolError("group_name", "must be a non-empty string")
    return g


WEIGHT_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")


def parse_init_weights_update_group(body: Any) -> dict:
    """`/init_weights_update_group` (SGLang's InitWeightsUpdateGroupReqInput) -> kwargs."""
    body = _only_keys(body, {"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"})
    addr = body.get("master_address")
    if not isinstance(addr, str) or not addr:
        raise ProtocolError("master_address", "must be a non-empty host name or IP address")
    port = body.get("master_port")
    if not _is_int(port) or not (1 <= port <= 65535):
        raise ProtocolError("master_port", f"must be an integer port in [1, 65535], got {port!r}")
    world = body.get("world_size")
    if not _is_int(world) or world < 2:
        raise ProtocolError("world_size", f"must be an integer >= 2 (the trainer plus the engines), got {world!r}")
    rank = body.get("rank_offset")
    if not _is_int(rank) or not (1 <= rank < world):
        raise ProtocolError("rank_offset", f"must be an integer in [1, world_size) (rank 0 is the trainer), got {rank!r}")
    backend = body.get("backend", "nccl")
    if backend is None:
        backend = "nccl"
    if backend not in ("gloo", "nccl"):
        raise ProtocolError("backend", f"must be 'gloo' or 'nccl', got {backend!r}")
    return {"master_address": addr, "master_port": port, "rank_offset": rank, "world_size": world,
            "group_name": _group_name(body), "backend": backend}


def parse_update_weights_from_distributed(body: Any) -> dict:
    """`/update_weights_from_distributed` (SGLang's UpdateWeightsFromDistributedReqInput) -> kwargs
    with `dtypes` normalized to names like 'bfloat16'."""
    body = _only_keys(body, {"names", "dtypes", "shapes", "group_name", "flush_cache", "abort_all_requests",
                             "weight_version", "load_format", "torch_empty_cache"})
    names = body.get("names")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names):
        raise ProtocolError("names", "must be a non-empty list of parameter names")
    if len(set(names)) != len(names):
        raise ProtocolError("names", "must not repeat a name")
    dtypes = body.get("dtypes")
    if not isinstance(dtypes, list) or len(dtypes) != len(names):
        raise ProtocolError("dtypes", "must be a list with one dtype per name")
    norm = []
    for i, d in enumerate(dtypes):
        d2 = d[len("torch."):] if isinstance(d, str) and d.startswith("torch.") else d
        if d2 not in WEIGHT_DTYPES:
            raise ProtocolError(f"dtypes[{i}]", f"must be one of {', '.join(WEIGHT_DTYPES)}, got {d!r}")
        norm.append(d2)
    shapes = body.get("shapes")
    if not isinstance(shapes, list) or len(shapes) != len(names):
        raise ProtocolError("shapes", "must be a list with one shape per name")
    for i, s in enumerate(shapes):
        if not isinstance(s, list) or not all(_is_int(x) and x >= 0 for x in s):
            raise ProtocolError(f"shapes[{i}]", f"must be a list of non-negative integers, got {s!r}")
    lf = body.get("load_format")
    if lf not in (None, "auto"):
        raise ProtocolError("load_format", "only 'auto' is supported")
    return {"names": list(names), "dtypes": norm, "shapes": [list(s) for s in shapes],
            "group_name": _group_name(body), "flush_cache": _opt_bool(body, "flush_cache", True),
            "abort_all_requests": _opt_bool(body, "abort_all_requests", False),
            "weight_version": parse_weight_version(body.get("weight_version"))}


def parse_destroy_weights_update_group(body: Any) -> str:
    return _group_name(_only_keys(body, {"group_name"}))


MEMORY_TAGS = ("kv_cache", "weights")


def parse_memory_tags(body: Any) -> list[str] | None:
    """`/release_memory_occupation` and `/resume_memory_occupation` body -> tags (None = all)."""
    body = _only_keys(body, {"tags"})
    tags = body.get("tags")
    if tags is None:
        return None
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise ProtocolError("tags", "must be a list of strings")
    for t in tags:
        if t not in MEMORY_TAGS:
            raise ProtocolError("tags", f"unknown tag {t!r}; known: {', '.join(MEMORY_TAGS)}")
    return list(dict.fromkeys(tags)) or None
