"""The one client of the engine protocol: every route slime calls, typed, bounded, sync and async.

`Route` is the table of the routes of SGLang's HTTP API that slime uses (generation, control,
weights, memory, the OpenAI-compatible ones) plus sglang-router's worker admin. It is the only
place in slime that spells an endpoint path: the clients below build their requests from it,
and slime's own servers (the native engine, the vLLM adapter) register their handlers by it,
so a route that a client can call and a server does not serve is a test failure, not a 404
in production.

- `EngineControl(url)`: blocking calls (urllib) for launchers, the trainer's weight push and
  tests; no retries unless asked.
- `AsyncEngineControl(url)`: the same calls as coroutines (aiohttp, one session per client and
  event loop) for rollout code; connection errors and HTTP 5xx are retried with exponential
  backoff up to `max_retries` (3), HTTP 4xx never.
- `RouterControl(url)`: sglang-router's `/workers` admin (and the `/add_worker` family of older
  routers).
- `wait_until_healthy(url, timeout, process)`: the one health wait of every server slime starts.

Every call has a timeout. Failures raise `EngineError`, whose message names the URL, the route,
the HTTP status and the server's own message. A body that says `{"success": false}` (SGLang
answers some failures that way with HTTP 200) is an error too; the weight, weight-version and LoRA
adapter routes must say `"success": true`.
"""

from __future__ import annotations

import asyncio
import enum
import json as _json
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Callable

import aiohttp

from slime.engines.auth import bearer, env_api_key
from slime.utils.errors import RunFailure


class EngineError(RunFailure, RuntimeError):
    """A failed call to an engine or a router. Attributes: url, endpoint, status (None if no HTTP
    response), server_message. A RunFailure: a run that meets one ends with its one-line message."""

    def __init__(self, message: str, *, url: str | None = None, endpoint: str | None = None,
                 status: int | None = None, server_message: str | None = None):
        super().__init__(message)
        self.url = url
        self.endpoint = endpoint
        self.status = status
        self.server_message = server_message


class Route(enum.Enum):
    """(HTTP method, path) of every route slime speaks. Servers register handlers by these."""

    # generation
    GENERATE = ("POST", "/generate")
    OPENAI_COMPLETIONS = ("POST", "/v1/completions")
    OPENAI_CHAT_COMPLETIONS = ("POST", "/v1/chat/completions")
    OPENAI_MODELS = ("GET", "/v1/models")
    ABORT_REQUEST = ("POST", "/abort_request")
    PAUSE_GENERATION = ("POST", "/pause_generation")
    CONTINUE_GENERATION = ("POST", "/continue_generation")
    FLUSH_CACHE = ("POST", "/flush_cache")
    # state
    HEALTH = ("GET", "/health")
    HEALTH_GENERATE = ("GET", "/health_generate")
    MODEL_INFO = ("GET", "/model_info")  # SGLang >= 0.5; older servers and the native engine: GET_MODEL_INFO
    GET_MODEL_INFO = ("GET", "/get_model_info")
    GET_SERVER_INFO = ("GET", "/get_server_info")
    GET_WEIGHT_VERSION = ("GET", "/get_weight_version")
    WEIGHTS_CHECKSUM = ("GET", "/weights_checksum")  # slime's own: sha256 of every parameter
    # weights
    UPDATE_WEIGHTS_FROM_TENSOR = ("POST", "/update_weights_from_tensor")
    UPDATE_WEIGHTS_FROM_DISK = ("POST", "/update_weights_from_disk")
    INIT_WEIGHTS_UPDATE_GROUP = ("POST", "/init_weights_update_group")
    UPDATE_WEIGHTS_FROM_DISTRIBUTED = ("POST", "/update_weights_from_distributed")
    DESTROY_WEIGHTS_UPDATE_GROUP = ("POST", "/destroy_weights_update_group")
    BEGIN_WEIGHT_UPDATE = ("POST", "/begin_weight_update")  # SGLang >= 0.5.23 only
    END_WEIGHT_UPDATE = ("POST", "/end_weight_update")
    UPDATE_WEIGHT_VERSION = ("POST", "/update_weight_version")
    # LoRA adapters (SGLang's names; /generate selects one by name in `lora_path`)
    LOAD_LORA_ADAPTER = ("POST", "/load_lora_adapter")
    UNLOAD_LORA_ADAPTER = ("POST", "/unload_lora_adapter")
    # memory (colocation)
    RELEASE_MEMORY_OCCUPATION = ("POST", "/release_memory_occupation")
    RESUME_MEMORY_OCCUPATION = ("POST", "/resume_memory_occupation")
    # sglang-router's worker admin
    ROUTER_WORKERS = ("GET", "/workers")
    ROUTER_ADD_WORKER = ("POST", "/workers")
    ROUTER_REMOVE_WORKER = ("DELETE", "/workers/{worker_id}")
    ROUTER_LIST_WORKERS_LEGACY = ("GET", "/list_workers")
    ROUTER_ADD_WORKER_LEGACY = ("POST", "/add_worker")
    ROUTER_REMOVE_WORKER_LEGACY = ("POST", "/remove_worker")

    @property
    def method(self) -> str:
        return self.value[0]

    @property
    def path(self) -> str:
        return self.value[1]


