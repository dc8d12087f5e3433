"""slime's `/generate` <-> vLLM's `/v1/completions`: pure translation functions (no I/O).

Request: one validated `GenerateInput` (see `protocol.parse_generate_request`) becomes one
completions body with a token-id prompt:

    input_ids -> prompt (list of ints; a text input is sent as a string and vLLM tokenizes)
    max_new_tokens -> max_tokens          temperature, top_p, seed -> same names
    top_k (-1 = off) -> top_k (omitted when off)
    stop, stop_token_ids, ignore_eos, skip_special_tokens -> same names
    no_stop_trim -> include_stop_str_in_output
    return_logprob -> logprobs = 0 (the sampled token's log-prob only)
    logprob_start_len, top_logprobs_num -> prompt_logprobs, logprobs = N (`logprobs.py`)
    rid -> request_id (vLLM runs it as "cmpl-<rid>-0"; see `vllm_request_id`)
    lora_name (`lora_path`) -> model (vLLM selects a LoRA adapter by name; else the served model)

plus `return_token_ids: true` so the response carries the generated token ids, and
`return_tokens_as_token_ids: true` so log-prob entries name tokens by id. `return_routed_experts` is
refused (400) unless off: vLLM does not return the experts each token was routed to
(`refuse_routed_experts`).

Response: choice 0 becomes slime's `{text, output_ids, meta_info}` through
`protocol.build_generate_response`; vLLM's `finish_reason` / `stop_reason` map to slime's
finish reasons: "length" -> {type: length, length: n}; "stop" with a stop string or stop
token id -> {type: stop, matched: it}; "stop" at EOS (stop_reason null) -> matched = the
last output token; "abort" -> {type: abort}.
"""

from __future__ import annotations

import json
import struct
from typing import Any

from slime.engines.protocol import (
    GenerateInput,
    logprob_meta,
    logprob_start,
    ProtocolError,
    build_generate_response,
    finish_abort,
    finish_length,
    finish_stop,
)
from slime.engines.protocol.logprobs import Decode
from slime.engines.vllm.logprobs import (
    LogprobsError,
    extra_logprob_meta,
    logprob_params,
    token_ids_mode,
    wants_prompt_logprobs,
)


class UpstreamError(RuntimeError):
    """vLLM answered something slime cannot use (a malformed or unexpected response)."""


def vllm_request_id(rid: str) -> str:
    """The id vLLM's completions server gives the (only) sequence of request `rid`."""
    return f"cmpl-{rid}-0"


def to_completion_request(inp: GenerateInput, model: str) -> dict:
    """The `/v1/completions` body for one slime generation input; `model`: the served model's name."""
    sp = inp.sampling_params
    body: dict[str, Any] = {
        "model": inp.lora_name or model,
        "prompt": list(inp.input_ids) if inp.input_ids is not None else inp.text,
        "max_tokens": sp.max_new_tokens,
        "temperature": sp.temperature,
        "top_p": sp.top_p,
        "stop": list(sp.stop),
        "stop_token_ids": list(sp.stop_token_ids),
        "ignore_eos": sp.ignore_eos,
        "skip_special_tokens": sp.skip_special_tokens,
        "include_stop_str_in_output": sp.no_stop_trim,
        "request_id": inp.rid,
        "return_token_ids": True,
        "n": 1,
        "stream": False,
    }
    if sp.top_k != -1:
        body["top_k"] = sp.top_k
    if sp.seed is not None:
        # vLLM's seed is a signed 64-bit integer; slime accepts [-2^63, 2^64)
        body["seed"] = sp.seed - 2**64 if sp.seed >= 2**63 else sp.seed
    body.update(logprob_params(inp))
    if body["max_tokens"] != sp.max_new_tokens:  # scoring: the one token vLLM makes is greedy
        body.pop("top_k", None)
    return body


def finish_reason_of(choice: dict, output_ids: list[int]) -> dict:
    reason = choice.get("finish_reason")
    stop_reason = choice.get("stop_reason")
    if reason == "length":
        return finish_length(len(output_ids))
    if reason == "stop":
        if stop_reason is None:  # EOS (or a model stop token): the last token is what matched
            return finish_stop(output_ids[-1] if output_ids else None)
        return finish_stop(stop_reason)
    if reason == "abort":
        return finish_abort()
    if reason == "repetition":
        return finish_stop(None)
    raise UpstreamError(f"vLLM finished a request with finish_reason {reason!r}")


