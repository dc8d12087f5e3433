"""HTTP client for inference engines speaking SGLang's native protocol.

`EngineClient` (async, aiohttp) is what rollout code uses for `/generate` and control
calls; `wait_until_healthy`, `post_bytes` and `get_json` are sync helpers (stdlib
urllib) for launchers and the trainer's weight push.

Every call has a timeout. Connection errors (refused / reset / server disconnected)
and HTTP 5xx are retried with exponential backoff up to `max_retries`; HTTP 4xx is
never retried. Failures raise `EngineError`, whose message names the URL, the
endpoint, the HTTP status and the server's error message.
"""

from __future__ import annotations

import asyncio
import json as _json
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import aiohttp

from slime.utils.errors import RunFailure


class EngineError(RunFailure, RuntimeError):
    """A failed call to an engine. Attributes: url, endpoint, status (None if no HTTP
    response), server_message. A RunFailure: a run that meets one ends with its one-line message."""

    def __init__(
        self,
        message: str,
        *,
        url: str | None = None,
        endpoint: str | None = None,
        status: int | None = None,
        server_message: str | None = None,
    ):
        super().__init__(message)
        self.url = url
        self.endpoint = endpoint
        self.status = status
        self.server_message = server_message


def _server_message(body: bytes | str) -> str:
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
        for key in ("message", "detail"):
            if key in data:
                return str(data[key])
    return body.strip()[:2000]


def _decode_body(body: bytes) -> Any:
    """Responses are JSON for the native engine; SGLang answers some control endpoints with
    plain text or an empty body, which come back as {"text": ...} / {}."""
    if not body.strip():
        return {}
    text = body.decode("utf-8", errors="replace")
    try:
        return _json.loads(text)
    except ValueError:
        return {"text": text}


def _http_error(base_url: str, method: str, path: str, status: int, body: bytes | str) -> EngineError:
    msg = _server_message(body)
    return EngineError(
        f"{method} {base_url}{path} failed: HTTP {status}: {msg}",
        url=base_url,
        endpoint=path,
        status=status,
        server_message=msg,
    )


_RETRYABLE = (
    aiohttp.ClientConnectionError,  # refused, reset, server disconnected, ClientOSError
    aiohttp.ClientPayloadError,
    ConnectionError,
)


_CONNECT_TIMEOUT = getattr(aiohttp, "ConnectionTimeoutError", ())


class EngineClient:
    """Async client for one engine (or a router) at `base_url`.

    One aiohttp.ClientSession per client, created lazily in the running event loop
    (and re-created if used from a different loop). `timeout` bounds each call in
    total, `connect_timeout` the TCP connect.
    """

    backoff_base = 0.5
    backoff_max = 8.0
    max_connections = 1024

    def __init__(self, base_url: str, timeout: float = 600.0, connect_timeout: float = 10.0, max_retries: int = 3):
        if "://" not in base_url:
            base_url = "http://" + base_url
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.max_retries = max_retries
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def __repr__(self) -> str:
        return f"EngineClient({self.base_url!r})"

    async def _get_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            if self._session is not None and not self._session.closed:
                self._drop_foreign_session()
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_connections),
                # `connect` would include waiting for a pooled connection; bound the socket connect only
                timeout=aiohttp.ClientTimeout(total=self.timeout, sock_connect=self.connect_timeout),
            )
            self._loop = loop
        return self._session

    async def _request(self, method: str, path: str, json: Any = None, data: bytes | None = None,
                       params: dict | None = None, headers: dict | None = None) -> Any:
        if not path.startswith("/"):
            path = "/" + path
        url = self.base_url + path
        attempt = 0
        while True:
            session = await self._get_session()
            try:
                async with session.request(method, url, json=json, data=data, params=params,
                                           headers=headers) as resp:
                    body = await resp.read()
                    if resp.status < 400:
                        return _decode_body(body)
                    err = _http_error(self.base_url, method, path, resp.status, body)
                    if resp.status < 500:
                        raise err
            except EngineError:
                raise
            except _CONNECT_TIMEOUT as e:  # could not connect in time: retry like a refused connection
                err = EngineError(
                    f"{method} {url} failed: connect timeout after {self.connect_timeout}s: {e}",
                    url=self.base_url,
                    endpoint=path,
                )
            except asyncio.TimeoutError:
                raise EngineError(
                    f"{method} {url} failed: timed out after {self.timeout}s (no response)",
                    url=self.base_url,
                    endpoint=path,
                ) from None
            except _RETRYABLE as e:
                err = EngineError(
                    f"{method} {url} failed: connection error: {type(e).__name__}: {e}",
                    url=self.base_url,
                    endpoint=path,
                )
            if attempt >= self.max_retries:
                raise EngineError(f"{err} (gave up after {attempt + 1} attempts)", url=err.url,
                                  endpoint=err.endpoint, status=err.status, server_message=err.server_message)
            await asyncio.sleep(min(self.backoff_max, self.backoff_base * (2**attempt)))
            attempt += 1

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

    async def generate(self, payload: dict) -> dict:
        """POST /generate with an SGLang-native payload; returns the response JSON."""
        return await self._request("POST", "/generate", json=payload)

    async def get(self, path: str) -> dict:
        return await self._request("GET", path)

    async def post(self, path: str, json: dict | None = None) -> dict:
        return await self._request("POST", path, json=json if json is not None else {})

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            if self._loop is asyncio.get_running_loop():
                await self._session.close()
            else:
                self._drop_foreign_session()
        self._session = None
        self._loop = None

    async def __aenter__(self) -> "EngineClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


