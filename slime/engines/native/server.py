"""aiohttp server exposing a `NativeEngine` over SGLang's native HTTP protocol.

The event loop only reads bodies (within each route's cap) and waits: parsing, validation and
tokenization run on the server's prepare threads, compute in the engine's worker thread, weight-group
rendezvous and receives on threads of their own (`limits.py`), the other weight and memory routes on
the default executor; so `/health` answers while a batch is generating or a request is being
tokenized. `"stream": true` answers with Server-Sent Events (`streaming.py`).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time

import torch
from aiohttp import web
from safetensors.torch import load

from slime.engines.auth import ACCESS_KEY, Access, check_request, guard
from slime.engines.control import Route
from slime.engines.native.engine import NativeEngine
from slime.engines.native.http import (
    ENGINE_KEY,
    INCREMENTAL_STREAM_KEY,
    submit,
    tokenize,
)
from slime.engines.native.limits import ADMISSION_KEY, Admission, ServerLimits
from slime.engines.native.openai_api import OPENAI_HANDLERS
from slime.engines.native.requests import GenerationResult
from slime.engines.native.routing import FIELD as ROUTED_EXPERTS, pop_routed_experts, routed_experts_flags
from slime.engines.native.streaming import pop_stream_flag, stream_generate
from slime.engines.native import vision
from slime.engines.native.weights import safetensors_header
from slime.engines.protocol import (
    GenerateInput,
    ProtocolError,
    SamplingParams,
    build_generate_response,
    check_logprob_start,
    check_prompt,
    error_body,
    logprob_meta,
    parse_abort_request,
    parse_bool_param,
    parse_destroy_weights_update_group,
    parse_generate_request,
    parse_init_weights_update_group,
    parse_load_lora_adapter,
    parse_memory_tags,
    parse_unload_lora_adapter,
    parse_update_weight_version,
    parse_update_weights_from_disk,
    parse_update_weights_from_distributed,
    parse_weight_version,
)
from slime.engines.serving import (
    add_routes,
    body_limits,
    json_of,
    read_body,
    read_json,
    refusal,
)
from slime.utils.moe_routing import encode as encode_routing

logger = logging.getLogger(__name__)

@web.middleware
async def _errors(request: web.Request, handler):
    try:
        return await handler(request)
    except ProtocolError as e:
        return refusal(e)
    except web.HTTPException as e:
        if e.status >= 400:
            return refusal(ProtocolError("", f"{e.reason}: {request.method} {request.path}", status=e.status))
        raise
    except asyncio.CancelledError:
        raise
    except Exception as e:  # a bad request must never take the server down
        logger.exception("error serving %s", request.path)
        return web.json_response(error_body(f"{type(e).__name__}: {e}"), status=500)


def _engine_url(request: web.Request) -> str | None:
    """This server's URL as the request reached it (the local end of its connection)."""
    sock = request.transport.get_extra_info("sockname") if request.transport is not None else None
    if not sock:
        return None
    host = f"[{sock[0]}]" if ":" in str(sock[0]) else sock[0]
    return f"http://{host}:{sock[1]}"


def _timing(res: GenerationResult, engine_url: str | None) -> dict:
    """meta_info's timing (seconds) and the serving engine: the rollout timeline's spans
    (slime.observability.spans); a value the request never reached is left out."""
    out = {k: getattr(res, k) for k in ("queue_time", "prefill_time", "e2e_latency") if getattr(res, k) is not None}
    return {**out, "engine_url": engine_url} if engine_url else out