def _token_id(entry: str) -> int | None:
    if isinstance(entry, str) and entry.startswith("token_id:"):
        try:
            return int(entry[len("token_id:"):])
        except ValueError:
            return None
    return None


def from_completion_response(inp: GenerateInput, resp: Any, weight_version: str, decode: Decode | None = None) -> dict:
    """slime's `/generate` response for `inp` from vLLM's completions response. `decode` (token ids ->
    each one's text) names log-prob tokens when vLLM was asked for ids and the request wants texts."""
    if not isinstance(resp, dict) or not isinstance(resp.get("choices"), list) or not resp["choices"]:
        raise UpstreamError(f"vLLM's completions response has no choices: {str(resp)[:300]}")
    choice = resp["choices"][0]
    output_ids = choice.get("token_ids")
    if not isinstance(output_ids, list):
        raise UpstreamError("vLLM's completions response has no token_ids (needs return_token_ids support)")
    output_ids = [int(t) for t in output_ids]
    usage = resp.get("usage") or {}
    prompt_tokens = usage.get("prompt_tokens")
    if prompt_tokens is None:
        prompt_tokens = len(inp.input_ids) if inp.input_ids is not None else 0
    scoring = inp.sampling_params.max_new_tokens == 0  # the token vLLM had to generate is not the answer's
    logprobs = texts = extra = None
    if inp.return_logprob and not scoring:
        lp = choice.get("logprobs") or {}
        logprobs = lp.get("token_logprobs")
        tokens = lp.get("tokens") or []
        if not isinstance(logprobs, list) or len(logprobs) != len(output_ids):
            raise UpstreamError(f"vLLM returned {len(logprobs or [])} log-probs for {len(output_ids)} tokens")
        if any(v is None for v in logprobs):
            raise UpstreamError("vLLM returned a null log-prob for a generated token")
        if inp.return_text_in_logprobs and not token_ids_mode(inp):
            texts = [str(t) for t in tokens] if len(tokens) == len(output_ids) else [None] * len(output_ids)
        else:
            ids = [_token_id(t) for t in tokens]
            if len(ids) == len(output_ids) and any(i is not None and i != o for i, o in zip(ids, output_ids)):
                raise UpstreamError("vLLM's log-prob tokens do not match its token_ids")
            if inp.return_text_in_logprobs:
                texts = decode(output_ids) if decode is not None and output_ids else [None] * len(output_ids)
    if scoring:
        output_ids, logprobs = [], []
    prompt_ids = inp.input_ids if inp.input_ids is not None else choice.get("prompt_token_ids")
    if inp.return_logprob and not isinstance(prompt_ids, list) and (wants_prompt_logprobs(inp) or inp.top_logprobs_num):
        raise UpstreamError("vLLM's completions response has no prompt_token_ids (needs return_token_ids)")
    if inp.return_logprob and isinstance(prompt_ids, list):
        try:
            extra = extra_logprob_meta(inp, choice, [int(t) for t in prompt_ids], len(output_ids), decode)
        except LogprobsError as e:
            raise UpstreamError(str(e)) from None
    return build_generate_response(
        rid=inp.rid,
        text="" if scoring else choice.get("text") or "",
        output_ids=output_ids,
        finish_reason=finish_length(0) if scoring else finish_reason_of(choice, output_ids),
        prompt_tokens=int(prompt_tokens),
        weight_version=weight_version,
        output_token_logprobs=logprobs,
        return_logprob=inp.return_logprob,
        logprob_token_texts=texts,
        extra_meta=extra,
    )