# The routes every engine slime can run (native, the vLLM adapter) serves; SGLang serves them too.
ENGINE_ROUTES = tuple(r for r in Route if not r.name.startswith("ROUTER_")
                      and r not in (Route.MODEL_INFO, Route.BEGIN_WEIGHT_UPDATE, Route.END_WEIGHT_UPDATE))

PAUSE_MODES = ("abort", "retract", "in_place")
_MUST_SUCCEED = {Route.UPDATE_WEIGHTS_FROM_TENSOR, Route.UPDATE_WEIGHTS_FROM_DISK, Route.INIT_WEIGHTS_UPDATE_GROUP,
                 Route.UPDATE_WEIGHTS_FROM_DISTRIBUTED, Route.UPDATE_WEIGHT_VERSION, Route.LOAD_LORA_ADAPTER,
                 Route.UNLOAD_LORA_ADAPTER}
_RAISE = object()


def normalize_url(url: str) -> str:
    """`host:port` or a URL -> `http://host:port` without a trailing slash."""
    if "://" not in url:
        url = "http://" + url
    return url.rstrip("/")


def server_message(body: bytes | str) -> str:
    """The error message inside an error response body (SGLang / OpenAI / FastAPI shapes)."""
    if isinstance(body, bytes):
        body = body.decode("utf-8", errors="replace")
    try:
        data = _json.loads(body)
    except ValueError:
        return body.strip()[:2000]
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if isinstance(err, str):
            return err
        for key in ("message", "error_message", "detail"):
            if key in data:
                return str(data[key])
    return body.strip()[:2000]


def _decode_body(body: bytes) -> Any:
    """JSON answers; SGLang answers some control routes with plain text or an empty body, which
    come back as {"text": ...} / {}."""
    if not body.strip():
        return {}
    text = body.decode("utf-8", errors="replace")
    try:
        return _json.loads(text)
    except ValueError:
        return {"text": text}


def _http_error(base_url: str, method: str, path: str, status: int, body: bytes | str) -> EngineError:
    msg = server_message(body)
    return EngineError(f"{method} {base_url}{path} failed: HTTP {status}: {msg}", url=base_url, endpoint=path,
                       status=status, server_message=msg)


def _query(params: dict | None) -> dict | None:
    if not params:
        return None
    return {k: ("true" if v else "false") if isinstance(v, bool) else str(v) for k, v in params.items()
            if v is not None}


def _check_success(route: Route, base_url: str, body: Any) -> Any:
    """SGLang answers {"success": false, "message": ...} (the LoRA routes: "error_message") for a
    refused control call (sometimes with HTTP 200); the weight and LoRA routes must answer success: true."""
    ok = body.get("success") if isinstance(body, dict) else None
    if ok is False or (route in _MUST_SUCCEED and ok is not True):
        message = body
        if isinstance(body, dict):
            message = body.get("message") or body.get("error_message") or body
        raise EngineError(f"{route.method} {base_url}{route.path} did not succeed: {message!r}", url=base_url,
                          endpoint=route.path, server_message=str(message))
    return body


def _retryable(err: EngineError) -> bool:
    """Worth another attempt: no HTTP answer (refused, reset) or an HTTP 5xx; never a 4xx."""
    return err.status is None or err.status >= 500