def _response(engine: NativeEngine, inp, res: GenerationResult, engine_url: str | None = None) -> dict:
    texts = engine.token_texts(res.output_ids) if (inp.return_logprob and inp.return_text_in_logprobs) else None
    extra = _timing(res, engine_url)
    if inp.return_logprob and res.logprob_start is not None:
        extra |= logprob_meta(input_ids=inp.input_ids, start=res.logprob_start, input_values=res.input_token_logprobs,
                              input_top=res.input_top_logprobs, output_top=res.output_top_logprobs,
                              top_logprobs_num=inp.top_logprobs_num,
                              decode=engine.token_texts if inp.return_text_in_logprobs else None)
    if res.routed_experts is not None:  # SGLang's shape: base64 of int32 [prompt + output - 1, layers, top-k]
        extra = {**extra, "routed_experts": base64.b64encode(encode_routing(res.routed_experts)).decode(),
                 "routed_experts_start_len": 0}
    return build_generate_response(
        rid=res.rid,
        text=res.text,
        output_ids=res.output_ids,
        finish_reason=res.finish_reason,
        prompt_tokens=res.prompt_tokens,
        weight_version=res.weight_version,
        output_token_logprobs=res.output_token_logprobs,
        return_logprob=inp.return_logprob,
        logprob_token_texts=texts,
        extra_meta=extra,
    )


def _prepare_generate(engine: NativeEngine, adm: Admission, raw: bytes):
    """Parse, validate and tokenize a `/generate` body (on a prepare thread)."""
    body = json_of(raw)
    stream = pop_stream_flag(body)
    routed = pop_routed_experts(body)
    inputs, is_batch = parse_generate_request(body, max_prompts=adm.max_prompts,
                                              max_prompt_tokens=adm.max_prompt_tokens)
    routed = routed_experts_flags(routed, len(inputs), is_batch)
    if any(routed):
        engine.routing.check(ROUTED_EXPERTS)
        if stream:
            raise ProtocolError(ROUTED_EXPERTS, "is not returned on a streamed request; send it without stream")
    field = "input_ids" if inputs[0].text is None else "text"
    for k, inp in enumerate(inputs):
        name = f"{field}[{k}]" if is_batch else field
        vision.prepare(engine, inp, f"image_data[{k}]" if is_batch else "image_data")  # images: decoded here
        if inp.text is not None:
            inp.input_ids = tokenize(engine.tokenizer, inp.text, name)
        adm.check_prompt_tokens(len(inp.input_ids), name)
        check_prompt(inp.input_ids, engine.vocab_size, engine.max_context_length, name=name)
        check_logprob_start(inp, len(inp.input_ids), f"logprob_start_len[{k}]" if is_batch else "logprob_start_len")
        if stream and inp.return_logprob and (inp.top_logprobs_num or inp.logprob_start_len >= 0):
            raise ProtocolError("stream", "a streamed request returns output_token_logprobs only; send it without "
                                          "stream for logprob_start_len >= 0 or top_logprobs_num > 0")
        sp_name = f"sampling_params[{k}]." if is_batch else "sampling_params."
        engine.check_fits(inp.input_ids, inp.sampling_params, name=name, max_new_name=sp_name + "max_new_tokens")
        engine.check_lora(inp.lora_name)
    return stream, inputs, is_batch, field, routed


async def generate(request: web.Request) -> web.Response:
    engine, adm = request.app[ENGINE_KEY], request.app[ADMISSION_KEY]
    raw = await read_body(request)
    stream, inputs, is_batch, field, routed = await adm.prepare(_prepare_generate, engine, adm, raw)
    adm.check_queue(engine, len(inputs), field)  # no await from here to the submits: the check holds
    if stream:
        return await stream_generate(request, engine, inputs, is_batch, request.app[INCREMENTAL_STREAM_KEY])
    futs = [submit(engine, inp, r) for inp, r in zip(inputs, routed)]
    try:
        results = await asyncio.gather(*futs)
    except asyncio.CancelledError:  # client went away: free the engine's rows
        for inp in inputs:
            engine.abort(inp.rid)
        raise
    url = _engine_url(request)
    out = [_response(engine, inp, res, url) for inp, res in zip(inputs, results)]
    return web.json_response(out if is_batch else out[0])


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok", "weight_version": request.app[ENGINE_KEY].weight_version})


