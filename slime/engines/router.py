"""The router in front of the engines: sglang-router (the Rust router from PyPI).

slime always puts a router in front of its engines, one engine or many, as the original
slime does: rollout requests go to the router URL, and agent code can use that one URL too.

- `start_router(args, log_path)` starts `python -m sglang_router.launch_router` bound to
  127.0.0.1 on a free port (its log goes to `<output-dir>/logs/router.log`); the process gets
  SIGKILL when its owner dies and is stopped by `RouterProcess.stop()`. With
  `--sglang-router-ip/--sglang-router-port` slime uses that running router instead
  (`connect_router`) and starts none.
- `RouterAdmin` registers and removes engines: `POST /workers {"url": ...}` (sglang-router
  >= 0.2; registration is asynchronous, so it polls `GET /workers` until the engine is listed
  healthy), `DELETE /workers/{id}`; routers that only know `/add_worker?url=` get that.
- `EnginePool` is what rollout code calls: `generate(payload)` goes through the router under a
  semaphore of `--sglang-server-concurrency` x engines; `post_all(path, json)` goes to every
  admitted engine directly (control calls: pause, continue, abort); `close()`.

Per-engine concurrency: the started router runs the `cache_aware` policy with both balance
thresholds at their minimum (`--balance-abs-threshold 0 --balance-rel-threshold 1.0`), so a
request goes to the least-loaded engine whenever loads differ (prefix-cache affinity decides
ties). Together with the client semaphore of N x engines this keeps every engine at <= N
requests in flight (measured by tests/test_router.py). An external router keeps its own policy;
there only the total (N x slime's engines) is bounded.

Fault tolerance (`slime.engines.health`): `mark_down(url)` / `mark_up(url)` take an engine out
of `post_all` while it restarts, and with `fault_tolerant=True` a request that fails with a
connection error or an HTTP 5xx (its engine died under it) is retried through the router once
some engine is admitted again, instead of failing the rollout.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from slime.engines.client import EngineClient, EngineError, _norm, _urlopen, get_json, post_json
from slime.utils.errors import RunFailure, SlimeConfigError

logger = logging.getLogger(__name__)

ROUTER_HOST = "127.0.0.1"
REGISTER_TIMEOUT = 120.0
FT_MAX_ATTEMPTS = 10  # tries of one request under --use-fault-tolerance


class RouterError(RunFailure):
    """The router could not be started, reached, or could not register an engine."""


# ------------------------------------------------------------------------------ process
def router_command(host: str, port: int, prometheus_port: int, request_timeout: float) -> list[str]:
    """Command line of the router slime starts (no workers yet: they are registered with POST /workers)."""
    return [
        sys.executable, "-m", "sglang_router.launch_router",
        "--host", host,
        "--port", str(port),
        "--policy", "cache_aware",
        "--balance-abs-threshold", "0",    # least-loaded engine whenever loads differ:
        "--balance-rel-threshold", "1.0",  # keeps <= N in flight per engine under an N x engines cap
        "--request-timeout-secs", str(int(request_timeout) + 1),
        "--prometheus-host", host,         # never 0.0.0.0 (its default)
        "--prometheus-port", str(prometheus_port),
        "--log-level", "warn",
    ]


class RouterProcess:
    """A sglang-router process owned by this Python process."""

    def __init__(self, process: subprocess.Popen, url: str, log_path: Path):
        self.process = process
        self.url = url
        self.log_path = log_path

    def is_alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
            except ProcessLookupError:
                pass
        self.process = None

    def __del__(self):
        try:
            self.stop()
        except Exception:  # noqa: BLE001
            pass


def _log_tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def start_router(log_path: str | Path, request_timeout: float, startup_timeout: float = 60.0) -> RouterProcess:
    """Start sglang-router on a free loopback port; wait until `/health` answers."""
    from slime.engines.launcher import _die_with_parent, free_port

    try:
        import sglang_router  # noqa: F401
    except ImportError:
        raise SlimeConfigError("slime runs its engines behind sglang-router; install it: pip install sglang-router") \
            from None
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    port = free_port(ROUTER_HOST)
    cmd = router_command(ROUTER_HOST, port, free_port(ROUTER_HOST), request_timeout)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=_die_with_parent, env=dict(os.environ, NO_COLOR="1"))
    router = RouterProcess(proc, f"http://{ROUTER_HOST}:{port}", log_path)
    deadline = time.monotonic() + startup_timeout
    last = "no answer yet"
    while True:
        if proc.poll() is not None:
            router.stop()
            raise RouterError(f"sglang-router exited with code {proc.returncode} at start-up; last output of "
                              f"{log_path}:\n{_log_tail(log_path)}")
        try:
            get_json(router.url, "/health", timeout=2.0)
            return router
        except EngineError as e:
            last = str(e)
        if time.monotonic() > deadline:
            router.stop()
            raise RouterError(f"sglang-router at {router.url} not healthy after {startup_timeout:.0f}s ({last}); "
                              f"log: {log_path}")
        time.sleep(0.2)


def connect_router(ip: str, port: int, timeout: float = 10.0) -> str:
    """URL of the running router named by --sglang-router-ip/--sglang-router-port; a clear error when
    nothing answers there."""
    url = _norm(f"{ip}:{port}")
    try:
        get_json(url, "/health", timeout=timeout)
    except EngineError as e:
        raise RouterError(f"--sglang-router-ip {ip} --sglang-router-port {port}: no router answers at {url} "
                          f"({e})") from None
    return url


# ------------------------------------------------------------------------------ registration
class RouterAdmin:
    """Register and remove engines at a router (sync; call from a thread in async code)."""

    def __init__(self, url: str, timeout: float = 30.0, log_path: Path | None = None):
        self.url = _norm(url)
        self.timeout = timeout
        self.log_path = log_path
        self.legacy = False  # True: the router only knows /add_worker, /remove_worker, /list_workers
        self._ids: dict[str, str] = {}

    def workers(self) -> dict[str, bool]:
        """{engine URL: healthy} of the workers the router lists."""
        if not self.legacy:
            try:
                data = get_json(self.url, "/workers", timeout=self.timeout)
                return {_norm(w["url"]): bool(w.get("is_healthy", True)) for w in data.get("workers", [])}
            except EngineError as e:
                if e.status not in (404, 405):
                    raise
                self.legacy = True
        data = get_json(self.url, "/list_workers", timeout=self.timeout)
        return {_norm(u): True for u in data.get("urls", [])}

    def add(self, engine_url: str, timeout: float = REGISTER_TIMEOUT) -> None:
        """Register `engine_url` and wait until the router lists it as healthy."""
        engine_url = _norm(engine_url)
        if not self.legacy:
            try:
                resp = post_json(self.url, "/workers", {"url": engine_url}, timeout=self.timeout)
                if resp.get("worker_id"):
                    self._ids[engine_url] = resp["worker_id"]
            except EngineError as e:
                if e.status not in (404, 405):
                    raise RouterError(f"router {self.url}: POST /workers {engine_url} failed: {e}") from None
                self.legacy = True
        if self.legacy:
            _urlopen(self.url, "POST", "/add_worker", self.timeout, params={"url": engine_url})
        deadline = time.monotonic() + timeout
        while True:
            if self.workers().get(engine_url):
                return
            if time.monotonic() > deadline:
                where = f"; router log: {self.log_path}" if self.log_path else ""
                raise RouterError(f"router {self.url} did not list engine {engine_url} as healthy within "
                                  f"{timeout:.0f}s{where}")
            time.sleep(0.1)

    def remove(self, engine_url: str, timeout: float = 30.0) -> None:
        """Take `engine_url` out of the router; returns once it is no longer listed."""
        engine_url = _norm(engine_url)
        if self.legacy:
            _urlopen(self.url, "POST", "/remove_worker", self.timeout, params={"url": engine_url})
        else:
            worker_id = self._ids.get(engine_url) or self._find_id(engine_url)
            if worker_id is None:
                return
            _urlopen(self.url, "DELETE", f"/workers/{worker_id}", self.timeout)
        deadline = time.monotonic() + timeout
        while engine_url in self.workers():
            if time.monotonic() > deadline:
                raise RouterError(f"router {self.url} still lists engine {engine_url} {timeout:.0f}s after removal")
            time.sleep(0.1)

    def _find_id(self, engine_url: str) -> str | None:
        data = get_json(self.url, "/workers", timeout=self.timeout)
        for w in data.get("workers", []):
            if _norm(w["url"]) == engine_url:
                return w.get("id")
        return None


# ------------------------------------------------------------------------------ pool
def _retryable(e: EngineError) -> bool:
    """A failure that a restarted engine or another engine can fix: no HTTP answer (connection
    refused/reset; not a timeout, which means the request itself is too slow) or an HTTP 5xx."""
    if e.status is None:
        return "timed out after" not in str(e)
    return e.status >= 500


class EnginePool:
    """The engines behind one router, as rollout code sees them.

    urls: the engines' own URLs (for `post_all` and fault tolerance); router_url: where
    `generate` goes; concurrency: requests in flight per engine (the semaphore holds
    concurrency x len(urls)); fault_tolerant: retry requests whose engine failed under them.
    """

    def __init__(self, urls: list[str], timeout: float, router_url: str | None = None, concurrency: int = 512,
                 fault_tolerant: bool = False):
        if not urls:
            raise ValueError("EnginePool needs at least one engine URL")
        if router_url is None:
            raise ValueError("EnginePool needs the router URL (slime always runs a router in front of its engines)")
        self.urls = [_norm(u) for u in urls]
        self.router_url = _norm(router_url)
        self.limit = concurrency * len(self.urls)
        self.fault_tolerant = fault_tolerant
        self.router = EngineClient(self.router_url, timeout=timeout)
        self.clients = {u: EngineClient(u, timeout=timeout) for u in self.urls}
        self.down: set[str] = set()  # engines out of the router (being restarted)
        self.fatal: BaseException | None = None  # set by the health monitor when it gives up
        self.in_flight = 0
        self.max_in_flight = 0
        self.retries = 0
        self._sem: asyncio.Semaphore | None = None
        self._admitted: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _state(self) -> tuple[asyncio.Semaphore, asyncio.Event]:
        loop = asyncio.get_running_loop()
        if self._sem is None or self._loop is not loop:  # made in the loop that runs the requests
            self._loop = loop
            self._sem = asyncio.Semaphore(self.limit)
            self._admitted = asyncio.Event()
            if len(self.down) < len(self.urls):
                self._admitted.set()
        return self._sem, self._admitted

    async def generate(self, payload: dict) -> dict:
        sem, admitted = self._state()
        async with sem:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                return await self._generate(payload, admitted)
            finally:
                self.in_flight -= 1

    async def _generate(self, payload: dict, admitted: asyncio.Event) -> dict:
        attempt = 0
        while True:
            if self.fatal is not None:
                raise self.fatal
            try:
                return await self.router.generate(payload)
            except EngineError as e:
                attempt += 1
                if not self.fault_tolerant or not _retryable(e) or attempt >= FT_MAX_ATTEMPTS:
                    raise
                self.retries += 1
                logger.warning("request failed (%s); retrying through the router (attempt %d of %d)",
                               e, attempt + 1, FT_MAX_ATTEMPTS)
                # wait until some engine is admitted (the monitor restarts the dead one meanwhile)
                await admitted.wait()
                await asyncio.sleep(min(2.0, 0.25 * attempt))

    async def post_all(self, path: str, json: dict | None = None) -> list[dict]:
        """POST to every admitted engine directly (an engine being restarted is skipped: it gets
        fresh state when it comes back)."""
        return [await self.clients[u].post(path, json) for u in self.urls if u not in self.down]

    def mark_down(self, url: str) -> None:
        self.down.add(_norm(url))
        if self._admitted is not None and len(self.down) == len(self.urls):
            self._admitted.clear()

    def mark_up(self, url: str) -> None:
        self.down.discard(_norm(url))
        if self._admitted is not None:
            self._admitted.set()

    def fail(self, err: BaseException) -> None:
        """The monitor gave up: every waiting and future request raises `err`."""
        self.fatal = err
        if self._admitted is not None:
            self._admitted.set()

    async def close(self) -> None:
        await self.router.close()
        for c in self.clients.values():
            await c.close()