class _Calls:
    """The typed calls, written once. `_call` runs one (blocking in `EngineControl`, a coroutine in
    `AsyncEngineControl`); `fallback` is the route to try when the first answers 404, `if_missing`
    the value to return instead when it answers 404."""

    base_url: str

    def _call(self, route: Route, *, json: Any = None, data: bytes | None = None, params: dict | None = None,
              path_args: dict | None = None, fallback: Route | None = None, if_missing: Any = _RAISE,
              then: Callable[[Any], Any] | None = None):
        raise NotImplementedError

    # ---- generation
    def generate(self, payload: dict):
        """POST /generate with an SGLang-native payload; returns the response JSON."""
        return self._call(Route.GENERATE, json=payload)

    def abort(self, rid: str | None = None):
        """Abort one request by rid, or every request when rid is None (SGLang's AbortReq)."""
        return self._call(Route.ABORT_REQUEST, json={"rid": rid} if rid is not None else {"abort_all": True})

    def pause(self, mode: str | None = None):
        """Stop scheduling (PauseGenerationReqInput). 'retract' keeps the requests and recomputes
        their KV after `continue_generation`; 'abort' returns them as aborted; 'in_place' keeps their
        KV. None: the server's default (the native engine holds them in place)."""
        if mode is not None and mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        return self._call(Route.PAUSE_GENERATION, json={"mode": mode} if mode is not None else {})

    def continue_generation(self):
        return self._call(Route.CONTINUE_GENERATION, json={})

    def flush_cache(self):
        """Drop the prefix cache (SGLang answers 400 while requests are running or queued)."""
        return self._call(Route.FLUSH_CACHE, json={})

    # ---- state
    def health(self):
        return self._call(Route.HEALTH)

    def model_info(self):
        """`/model_info` (SGLang >= 0.5), else `/get_model_info` (older SGLang, the native engine)."""
        return self._call(Route.MODEL_INFO, fallback=Route.GET_MODEL_INFO)

    def server_info(self):
        return self._call(Route.GET_SERVER_INFO)

    def weight_version(self):
        """The weight version the engine serves, as a string."""
        return self._call(Route.MODEL_INFO, fallback=Route.GET_MODEL_INFO, then=lambda b: str(b["weight_version"]))

    def weights_checksum(self):
        """{name: sha256} of every parameter the engine serves (slime's engines only)."""
        return self._call(Route.WEIGHTS_CHECKSUM, then=lambda b: b["checksums"])

    # ---- memory
    def release_memory(self, tags: list[str] | None = None):
        """Free memory (ReleaseMemoryOccupationReqInput; tags 'weights' / 'kv_cache', None = both).
        SGLang needs --enable-memory-saver, which --colocate adds."""
        return self._call(Route.RELEASE_MEMORY_OCCUPATION, json={"tags": list(tags)} if tags else {})

    def resume_memory(self, tags: list[str] | None = None):
        return self._call(Route.RESUME_MEMORY_OCCUPATION, json={"tags": list(tags)} if tags else {})

    # ---- weights
    def begin_weight_update(self):
        """Open SGLang's weight-update session (newer SGLang refuses updates outside one). False when
        the server has none (404: older SGLang, the native engine), where none is needed."""
        return self._call(Route.BEGIN_WEIGHT_UPDATE, json={}, if_missing=False, then=lambda _: True)

    def end_weight_update(self):
        return self._call(Route.END_WEIGHT_UPDATE, json={}, if_missing=False, then=lambda _: True)

    def update_weights_from_tensor(self, data: bytes, weight_version: int | str | None = None,
                                   flush_cache: bool = True):
        """The binary form slime's engines take: the bytes of `safetensors.torch.save({name: tensor})`
        (Content-Type application/octet-stream), weight version and cache flush in the query."""
        return self._call(Route.UPDATE_WEIGHTS_FROM_TENSOR, data=data,
                          params={"weight_version": weight_version, "flush_cache": flush_cache})

    def update_weights_from_ipc_handles(self, serialized_named_tensors: list[str],
                                        weight_version: int | str | None = None, flush_cache: bool = True,
                                        load_format: str | None = None):
        """SGLang's colocated form of /update_weights_from_tensor (UpdateWeightsFromTensorReqInput):
        one base64 string per engine TP rank, each a torch-multiprocessing pickle of
        [(name, cuda tensor), ...] that the engine opens by CUDA IPC."""
        if not serialized_named_tensors or not all(isinstance(s, str) for s in serialized_named_tensors):
            raise ValueError("serialized_named_tensors must be a non-empty list of base64 strings, one per TP rank")
        body: dict[str, Any] = {"serialized_named_tensors": list(serialized_named_tensors), "flush_cache": flush_cache}
        if load_format is not None:
            body["load_format"] = load_format
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        return self._call(Route.UPDATE_WEIGHTS_FROM_TENSOR, json=body)

    def update_weights_from_disk(self, model_path: str, weight_version: int | str | None = None,
                                 flush_cache: bool = True, abort_all_requests: bool = False):
        """Load weights from a Hugging Face directory (UpdateWeightFromDiskReqInput)."""
        body = {"model_path": model_path, "flush_cache": flush_cache, "abort_all_requests": abort_all_requests}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        return self._call(Route.UPDATE_WEIGHTS_FROM_DISK, json=body)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str = "nccl"):
        """Join the trainer's broadcast group (InitWeightsUpdateGroupReqInput); answers once every
        rank of the group has joined."""
        return self._call(Route.INIT_WEIGHTS_UPDATE_GROUP, json={
            "master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
            "world_size": int(world_size), "group_name": group_name, "backend": backend})

    def update_weights_from_distributed(self, names: list[str], dtypes: list, shapes: list[list[int]],
                                        group_name: str = "weight_update_group",
                                        weight_version: int | str | None = None, flush_cache: bool = True):
        """Receive one bucket broadcast by rank 0 in `names` order (UpdateWeightsFromDistributedReqInput);
        dtypes as torch dtypes or names without the 'torch.' prefix."""
        body = {"names": list(names), "dtypes": [str(d).replace("torch.", "") for d in dtypes],
                "shapes": [list(map(int, s)) for s in shapes], "group_name": group_name, "flush_cache": flush_cache}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        return self._call(Route.UPDATE_WEIGHTS_FROM_DISTRIBUTED, json=body)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group"):
        return self._call(Route.DESTROY_WEIGHTS_UPDATE_GROUP, json={"group_name": group_name})

    def update_weight_version(self, new_version: int | str, abort_all_requests: bool = False):
        """Set the weight version the engine reports (UpdateWeightVersionReqInput), e.g. after a LoRA
        adapter update; `abort_all_requests` aborts every request first."""
        return self._call(Route.UPDATE_WEIGHT_VERSION, json={"new_version": str(new_version),
                                                            "abort_all_requests": bool(abort_all_requests)})

    # ---- LoRA adapters
    def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False):
        """Load a peft LoRA adapter directory under `lora_name` (LoadLoRAAdapterReqInput); `/generate`
        then selects it with `"lora_path": lora_name`. Answers {"success", "error_message",
        "loaded_adapters": {name: path}}; a name already loaded is refused."""
        return self._call(Route.LOAD_LORA_ADAPTER, json={"lora_name": lora_name, "lora_path": lora_path,
                                                        "pinned": bool(pinned)})

    def unload_lora_adapter(self, lora_name: str):
        """Unload the adapter named `lora_name` (UnloadLoRAAdapterReqInput)."""
        return self._call(Route.UNLOAD_LORA_ADAPTER, json={"lora_name": lora_name})