async def health_generate(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    tok = engine.tokenizer.bos_token_id
    if tok is None or not (0 <= tok < engine.vocab_size):
        tok = 0
    inp = GenerateInput(
        rid=f"health-{time.monotonic_ns()}",
        sampling_params=SamplingParams(temperature=0.0, max_new_tokens=1),
        input_ids=[tok],
    )
    try:
        await asyncio.wait_for(submit(engine, inp), timeout=120)
    except TimeoutError:
        engine.abort(inp.rid)
        return web.json_response(error_body("health generation timed out"), status=503)
    return web.json_response({"status": "ok"})


async def get_model_info(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    return web.json_response(
        {
            "model_path": engine.model_path,
            "tokenizer_path": engine.tokenizer_path,
            "is_generation": True,
            "max_context_length": engine.max_context_length,
            "vocab_size": engine.vocab_size,
            "weight_version": engine.weight_version,
            "lora_adapters": engine.lora_adapters(),
        }
    )


async def get_server_info(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    info = engine.stats()
    info.update(
        {
            "engine": "slime-native",
            "model_path": engine.model_path,
            "tokenizer_path": engine.tokenizer_path,
            "dtype": str(engine.dtype).replace("torch.", ""),
            "device": str(engine.device),
            "max_context_length": engine.max_context_length,
            "max_prefill_tokens": engine.max_prefill_tokens,
            "weight_update_groups": sorted(engine._groups),
            "weight_group_operations_waiting": request.app[ADMISSION_KEY].groups.pending(),
            "random_seed": engine.random_seed,
        }
    )
    return web.json_response(info)


async def get_weight_version(request: web.Request) -> web.Response:
    return web.json_response({"weight_version": request.app[ENGINE_KEY].weight_version})


async def weights_checksum(request: web.Request) -> web.Response:
    """slime-native: sha256 of every parameter, for --check-weight-update-equal."""
    engine = request.app[ENGINE_KEY]
    checksums = await asyncio.to_thread(engine.weights_checksum)
    return web.json_response({"weight_version": engine.weight_version, "checksums": checksums})


async def flush_cache(request: web.Request) -> web.Response:
    request.app[ENGINE_KEY].flush_cache()
    return web.json_response({"success": True, "message": "Cache flushed.",
                              "weight_version": request.app[ENGINE_KEY].weight_version})


async def abort_request(request: web.Request) -> web.Response:
    rid, abort_all = parse_abort_request(await read_json(request))
    n = request.app[ENGINE_KEY].abort(rid=rid, abort_all=abort_all)
    return web.json_response({"success": True, "num_aborted": n,
                              "weight_version": request.app[ENGINE_KEY].weight_version})


async def pause_generation(request: web.Request) -> web.Response:
    await asyncio.get_running_loop().run_in_executor(None, request.app[ENGINE_KEY].pause)
    return web.json_response({"success": True, "weight_version": request.app[ENGINE_KEY].weight_version})


async def continue_generation(request: web.Request) -> web.Response:
    request.app[ENGINE_KEY].resume()
    return web.json_response({"success": True, "weight_version": request.app[ENGINE_KEY].weight_version})


async def update_weights_from_tensor(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    ctype = request.content_type or ""
    if ctype == "application/json":
        raise ProtocolError(
            "body",
            "the native engine takes the binary form: POST the bytes of "
            "safetensors.torch.save({name: tensor}) with Content-Type application/octet-stream",
        )
    version = parse_weight_version(request.query.get("weight_version"))
    flush = parse_bool_param(request.query.get("flush_cache"), "flush_cache", True)
    data = await read_body(request)
    if not data:
        raise ProtocolError("body", "empty body; expected safetensors bytes")
    what = f"the safetensors bytes sent to {Route.UPDATE_WEIGHTS_FROM_TENSOR.path} are"

    def _load_and_apply():
        # names, shapes and sizes from the header first: nothing is allocated for a refused payload
        engine.check_safetensors_header(safetensors_header(data, "body", what))
        try:
            tensors = load(data)
        except Exception as e:  # noqa: BLE001
            raise ProtocolError("body", f"{what} not a safetensors payload: {e}") from None
        v = engine.update_weights(tensors, weight_version=version)
        if flush:
            engine.flush_cache()
        return v, len(tensors)

    v, n = await asyncio.get_running_loop().run_in_executor(None, _load_and_apply)
    return web.json_response({"success": True, "weight_version": v, "num_tensors": n, "message": "Succeeded."})


async def update_weights_from_disk(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    path, version = parse_update_weights_from_disk(await read_json(request))
    check_request(request, weight_path=path)
    v = await asyncio.get_running_loop().run_in_executor(None, engine.update_weights_from_disk, path, version)
    return web.json_response({"success": True, "weight_version": v, "message": "Succeeded to update model weights."})


async def init_weights_update_group(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    kw = parse_init_weights_update_group(await read_json(request))
    check_request(request, master_address=kw["master_address"])
    access = request.app.get(ACCESS_KEY)
    bind = access.host if access is not None else None  # its gloo sockets on the server's own address
    adm = request.app[ADMISSION_KEY]
    try:  # on a thread of its own, bounded by --weight-group-timeout: a peer that never comes holds only it
        await adm.groups.run(Route.INIT_WEIGHTS_UPDATE_GROUP.path, lambda: engine.init_weights_update_group(
            **kw, timeout_s=adm.group_timeout, bind_address=bind), key=kw["group_name"])
    except ProtocolError:
        raise
    except Exception as e:  # noqa: BLE001 - rendezvous failed (timeout, unreachable master): report, keep serving
        logger.warning("init_weights_update_group %r failed: %s", kw["group_name"], e)
        why = (str(e).strip().splitlines() or [""])[0]
        return web.json_response({"success": False, "message": f"failed to join group {kw['group_name']!r} within "
                                  f"--weight-group-timeout {adm.group_timeout:g}s: {type(e).__name__}: {why}",
                                  "weight_version": engine.weight_version}, status=400)
    return web.json_response({"success": True, "message": f"joined weight update group {kw['group_name']!r} as "
                              f"rank {kw['rank_offset']} of {kw['world_size']}",
                              "weight_version": engine.weight_version})


async def update_weights_from_distributed(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    kw = parse_update_weights_from_distributed(await read_json(request))
    if kw["group_name"] not in engine._groups:
        raise ProtocolError("group_name", f"no weight update group named {kw['group_name']!r}; "
                                          "call /init_weights_update_group first")
    dtypes = [getattr(torch, d) for d in kw["dtypes"]]
    engine.check_distributed(kw["names"], dtypes, kw["shapes"])  # before anything is received or aborted
    if kw["abort_all_requests"]:
        engine.abort(abort_all=True)

    def _recv():
        v = engine.update_weights_from_distributed(kw["names"], dtypes, kw["shapes"], kw["group_name"],
                                                   kw["weight_version"])
        if kw["flush_cache"]:
            engine.flush_cache()
        return v

    v = await request.app[ADMISSION_KEY].groups.run(Route.UPDATE_WEIGHTS_FROM_DISTRIBUTED.path, _recv)
    return web.json_response({"success": True, "message": "Succeeded to update parameter online.",
                              "weight_version": v, "num_tensors": len(kw["names"])})


async def destroy_weights_update_group(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    name = parse_destroy_weights_update_group(await read_json(request, allow_empty=True))
    if not await asyncio.get_running_loop().run_in_executor(None, engine.destroy_weights_update_group, name):
        raise ProtocolError("group_name", f"no weight update group named {name!r}")
    return web.json_response({"success": True, "message": f"destroyed {name!r}",
                              "weight_version": engine.weight_version})


async def release_memory_occupation(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    tags = parse_memory_tags(await read_json(request, allow_empty=True))
    released = await asyncio.get_running_loop().run_in_executor(None, engine.release_memory_occupation, tags)
    return web.json_response({"success": True, "released": released, "weight_version": engine.weight_version})


async def resume_memory_occupation(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    tags = parse_memory_tags(await read_json(request, allow_empty=True))
    released = await asyncio.get_running_loop().run_in_executor(None, engine.resume_memory_occupation, tags)
    return web.json_response({"success": True, "released": released, "weight_version": engine.weight_version})


async def update_weight_version(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    version, abort_all = parse_update_weight_version(await read_json(request))
    v = await asyncio.get_running_loop().run_in_executor(None, engine.update_weight_version, version, abort_all)
    return web.json_response({"success": True, "message": f"Weight version updated to {v}.", "new_version": v,
                              "weight_version": v})


def _lora_answer(engine: NativeEngine) -> web.Response:
    """SGLang's LoRAUpdateOutput."""
    return web.json_response({"success": True, "error_message": None, "loaded_adapters": engine.lora_adapters()})


async def load_lora_adapter(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    name, path, _pinned = parse_load_lora_adapter(await read_json(request))  # nothing is ever evicted: pinned is moot
    try:
        check_request(request, weight_path=path)
    except ProtocolError as e:
        raise ProtocolError("lora_path", e.message) from None
    await asyncio.get_running_loop().run_in_executor(None, engine.load_lora_adapter, name, path)
    return _lora_answer(engine)


async def unload_lora_adapter(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    name = parse_unload_lora_adapter(await read_json(request))
    await asyncio.get_running_loop().run_in_executor(None, engine.unload_lora_adapter, name)
    return _lora_answer(engine)


HANDLERS = {
    Route.GENERATE: generate,
    Route.HEALTH: health,
    Route.HEALTH_GENERATE: health_generate,
    Route.GET_MODEL_INFO: get_model_info,
    Route.GET_SERVER_INFO: get_server_info,
    Route.GET_WEIGHT_VERSION: get_weight_version,
    Route.WEIGHTS_CHECKSUM: weights_checksum,
    Route.FLUSH_CACHE: flush_cache,
    Route.ABORT_REQUEST: abort_request,
    Route.PAUSE_GENERATION: pause_generation,
    Route.CONTINUE_GENERATION: continue_generation,
    Route.UPDATE_WEIGHTS_FROM_TENSOR: update_weights_from_tensor,
    Route.UPDATE_WEIGHTS_FROM_DISK: update_weights_from_disk,
    Route.INIT_WEIGHTS_UPDATE_GROUP: init_weights_update_group,
    Route.UPDATE_WEIGHTS_FROM_DISTRIBUTED: update_weights_from_distributed,
    Route.DESTROY_WEIGHTS_UPDATE_GROUP: destroy_weights_update_group,
    Route.RELEASE_MEMORY_OCCUPATION: release_memory_occupation,
    Route.RESUME_MEMORY_OCCUPATION: resume_memory_occupation,
    Route.UPDATE_WEIGHT_VERSION: update_weight_version,
    Route.LOAD_LORA_ADAPTER: load_lora_adapter,
    Route.UNLOAD_LORA_ADAPTER: unload_lora_adapter,
}


def create_app(engine: NativeEngine, shutdown_engine: bool = True,
               incremental_streaming_output: bool = False, access: Access | None = None,
               limits: ServerLimits | None = None) -> web.Application:
    """An aiohttp application serving `engine` (started here if it is not running).

    `incremental_streaming_output`: streamed `/generate` events carry only the text, token
    ids and log-probs new since the previous event (SGLang's flag); default cumulative.
    `access`: who may call it (`slime.engines.auth`); the command line always gives one.
    `limits`: what a request may ask for (`limits.py`; default `ServerLimits()`)."""
    adm = Admission(engine, limits)
    app = web.Application(middlewares=[guard(access)] if access else [], client_max_size=adm.largest_body + 1)
    body_limits(app, adm.caps, adm.default_cap)  # after the guard: a caller without the key learns no caps
    app.middlewares.append(_errors)
    if access is not None:
        app[ACCESS_KEY] = access
    app[ENGINE_KEY] = engine
    app[ADMISSION_KEY] = adm
    app[INCREMENTAL_STREAM_KEY] = incremental_streaming_output
    add_routes(app, {**HANDLERS, **OPENAI_HANDLERS})
    engine.start()

    async def _close_threads(app):
        adm.close()

    app.on_cleanup.append(_close_threads)

    if shutdown_engine:

        async def _cleanup(app):
            await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)

        app.on_cleanup.append(_cleanup)
    return app
