"""Bodies of the engine protocol's control endpoints (SGLang's shapes): `/abort_request`,
`/update_weights_from_disk`, `/init_weights_update_group`, `/update_weights_from_distributed`,
`/destroy_weights_update_group`, `/release_memory_occupation`, `/resume_memory_occupation`,
`/update_weight_version`, `/load_lora_adapter` and `/unload_lora_adapter`, plus weight versions
and boolean query parameters. Each parser returns what the handler needs
or raises `ProtocolError(field, message)`; `slime.engines.protocol` re-exports every public name here.
"""

from __future__ import annotations

from typing import Any

from slime.engines.protocol.errors import ProtocolError, is_int


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
    if not is_int(port) or not (1 <= port <= 65535):
        raise ProtocolError("master_port", f"must be an integer port in [1, 65535], got {port!r}")
    world = body.get("world_size")
    if not is_int(world) or world < 2:
        raise ProtocolError("world_size", f"must be an integer >= 2 (the trainer plus the engines), got {world!r}")
    rank = body.get("rank_offset")
    if not is_int(rank) or not (1 <= rank < world):
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
        if not isinstance(s, list) or not all(is_int(x) and x >= 0 for x in s):
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


def parse_update_weight_version(body: Any) -> tuple[str, bool]:
    """`/update_weight_version` (SGLang's UpdateWeightVersionReqInput) -> (new_version, abort_all_requests)."""
    body = _only_keys(body, {"new_version", "abort_all_requests"})
    if body.get("new_version") is None:
        raise ProtocolError("new_version", "is required (the weight version the engine reports from now on)")
    return parse_weight_version(body["new_version"], "new_version"), _opt_bool(body, "abort_all_requests", False)


def _lora_name(body: dict) -> str:
    name = body.get("lora_name")
    if not isinstance(name, str) or not name:
        raise ProtocolError("lora_name", f"must be a non-empty string (the adapter's name), got {name!r}")
    return name


def parse_load_lora_adapter(body: Any) -> tuple[str, str, bool]:
    """`/load_lora_adapter` (SGLang's LoadLoRAAdapterReqInput) -> (lora_name, lora_path, pinned).
    `pinned` is accepted and has no effect (the native engine never evicts an adapter)."""
    body = _only_keys(body, {"lora_name", "lora_path", "pinned"})
    name = _lora_name(body)
    path = body.get("lora_path")
    if not isinstance(path, str) or not path:
        raise ProtocolError("lora_path", f"must be a non-empty string (a peft adapter directory), got {path!r}")
    return name, path, _opt_bool(body, "pinned", False)


def parse_unload_lora_adapter(body: Any) -> str:
    """`/unload_lora_adapter` (SGLang's UnloadLoRAAdapterReqInput) -> lora_name."""
    return _lora_name(_only_keys(body, {"lora_name"}))