# The run's engines, adapters and router are never reached through an http(s)_proxy of the
# environment (urllib's default opener would; aiohttp sessions ignore it unless trust_env=True)
_NO_PROXY_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class EngineControl(_Calls):
    """Blocking client of one engine (or a router in front of engines) at `url`.

    `timeout` bounds every call; `max_retries` retries connection errors and HTTP 5xx (default:
    none, so a weight update is never sent twice); `api_key`: the run's engine key (default: the
    one slime hands its processes, `slime.engines.auth.env_api_key()`)."""

    backoff_base = 0.5
    backoff_max = 8.0

    def __init__(self, url: str, timeout: float = 60.0, max_retries: int = 0, api_key: str | None = None):
        self.base_url = normalize_url(url)
        self.timeout = timeout
        self.max_retries = max_retries
        self.headers = bearer(api_key if api_key is not None else env_api_key())

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.base_url!r})"

    def request(self, method: str, path: str, *, json: Any = None, data: bytes | None = None,
                params: dict | None = None) -> Any:
        """One HTTP request (with the retries of `max_retries`); the decoded answer."""
        full = self.base_url + path
        query = _query(params)
        if query:
            full += "?" + urllib.parse.urlencode(query)
        headers = dict(self.headers)
        if json is not None:
            data, headers["Content-Type"] = _json.dumps(json).encode(), "application/json"
        elif data is not None:
            headers["Content-Type"] = "application/octet-stream"
        attempt = 0
        while True:
            req = urllib.request.Request(full, data=data, method=method, headers=headers)
            try:
                with _NO_PROXY_OPENER.open(req, timeout=self.timeout) as resp:
                    return _decode_body(resp.read())
            except urllib.error.HTTPError as e:
                err = _http_error(self.base_url, method, path, e.code, e.read() if e.fp is not None else b"")
            except (urllib.error.URLError, OSError, TimeoutError) as e:
                reason = getattr(e, "reason", e)
                err = EngineError(f"{method} {full} failed: {type(reason).__name__}: {reason}", url=self.base_url,
                                  endpoint=path)
            if attempt >= self.max_retries or not _retryable(err):
                raise err
            time.sleep(min(self.backoff_max, self.backoff_base * (2**attempt)))
            attempt += 1

    def _call(self, route, *, json=None, data=None, params=None, path_args=None, fallback=None,
              if_missing=_RAISE, then=None):
        path = route.path.format(**path_args) if path_args else route.path
        try:
            body = self.request(route.method, path, json=json, data=data, params=params)
        except EngineError as e:
            if e.status != 404 or (fallback is None and if_missing is _RAISE):
                raise
            if fallback is None:
                return if_missing
            route, body = fallback, self.request(fallback.method, fallback.path, json=json, data=data, params=params)
        body = _check_success(route, self.base_url, body)
        return then(body) if then is not None else body