# ---------------------------------------------------------------- sync helpers (urllib)
def _norm(url: str) -> str:
    if "://" not in url:
        url = "http://" + url
    return url.rstrip("/")


def _urlopen(base: str, method: str, path: str, timeout: float, data: bytes | None = None,
             headers: dict | None = None, params: dict | None = None) -> Any:
    if not path.startswith("/"):
        path = "/" + path
    full = base + path
    if params:
        full += "?" + urllib.parse.urlencode({k: _qs(v) for k, v in params.items() if v is not None})
    req = urllib.request.Request(full, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return _decode_body(resp.read())
    except urllib.error.HTTPError as e:
        body = e.read() if e.fp is not None else b""
        raise _http_error(base, method, path, e.code, body) from None
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        reason = getattr(e, "reason", e)
        raise EngineError(f"{method} {full} failed: {type(reason).__name__}: {reason}", url=base,
                          endpoint=path) from None


def _qs(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def get_json(url: str, path: str, timeout: float = 30.0) -> dict:
    """GET `url + path` and decode the JSON answer; raises EngineError."""
    return _urlopen(_norm(url), "GET", path, timeout)


def post_json(url: str, path: str, payload: dict | None = None, timeout: float = 60.0) -> dict:
    """POST a JSON body; raises EngineError."""
    data = _json.dumps(payload if payload is not None else {}).encode()
    return _urlopen(_norm(url), "POST", path, timeout, data=data, headers={"Content-Type": "application/json"})


def post_bytes(url: str, path: str, data: bytes, params: dict | None = None, timeout: float = 600.0) -> dict:
    """POST raw bytes (application/octet-stream) with query `params`; used by the trainer
    to push safetensors weight buckets. Raises EngineError."""
    return _urlopen(_norm(url), "POST", path, timeout, data=data,
                    headers={"Content-Type": "application/octet-stream"}, params=params)


def wait_until_healthy(url: str, timeout: float, process: subprocess.Popen | None = None,
                       poll_interval: float = 0.25) -> None:
    """Poll GET /health until it answers 200. Raises EngineError naming the URL when the
    timeout expires, or at once (with its exit code) if `process` exits first."""
    base = _norm(url)
    deadline = time.monotonic() + timeout
    last = "no answer yet"
    while True:
        if process is not None and process.poll() is not None:
            raise EngineError(
                f"engine at {base} exited with code {process.returncode} before becoming healthy (last: {last})",
                url=base,
                endpoint="/health",
            )
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            extra = ""
            if process is not None:
                rc = process.poll()
                extra = f"; process {'is still running' if rc is None else f'exited with code {rc}'}"
            raise EngineError(
                f"engine at {base} not healthy after {timeout:.1f}s (GET /health: {last}){extra}",
                url=base,
                endpoint="/health",
            )
        try:
            _urlopen(base, "GET", "/health", timeout=max(0.1, min(5.0, remaining)))
            return
        except EngineError as e:
            last = str(e)
        time.sleep(max(0.0, min(poll_interval, deadline - time.monotonic())))
