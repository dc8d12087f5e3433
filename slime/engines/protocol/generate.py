"""`POST /generate` of the engine protocol: the request (`GenerateInput`, `parse_generate_request`,
`check_prompt`) and the response (`build_generate_response`, finish reasons)."""


from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np

from slime.engines.protocol.errors import ProtocolError, is_int
from slime.engines.protocol.logprobs import parse_logprob_options
from slime.engines.protocol.sampling import SamplingParams, parse_sampling_params

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"


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
    lora_name: str | None = None  # a loaded LoRA adapter (`lora_path` of the request); None: the base model
    logprob_start_len: int = -1  # with return_logprob: prompt log-probs from this position (-1: SGLang's default)
    top_logprobs_num: int = 0  # with return_logprob: the N most likely tokens per position (`logprobs.py`)
    image_data: list | None = None  # the prompt's images (paths, file:// or data: URLs, base64), in slot order


# Top-level keys of POST /generate. Keys after the first block are accepted only at
# their neutral value (they exist in SGLang; the native engine does not implement them).
_TOP_KEYS = {"input_ids", "text", "sampling_params", "return_logprob", "rid", "return_text_in_logprobs", "lora_path",
             "logprob_start_len", "top_logprobs_num", "image_data"}
_NEUTRAL_TOP_KEYS = {
    "stream": False,
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


MAX_JSON_DEPTH = 64  # arrays and objects inside each other; SGLang's and OpenAI's bodies need fewer than 10
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')


def json_depth(text: str) -> int:
    """How deep the arrays and objects of a well-formed JSON text nest (0 for a scalar)."""
    if text.count("[") + text.count("{") <= 1:
        return int("[" in text or "{" in text)
    bare = np.frombuffer(_JSON_STRING.sub("", text).encode("utf-8", "surrogatepass"), dtype=np.uint8)
    step = ((bare == ord("[")) | (bare == ord("{"))).astype(np.int64) - ((bare == ord("]")) | (bare == ord("}")))
    return int(np.cumsum(step).max(initial=0))


def parse_json_body(raw: bytes | str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Decode a JSON request body, raising ProtocolError('body', ...) when it is not UTF-8, not JSON,
    or nests arrays and objects deeper than `max_depth`."""
    if isinstance(raw, (bytes, bytearray, memoryview)):
        raw = bytes(raw)
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ProtocolError("body", f"is not valid UTF-8: byte 0x{raw[e.start]:02x} at offset {e.start} "
                                        f"({e.reason})") from None
    too_deep = ProtocolError("body", f"JSON nested deeper than {max_depth} levels of arrays and objects")
    try:
        value = json.loads(raw)
    except RecursionError:
        raise too_deep from None
    except ValueError as e:  # JSONDecodeError, or an integer of more digits than Python converts
        raise ProtocolError("body", f"malformed JSON: {e}") from None
    if raw.count("[") + raw.count("{") > max_depth and json_depth(raw) > max_depth:
        raise too_deep
    return value


def _check_ids(ids: Any, name: str, max_tokens: int | None = None) -> list[int]:
    if not isinstance(ids, list):
        raise ProtocolError(name, f"must be a list of token ids, got {type(ids).__name__}")
    if not ids:
        raise ProtocolError(name, "must not be empty")
    if max_tokens is not None:
        check_prompt_length(len(ids), max_tokens, name)
    for i, x in enumerate(ids):
        if not is_int(x) or x < 0:
            raise ProtocolError(f"{name}[{i}]", f"must be a non-negative integer token id, got {x!r}")
    return ids


def _image_list(v: Any, name: str) -> list | None:
    """One prompt's images: None, one image (a string) or a list of strings."""
    if v is None or v == []:
        return None
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(x, str) and x for x in items):
        raise ProtocolError(name, "must be an image (a path, file:// or data: URL, or base64 string) or a list of them")
    return list(items)


def _image_data(v: Any, n: int, is_batch: bool) -> list:
    """SGLang's `image_data`: for one prompt an image or a list of images; for a batch one entry per prompt."""
    if not is_batch or v is None:
        return [_image_list(v, "image_data")] * n
    if not isinstance(v, list) or len(v) != n:
        raise ProtocolError("image_data", "for a batch, image_data must be a list with one entry per prompt")
    return [_image_list(x, f"image_data[{i}]") for i, x in enumerate(v)]


def check_prompt_length(num_tokens: int, max_tokens: int, name: str) -> None:
    """A prompt of `num_tokens` tokens is refused when over the server's cap (--max-prompt-tokens)."""
    if num_tokens > max_tokens:
        raise ProtocolError(name, f"the prompt has {num_tokens} tokens, more than the {max_tokens} this server "
                                  "takes (--max-prompt-tokens, below the model's context length)")


def check_prompt_count(count: int, max_prompts: int, name: str) -> None:
    """A request with more prompts than the server takes at once (--max-prompts-per-request) is refused."""
    if count > max_prompts:
        raise ProtocolError(name, f"{count} prompts in one request, more than the {max_prompts} this server takes "
                                  "(--max-prompts-per-request)")


def parse_generate_request(body: Any, max_prompts: int | None = None,
                           max_prompt_tokens: int | None = None) -> tuple[list[GenerateInput], bool]:
    """Validate a decoded `/generate` body.

    Returns `(inputs, is_batch)`: SGLang's batch form (`input_ids` a list of lists or
    `text` a list of strings, with `sampling_params`/`rid` either shared or one per
    item) yields several inputs and a list response. A server's caps, when given, are checked
    before the prompts' items: a batch of more than `max_prompts` prompts, a token-id prompt
    longer than `max_prompt_tokens`.
    """
    if not isinstance(body, dict):
        raise ProtocolError("body", f"must be a JSON object, got {type(body).__name__}")
    for key, value in body.items():
        if key in _TOP_KEYS:
            continue
        if key in _NEUTRAL_TOP_KEYS:
            neutral = _NEUTRAL_TOP_KEYS[key]
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
            if max_prompts is not None:
                check_prompt_count(len(ids), max_prompts, "input_ids")
            prompts = [("ids", _check_ids(x, f"input_ids[{i}]", max_prompt_tokens)) for i, x in enumerate(ids)]
        else:
            prompts = [("ids", _check_ids(ids, "input_ids", max_prompt_tokens))]
    else:
        text = body["text"]
        is_batch = isinstance(text, list)
        if is_batch:
            if not text:
                raise ProtocolError("text", "must not be empty")
            if max_prompts is not None:
                check_prompt_count(len(text), max_prompts, "text")
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

    loras = _lora_names(body.get("lora_path"), n, is_batch)
    lp_options = parse_logprob_options(body, n, is_batch)
    images = _image_data(body.get("image_data"), n, is_batch)
    inputs = []
    for (kind, prompt), sp, rl, r, lora, (start, top), im in zip(prompts, sps, rls, rids, loras, lp_options, images):
        gi = GenerateInput(rid=r, sampling_params=sp, return_logprob=rl, return_text_in_logprobs=rtl, lora_name=lora,
                           logprob_start_len=start, top_logprobs_num=top, image_data=im)
        if kind == "ids":
            gi.input_ids = list(prompt)
        else:
            gi.text = prompt
        inputs.append(gi)
    return inputs, is_batch


def _lora_names(value: Any, n: int, is_batch: bool) -> list[str | None]:
    """`lora_path` (SGLang: the name of a loaded adapter, not a path) -> one adapter name or None per
    prompt: a string for every prompt, or for a batch a list with one entry per prompt (None: the
    base model)."""
    if value is None:
        return [None] * n
    if isinstance(value, str):
        if not value:
            raise ProtocolError("lora_path", "must be a non-empty adapter name")
        return [value] * n
    if isinstance(value, list):
        if len(value) != n or (not is_batch and n != 1):
            raise ProtocolError("lora_path", f"a list of adapter names needs one entry per prompt ({n}), "
                                             f"got {len(value)}")
        for i, v in enumerate(value):
            if v is not None and (not isinstance(v, str) or not v):
                raise ProtocolError(f"lora_path[{i}]", f"must be an adapter name or null, got {v!r}")
        return list(value)
    raise ProtocolError("lora_path", f"must be an adapter name, a list of them or null, got {type(value).__name__}")


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