_RETRYABLE = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, ConnectionError)
_CONNECT_TIMEOUT = getattr(aiohttp, "ConnectionTimeoutError", ())


class AsyncEngineControl(_Calls):
    """The same calls as coroutines, for code on an event loop (aiohttp).

    One aiohttp.ClientSession per client, created lazily in the running event loop (and made anew
    when used from another loop). `timeout` bounds each call in total, `connect_timeout` the TCP
    connect; connection errors and HTTP 5xx are retried up to `max_retries` times; `api_key` as
    for `EngineControl`."""

    backoff_base = 0.5
    backoff_max = 8.0
    max_connections = 1024

    def __init__(self, url: str, timeout: float = 600.0, connect_timeout: float = 10.0, max_retries: int = 3,
                 api_key: str | None = None):
        self.base_url = normalize_url(url)
        self.headers = bearer(api_key if api_key is not None else env_api_key())
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.max_retries = max_retries
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.base_url!r})"

    async def _get_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            if self._session is not None and not self._session.closed:
                self._drop_foreign_session()
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_connections),
                headers=self.headers,
                # `connect` would include waiting for a pooled connection; bound the socket connect only
                timeout=aiohttp.ClientTimeout(total=self.timeout, sock_connect=self.connect_timeout),
            )
            self._loop = loop
        return self._session

    async def request(self, method: str, path: str, *, json: Any = None, data: bytes | None = None,
                      params: dict | None = None) -> Any:
        """One HTTP request (with the retries of `max_retries`); the decoded answer."""
        url = self.base_url + path
        headers = {"Content-Type": "application/octet-stream"} if data is not None else None
        attempt = 0
        while True:
            session = await self._get_session()
            try:
                async with session.request(method, url, json=json, data=data, params=_query(params),
                                           headers=headers) as resp:
                    body = await resp.read()
                    if resp.status < 400:
                        return _decode_body(body)
                    err = _http_error(self.base_url, method, path, resp.status, body)
            except _CONNECT_TIMEOUT as e:  # could not connect in time: retried like a refused connection
                err = EngineError(f"{method} {url} failed: connect timeout after {self.connect_timeout}s: {e}",
                                  url=self.base_url, endpoint=path)
            except asyncio.TimeoutError:
                raise EngineError(f"{method} {url} failed: timed out after {self.timeout}s (no response)",
                                  url=self.base_url, endpoint=path) from None
            except _RETRYABLE as e:
                err = EngineError(f"{method} {url} failed: connection error: {type(e).__name__}: {e}",
                                  url=self.base_url, endpoint=path)
            if not _retryable(err):
                raise err
            if attempt >= self.max_retries:
                raise EngineError(f"{err} (gave up after {attempt + 1} attempts)", url=err.url, endpoint=err.endpoint,
                                  status=err.status, server_message=err.server_message)
            await asyncio.sleep(min(self.backoff_max, self.backoff_base * (2**attempt)))
            attempt += 1

    async def _acall(self, route, json, data, params, path_args, fallback, if_missing, then):
        path = route.path.format(**path_args) if path_args else route.path
        try:
            body = await self.request(route.method, path, json=json, data=data, params=params)
        except EngineError as e:
            if e.status != 404 or (fallback is None and if_missing is _RAISE):
                raise
            if fallback is None:
                return if_missing
            route = fallback
            body = await self.request(fallback.method, fallback.path, json=json, data=data, params=params)
        body = _check_success(route, self.base_url, body)
        return then(body) if then is not None else body

    def _call(self, route, *, json=None, data=None, params=None, path_args=None, fallback=None,
              if_missing=_RAISE, then=None):
        return self._acall(route, json, data, params, path_args, fallback, if_missing, then)

    def _drop_foreign_session(self) -> None:
        """Forget a session made in another (usually finished) event loop without awaiting it."""
        old, self._session = self._session, None
        connector = old.connector
        old.detach()
        if connector is None:
            return
        try:  # best effort, private aiohttp internals: close the pooled sockets
            if self._loop is not None and self._loop.is_closed():
                # the loop cannot close its transports any more; close their sockets directly
                for conns in list(getattr(connector, "_conns", {}).values()):
                    for proto, _ in conns:
                        sock = getattr(getattr(proto, "transport", None), "_sock", None)
                        if sock is not None:
                            sock.close()
            connector._close()
        except Exception:  # noqa: BLE001
            pass

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            if self._loop is asyncio.get_running_loop():
                await self._session.close()
            else:
                self._drop_foreign_session()
        self._session = None
        self._loop = None

    async def __aenter__(self) -> "AsyncEngineControl":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