def empty_response(inp: GenerateInput, weight_version: str, decode: Decode | None = None) -> dict:
    """`max_new_tokens: 0` and no prompt log-prob to compute: nothing to ask vLLM (the native engine's
    answer). With return_logprob its `input_token_logprobs` are SGLang's for that case: none, or the
    first returned position only (a null log-prob)."""
    prompt_ids = list(inp.input_ids) if inp.input_ids is not None else []
    extra = None
    if inp.return_logprob:
        start = logprob_start(inp.logprob_start_len, len(prompt_ids), 0) if prompt_ids else 0
        n_in = len(prompt_ids) - start
        extra = logprob_meta(input_ids=prompt_ids, start=start, input_values=[None] * n_in,
                             input_top=[None] * n_in, output_top=[], top_logprobs_num=inp.top_logprobs_num,
                             decode=decode if inp.return_text_in_logprobs else None)
    return build_generate_response(
        rid=inp.rid, text="", output_ids=[], finish_reason=finish_length(0),
        prompt_tokens=len(prompt_ids),
        weight_version=weight_version, output_token_logprobs=[], return_logprob=inp.return_logprob,
        extra_meta=extra,
    )


def check_fits_context(inp: GenerateInput, max_model_len: int | None, name: str, max_new_name: str) -> None:
    """A prompt plus max_new_tokens must fit vLLM's --max-model-len (checked here to name the field)."""
    if max_model_len is None or inp.input_ids is None:
        return
    need = len(inp.input_ids) + inp.sampling_params.max_new_tokens
    if need > max_model_len:
        raise ProtocolError(
            max_new_name,
            f"prompt ({len(inp.input_ids)} tokens) + max_new_tokens ({inp.sampling_params.max_new_tokens}) "
            f"= {need} tokens exceeds vLLM's max model length ({max_model_len}; --vllm-max-model-len); "
            f"lower it to at most {max_model_len - len(inp.input_ids)}",
        )


def refuse_routed_experts(body: Any) -> Any:
    """`body` without its `return_routed_experts`, which is accepted only when off (false or null, or a
    list of them, as sglang-router re-serializes a request); ProtocolError when it asks for routing."""
    if not isinstance(body, dict):
        return body
    value = body.pop("return_routed_experts", None)
    if any(v is not None and v is not False for v in (value if isinstance(value, list) else [value])):
        raise ProtocolError("return_routed_experts", "is not supported by the vLLM engine (it does not return the "
                                                     "experts each token was routed to); use --rollout-backend "
                                                     "sglang or native for rollout routing replay")
    return body


_SLIME_FIELDS = {
    "prompt": "input_ids", "max_tokens": "sampling_params.max_new_tokens", "seed": "sampling_params.seed",
    "include_stop_str_in_output": "sampling_params.no_stop_trim", "request_id": "rid", "logprobs": "top_logprobs_num",
    "prompt_logprobs": "top_logprobs_num",
    **{k: f"sampling_params.{k}" for k in ("temperature", "top_p", "top_k", "stop", "stop_token_ids", "ignore_eos",
                                            "skip_special_tokens")},
}


def slime_field(vllm_param: str | None) -> str | None:
    """slime's name for a field of vLLM's completions request (as vLLM's errors name it)."""
    if not vllm_param:
        return None
    return _SLIME_FIELDS.get(vllm_param, vllm_param)


def upstream_error(status: int, text: str) -> tuple[int, str, str | None]:
    """(status, message, field) for a vLLM error response (OpenAI's or FastAPI's error shape)."""
    message, field = text[:2000], None
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            message = str(err.get("message") or err.get("detail") or message)
            field = slime_field(err.get("param"))
        elif isinstance(err, str):
            message = err
        if "detail" in body and not isinstance(body.get("error"), dict):
            message = json.dumps(body["detail"])[:2000]
    return status, f"vLLM: {message}", field


def safetensors_names(data: bytes) -> list[str]:
    """The tensor names of a safetensors payload (header only); ProtocolError('body') if it is not one."""
    if len(data) < 8:
        raise ProtocolError("body", "not a safetensors payload (shorter than its 8-byte header length)")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8 or n > 100 << 20:
        raise ProtocolError("body", f"not a safetensors payload (header length {n} exceeds the body)")
    try:
        header = json.loads(data[8:8 + n])
    except ValueError as e:
        raise ProtocolError("body", f"not a safetensors payload (header is not JSON: {e})") from None
    if not isinstance(header, dict):
        raise ProtocolError("body", "not a safetensors payload (header is not an object)")
    names = [k for k in header if k != "__metadata__"]
    if not names:
        raise ProtocolError("body", "the safetensors payload holds no tensors")
    return names
