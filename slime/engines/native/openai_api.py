"""OpenAI-compatible `/v1/completions`, `/v1/chat/completions` and `/v1/models`.

Requests map onto the engine's sampling parameters (`max_tokens`, `temperature`, `top_p`,
`n`, `stop`, `seed`, plus vLLM/SGLang extensions `top_k`, `stop_token_ids`, `ignore_eos`,
`skip_special_tokens`, `min_tokens` = 0). The `n` samples of a prompt are admitted
together, so the prompt is prefilled once.

For training, every response carries (vLLM's `return_token_ids` layout, always on):
- completions: `choices[i].prompt_token_ids`, `choices[i].token_ids`
- chat: top-level `prompt_token_ids`, `choices[i].token_ids`
- `weight_version` at the top level,
and per-token log-probs in the OpenAI format when asked for (`logprobs: N` for completions,
`logprobs: true` for chat): the log-prob of each sampled token under
`log_softmax(logits / T)`, the same definition as `/generate`. Top alternatives are not
computed (`top_logprobs` must be 0).

`model` naming a loaded LoRA adapter generates with that adapter (vLLM's convention); any other
name is the base model. `/v1/models` lists the base model and the loaded adapters.

`stream: true` (and `stream_options: {"include_usage": true}`) answers with OpenAI's
chunks over Server-Sent Events, the same fields per chunk (`openai_stream.py`).

Parsing, tokenization and the chat template run on the server's prepare threads, off the event
loop; the server's caps apply (`limits.py`): prompts per request, tokens per prompt, and n x prompts
against the engine's queue (429). A chat template in the request (vLLM's `chat_template`, or
`chat_template_kwargs.chat_template`) is refused unless the server runs with
`--trust-request-templates`; `chat_template_kwargs` otherwise holds template variables only.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from aiohttp import web

from slime.engines.control import Route
from slime.engines.native import vision
from slime.engines.native.http import ENGINE_KEY, submit, tokenize
from slime.engines.native.limits import ADMISSION_KEY, Admission
from slime.engines.native.openai_stream import (
    _finish_reason,
    parse_stream_options,
    stream_chat,
    stream_completions,
)
from slime.engines.protocol import (
    GenerateInput,
    ProtocolError,
    SamplingParams,
    check_prompt,
    check_prompt_count,
    is_int,
    parse_sampling_params,
)
from slime.engines.serving import json_of, read_body

_COMMON = {
    "model", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "stream", "user",
    "presence_penalty", "frequency_penalty", "logit_bias", "best_of", "top_k", "stop_token_ids", "ignore_eos",
    "skip_special_tokens", "min_tokens", "return_token_ids", "rid", "spaces_between_special_tokens",
    "repetition_penalty", "stream_options",
}
_COMPLETION_KEYS = _COMMON | {"prompt", "logprobs", "echo", "suffix"}
_CHAT_KEYS = _COMMON | {"messages", "logprobs", "top_logprobs", "max_completion_tokens", "tools", "tool_choice",
                        "response_format", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
                        "parallel_tool_calls", "chat_template"}
_NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None, "best_of": 1, "min_tokens": 0,
            "echo": False, "suffix": None, "repetition_penalty": 1.0,
            "tools": None, "tool_choice": None, "parallel_tool_calls": None}
MAX_N = 128
# apply_chat_template's own arguments: never template variables in chat_template_kwargs
_TEMPLATE_CALL_ARGS = {"conversation", "tools", "documents", "add_generation_prompt", "continue_final_message",
                       "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
                       "return_assistant_tokens_mask", "tokenizer_kwargs"}


def _check_keys(body: Any, allowed: set[str]) -> dict:
    if not isinstance(body, dict):
        raise ProtocolError("body", f"must be a JSON object, got {type(body).__name__}")
    for key, value in body.items():
        if key not in allowed:
            raise ProtocolError(str(key), "unknown field")
        if key in _NEUTRAL and value is not None and value != _NEUTRAL[key] and not (
            key in ("tools", "tool_choice") and value in ([], "none")
        ):
            raise ProtocolError(key, f"is not supported by this engine (only {_NEUTRAL[key]!r} is accepted)")
    rf = body.get("response_format")
    if rf is not None and rf != {"type": "text"}:
        raise ProtocolError("response_format", "only {'type': 'text'} is supported")
    return body


def _sampling(body: dict, max_tokens_key: str, default_max: int | None) -> tuple[SamplingParams, int]:
    raw: dict[str, Any] = {}
    for k in ("temperature", "top_p", "top_k", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens", "seed"):
        if body.get(k) is not None:
            raw[k] = body[k]
    mt = body.get(max_tokens_key)
    if mt is None and max_tokens_key != "max_tokens":
        mt, max_tokens_key = body.get("max_tokens"), "max_tokens"
    if mt is not None:
        if not is_int(mt) or mt < 0:
            raise ProtocolError(max_tokens_key, f"must be an integer >= 0, got {mt!r}")
        raw["max_new_tokens"] = mt
    sp = parse_sampling_params(raw, prefix="")
    if mt is None:
        sp.max_new_tokens = -1 if default_max is None else default_max  # -1: fill the context (set per prompt)
    n = body.get("n", 1)
    if n is None:
        n = 1
    if not is_int(n) or not (1 <= n <= MAX_N):
        raise ProtocolError("n", f"must be an integer in [1, {MAX_N}], got {n!r}")
    for k in ("return_token_ids", "echo"):
        v = body.get(k)
        if v is not None and not isinstance(v, bool):
            raise ProtocolError(k, f"must be a boolean, got {v!r}")
    return sp, n


def _prompt_list(prompt: Any, tokenizer, adm: Admission) -> list[tuple[str, list[int]]]:
    """OpenAI `prompt`: a string, a list of strings, a list of token ids or a list of lists (within the
    server's caps: prompts per request, tokens per prompt)."""
    if isinstance(prompt, str):
        items: list = [prompt]
    elif isinstance(prompt, list) and prompt and all(is_int(x) for x in prompt):
        items = [prompt]
    elif isinstance(prompt, list) and prompt:
        items = prompt
    else:
        raise ProtocolError("prompt", "must be a non-empty string, list of strings, or list of token ids")
    check_prompt_count(len(items), adm.max_prompts, "prompt")
    out = []
    for i, p in enumerate(items):
        name = "prompt" if len(items) == 1 else f"prompt[{i}]"
        if isinstance(p, list):
            adm.check_prompt_tokens(len(p), name)
        if isinstance(p, str):
            if not p:
                raise ProtocolError(name, "must not be empty")
            ids = tokenize(tokenizer, p, name)
            adm.check_prompt_tokens(len(ids), name)
            out.append((name, ids))
        elif isinstance(p, list) and p and all(is_int(x) and x >= 0 for x in p):
            out.append((name, list(p)))
        else:
            raise ProtocolError(name, "must be a non-empty string or a non-empty list of non-negative token ids")
    return out


def _template_kwargs(body: dict, adm: Admission) -> dict:
    """The extra arguments of the chat template call: template variables, and the request's own
    template only when the server trusts request templates."""
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise ProtocolError("chat_template_kwargs", "must be an object")
    kwargs = dict(kwargs)
    for key in kwargs:
        if key == "chat_template":
            adm.check_template("chat_template_kwargs.chat_template")
        elif key in _TEMPLATE_CALL_ARGS:
            raise ProtocolError(f"chat_template_kwargs.{key}", "is an argument of the template call, not a template "
                                                               "variable")
    if body.get("chat_template") is not None:
        adm.check_template("chat_template")
        kwargs["chat_template"] = body["chat_template"]
    if "chat_template" in kwargs and not isinstance(kwargs["chat_template"], str):
        raise ProtocolError("chat_template", "must be a string (a Jinja template)")
    return kwargs


def _image_url(part: dict, name: str) -> str:
    """The URL of an OpenAI `image_url` part (a file path, file:// or data: URL, or base64)."""
    url = part.get("image_url")
    url = url.get("url") if isinstance(url, dict) else url
    if not isinstance(url, str) or not url:
        raise ProtocolError(name, 'must be {"url": "data:image/...;base64,..."} (or a file path / file:// URL)')
    return url


def _messages_to_ids(body: dict, tokenizer, adm: Admission, engine=None) -> tuple[list[int], list | None]:
    """(prompt ids, the images of `image_url` parts prepared for the engine (vision.py), or None)."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ProtocolError("messages", "must be a non-empty list of {role, content} objects")
    clean, images = [], []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise ProtocolError(f"messages[{i}]", "must be an object with role and content")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            raise ProtocolError(f"messages[{i}].role", "must be a non-empty string")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, {"type": "image_url", ...}, ...]
            parts, typed = [], []
            for j, part in enumerate(content):
                if isinstance(part, dict) and part.get("type") == "image_url":
                    images.append(_image_url(part, f"messages[{i}].content[{j}].image_url"))
                    typed.append({"type": "image"})
                    continue
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise ProtocolError(f"messages[{i}].content[{j}]", "only text and image_url parts are supported")
                parts.append(part["text"])
                typed.append({"type": "text", "text": part["text"]})
            content = typed if len(typed) > len(parts) else "".join(parts)
        if content is None and role == "assistant":
            content = ""
        if not isinstance(content, (str, list)):
            raise ProtocolError(f"messages[{i}].content", "must be a string or a list of text parts")
        clean.append({**{k: v for k, v in m.items() if k not in ("content",)}, "content": content})
    kwargs = _template_kwargs(body, adm)
    cont = bool(body.get("continue_final_message", False))
    agp = body.get("add_generation_prompt", not cont)
    if getattr(tokenizer, "chat_template", None) is None and "chat_template" not in kwargs:
        raise ProtocolError("messages", "the model's tokenizer has no chat template; use /v1/completions")
    try:
        ids = tokenizer.apply_chat_template(clean, tokenize=not images, add_generation_prompt=bool(agp),
                                            continue_final_message=cont, return_dict=False, **kwargs)
    except Exception as e:  # noqa: BLE001 - a template error is the request's fault
        raise ProtocolError("messages", f"chat template failed: {type(e).__name__}: {e}") from None
    prepared = None
    if images:  # the rendered text's image slots expanded to the images' tokens (vision.py)
        gi = GenerateInput(rid="", sampling_params=SamplingParams(), text=ids, image_data=images)
        vision.prepare(engine, gi, "messages")
        ids, prepared = tokenizer(gi.text, add_special_tokens=False)["input_ids"], gi.image_data
    if isinstance(ids, dict):
        ids = ids["input_ids"]
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    adm.check_prompt_tokens(len(ids), "messages")
    return list(ids), prepared


def _inputs(engine, prompts: list[tuple[str, list[int]]], sp: SamplingParams, n: int,
            max_tokens_key: str, lora_name: str | None = None, images: list | None = None) -> list[GenerateInput]:
    """Validate; the n samples of every prompt as engine inputs (prompt-major)."""
    inputs = []
    for name, ids in prompts:
        check_prompt(ids, engine.vocab_size, engine.max_context_length, name=name)
        psp = sp
        if sp.max_new_tokens < 0:  # no max_tokens: as much as the context and the KV budget allow
            psp = SamplingParams(**{**sp.__dict__, "max_new_tokens": max(
                1, min(engine.max_context_length, engine.max_total_tokens) - len(ids))})
        engine.check_fits(ids, psp, name=name, max_new_name=max_tokens_key)
        for i in range(n):
            s = psp
            if n > 1 and psp.seed is not None:
                s = SamplingParams(**{**psp.__dict__, "seed": psp.seed + i})
            inputs.append(GenerateInput(rid=uuid.uuid4().hex, sampling_params=s, input_ids=ids, return_logprob=True,
                                        lora_name=lora_name, image_data=images))
    return inputs


async def _run(engine, inputs: list[GenerateInput], num_prompts: int, n: int):
    """Run the inputs; results grouped [prompt][sample]."""
    futs = [submit(engine, inp) for inp in inputs]
    try:
        results = await asyncio.gather(*futs)
    except asyncio.CancelledError:
        for inp in inputs:
            engine.abort(inp.rid)
        raise
    return [results[k * n:(k + 1) * n] for k in range(num_prompts)]


def _usage(prompts, grouped) -> dict:
    pt = sum(len(ids) for _, ids in prompts)
    ct = sum(len(r.output_ids) for g in grouped for r in g)
    return {"prompt_tokens": pt, "completion_tokens": ct, "total_tokens": pt + ct}


def _model_name(engine, body: dict) -> str:
    m = body.get("model")
    if m is not None and not isinstance(m, str):
        raise ProtocolError("model", "must be a string")
    return m or engine.model_path


def _lora_of(engine, model: str) -> str | None:
    """The loaded LoRA adapter `model` names, else None (the base model)."""
    return model if model in engine.lora_adapters() else None


def _prepare_completions(engine, adm: Admission, raw: bytes):
    """Parse, validate and tokenize a `/v1/completions` body (on a prepare thread)."""
    body = _check_keys(json_of(raw), _COMPLETION_KEYS)
    stream, include_usage = parse_stream_options(body)
    if "prompt" not in body:
        raise ProtocolError("prompt", "is required")
    sp, n = _sampling(body, "max_tokens", 16)
    lp = body.get("logprobs")
    if lp is not None and (not is_int(lp) or not (0 <= lp <= 1)):
        raise ProtocolError("logprobs", f"must be 0 or 1 (the sampled token's log-prob; top alternatives are not "
                                        f"computed), got {lp!r}")
    model = _model_name(engine, body)
    prompts = _prompt_list(body["prompt"], engine.tokenizer, adm)
    inputs = _inputs(engine, prompts, sp, n, "max_tokens", _lora_of(engine, model))
    return stream, include_usage, lp, model, prompts, n, inputs


async def completions(request: web.Request) -> web.Response:
    engine, adm = request.app[ENGINE_KEY], request.app[ADMISSION_KEY]
    raw = await read_body(request)
    stream, include_usage, lp, model, prompts, n, inputs = await adm.prepare(_prepare_completions, engine, adm, raw)
    adm.check_queue(engine, len(inputs), "n")  # no await from here to the submits: the check holds
    if stream:
        return await stream_completions(request, engine, inputs, n, model, lp, include_usage)
    grouped = await _run(engine, inputs, len(prompts), n)
    choices = []
    for (_, ids), group in zip(prompts, grouped):
        for r in group:
            c: dict[str, Any] = {"index": len(choices), "text": r.text, "finish_reason": _finish_reason(r.finish_reason),
                                 "matched_stop": r.finish_reason.get("matched"), "logprobs": None,
                                 "prompt_token_ids": list(ids), "token_ids": list(r.output_ids)}
            if lp is not None:
                toks = engine.token_texts(r.output_ids)
                offsets, pos = [], len(engine.tokenizer.decode(ids))
                for t in toks:
                    offsets.append(pos)
                    pos += len(t)
                c["logprobs"] = {"tokens": toks, "token_logprobs": [float(x) for x in r.output_token_logprobs],
                                 "top_logprobs": None, "text_offset": offsets}
            choices.append(c)
    return web.json_response({
        "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": choices, "usage": _usage(prompts, grouped), "weight_version": grouped[0][0].weight_version,
    })


def _prepare_chat(engine, adm: Admission, raw: bytes):
    """Parse, validate and render a `/v1/chat/completions` body (on a prepare thread)."""
    body = _check_keys(json_of(raw), _CHAT_KEYS)
    stream, include_usage = parse_stream_options(body)
    sp, n = _sampling(body, "max_completion_tokens", None)
    lp = body.get("logprobs", False)
    if lp is None:
        lp = False
    if not isinstance(lp, bool):
        raise ProtocolError("logprobs", f"must be a boolean, got {lp!r}")
    tl = body.get("top_logprobs")
    if tl not in (None, 0):
        raise ProtocolError("top_logprobs", "only 0 is supported (top alternatives are not computed)")
    model = _model_name(engine, body)
    ids, images = _messages_to_ids(body, engine.tokenizer, adm, engine)
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    prompts = [("messages", ids)]
    inputs = _inputs(engine, prompts, sp, n, key, _lora_of(engine, model), images)
    return stream, include_usage, lp, model, ids, prompts, n, inputs


async def chat_completions(request: web.Request) -> web.Response:
    engine, adm = request.app[ENGINE_KEY], request.app[ADMISSION_KEY]
    raw = await read_body(request)
    stream, include_usage, lp, model, ids, prompts, n, inputs = await adm.prepare(_prepare_chat, engine, adm, raw)
    adm.check_queue(engine, len(inputs), "n")
    if stream:
        return await stream_chat(request, engine, inputs, model, lp, include_usage)
    grouped = await _run(engine, inputs, 1, n)
    choices = []
    for r in grouped[0]:
        c: dict[str, Any] = {
            "index": len(choices), "message": {"role": "assistant", "content": r.text, "tool_calls": None},
            "finish_reason": _finish_reason(r.finish_reason), "matched_stop": r.finish_reason.get("matched"),
            "logprobs": None, "token_ids": list(r.output_ids),
        }
        if lp:
            toks = engine.token_texts(r.output_ids)
            c["logprobs"] = {"content": [
                {"token": t, "logprob": float(x), "bytes": list(t.encode("utf-8")), "top_logprobs": []}
                for t, x in zip(toks, r.output_token_logprobs)
            ]}
        choices.append(c)
    return web.json_response({
        "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
        "model": model, "choices": choices, "usage": _usage(prompts, grouped), "prompt_token_ids": list(ids),
        "weight_version": grouped[0][0].weight_version,
    })


async def models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    base = {"id": engine.model_path, "object": "model", "created": 0, "owned_by": "slime",
            "root": engine.model_path, "max_model_len": engine.max_context_length}
    adapters = [{**base, "id": name, "root": path, "parent": engine.model_path}
                for name, path in engine.lora_adapters().items()]
    return web.json_response({"object": "list", "data": [base, *adapters]})


OPENAI_HANDLERS = {
    Route.OPENAI_COMPLETIONS: completions,
    Route.OPENAI_CHAT_COMPLETIONS: chat_completions,
    Route.OPENAI_MODELS: models,
}