class RouterControl(EngineControl):
    """sglang-router's worker admin (blocking). Routers >= 0.2 take `POST /workers {"url"}` and
    list `GET /workers`; older ones know `/add_worker?url=`, `/remove_worker?url=`, `/list_workers`
    (`legacy`, switched on by the first 404 or 405)."""

    def __init__(self, url: str, timeout: float = 30.0, api_key: str | None = None):
        super().__init__(url, timeout=timeout, api_key=api_key)
        self.legacy = False

    def workers(self) -> list[dict]:
        """[{"url", "id", "is_healthy", ...}] of every worker the router lists."""
        if not self.legacy:
            try:
                return list(self._call(Route.ROUTER_WORKERS).get("workers", []))
            except EngineError as e:
                if e.status not in (404, 405):
                    raise
                self.legacy = True
        urls = self._call(Route.ROUTER_LIST_WORKERS_LEGACY).get("urls", [])
        return [{"url": u, "is_healthy": True} for u in urls]

    def add_worker(self, engine_url: str) -> dict:
        if not self.legacy:
            try:
                return self._call(Route.ROUTER_ADD_WORKER, json={"url": engine_url})
            except EngineError as e:
                if e.status not in (404, 405):
                    raise
                self.legacy = True
        return self._call(Route.ROUTER_ADD_WORKER_LEGACY, params={"url": engine_url})

    def remove_worker(self, engine_url: str, worker_id: str | None) -> None:
        """Remove by id (`DELETE /workers/{id}`), or by URL on a legacy router."""
        if self.legacy:
            self._call(Route.ROUTER_REMOVE_WORKER_LEGACY, params={"url": engine_url})
        elif worker_id is not None:
            self._call(Route.ROUTER_REMOVE_WORKER, path_args={"worker_id": worker_id})

