"""The router in front of the engines: sglang-router (the Rust router from PyPI).

slime always puts a router in front of its engines, one engine or many, as the original
slime does: rollout requests go to the router URL, and agent code can use that one URL too.

- `start_router(log_path, request_timeout, api_key)` starts `python -m sglang_router.launch_router`
  bound to this node's address (127.0.0.1 on a local run) on a free port, its metrics on the same
  address, requiring the run's engine key (`--api-key`: sglang-router then refuses requests without
  it, except `/health`, and sends it to the engines); its log goes to
  `<output-dir>/logs/router.log`; the process gets
  SIGKILL when its owner dies and is stopped by `RouterProcess.stop()`. With
  `--sglang-router-ip/--sglang-router-port` slime uses that running router instead
  (`connect_router`) and starts none.
- `RouterAdmin` registers and removes engines (`slime.engines.control.RouterControl`:
  `POST /workers`, registration is asynchronous, so it polls the worker list until the engine is
  listed healthy; older routers get `/add_worker`).

Per-engine concurrency: the started router runs the `cache_aware` policy with both balance
thresholds at their minimum (`--balance-abs-threshold 0 --balance-rel-threshold 1.0`), so a
request goes to the least-loaded engine whenever loads differ (prefix-cache affinity decides
ties). Together with the fleet's client semaphore of N x engines (`slime.engines.fleet.EnginePool`)
this keeps every engine at about N requests in flight: N, or N + 1 for a moment when the router
has not yet counted a finished request (measured by the router tests). An external
router keeps its own policy; there only the total (N x slime's engines) is bounded.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from slime.engines.control import EngineControl, EngineError, RouterControl, normalize_url
from slime.engines.startup import wait_until_healthy
from slime.utils.errors import RunFailure, SlimeConfigError
from slime.utils.net import free_port, node_address, without_proxies
from slime.utils.processes import die_with_parent, stop_process_group

logger = logging.getLogger(__name__)

REGISTER_TIMEOUT = 120.0


class RouterError(RunFailure):
    """The router could not be started, reached, or could not register an engine."""


# ------------------------------------------------------------------------------ process
def router_command(host: str, port: int, prometheus_port: int, request_timeout: float,
                   api_key: str | None) -> list[str]:
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
        *(["--api-key", api_key] if api_key else []),
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
        stop_process_group(self.process)
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


def start_router(log_path: str | Path, request_timeout: float, api_key: str | None,
                 startup_timeout: float = 60.0) -> RouterProcess:
    """Start sglang-router on a free port of this node; wait until `/health` answers."""
    if importlib.util.find_spec("sglang_router") is None:
        raise SlimeConfigError("slime runs its engines behind sglang-router; install it: pip install sglang-router")
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    host = node_address()
    port = free_port(host)
    cmd = router_command(host, port, free_port(host), request_timeout, api_key)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=die_with_parent, env=dict(without_proxies(os.environ), NO_COLOR="1"))
    router = RouterProcess(proc, f"http://{host}:{port}", log_path)
    try:
        wait_until_healthy(router.url, startup_timeout, process=proc, poll_interval=0.2)
    except EngineError as e:
        exited = proc.poll() is not None
        router.stop()
        if exited:
            raise RouterError(f"sglang-router exited with code {proc.returncode} at start-up; last output of "
                              f"{log_path}:\n{_log_tail(log_path)}") from None
        raise RouterError(f"sglang-router at {router.url} not healthy after {startup_timeout:.0f}s ({e}); "
                          f"log: {log_path}") from None
    return router


def connect_router(ip: str, port: int, timeout: float = 10.0) -> str:
    """URL of the running router named by --sglang-router-ip/--sglang-router-port; a clear error when
    nothing answers there or it refuses the run's engine key."""
    url = normalize_url(f"{ip}:{port}")
    where = f"--sglang-router-ip {ip} --sglang-router-port {port}"
    try:
        EngineControl(url, timeout=timeout).health()
    except EngineError as e:
        raise RouterError(f"{where}: no router answers at {url} ({e})") from None
    try:
        RouterControl(url, timeout=timeout).workers()
    except EngineError as e:
        if e.status in (401, 403):
            raise RouterError(f"{where}: the router at {url} refuses the run's engine key (HTTP {e.status}); "
                              "start it with --api-key set to this run's --engine-api-key") from None
        raise RouterError(f"{where}: the router at {url} does not list its workers ({e})") from None
    return url


# ------------------------------------------------------------------------------ registration
class RouterAdmin:
    """Register and remove engines at a router (blocking; call from a thread in async code)."""

    def __init__(self, url: str, timeout: float = 30.0, log_path: Path | None = None):
        self.control = RouterControl(url, timeout=timeout)
        self.url = self.control.base_url
        self.log_path = log_path
        self._ids: dict[str, str] = {}

    def workers(self) -> dict[str, bool]:
        """{engine URL: healthy} of the workers the router lists."""
        return {normalize_url(w["url"]): bool(w.get("is_healthy", True)) for w in self.control.workers()}

    def add(self, engine_url: str, timeout: float = REGISTER_TIMEOUT) -> None:
        """Register `engine_url` and wait until the router lists it as healthy."""
        engine_url = normalize_url(engine_url)
        try:
            resp = self.control.add_worker(engine_url)
        except EngineError as e:
            raise RouterError(f"router {self.url}: registering engine {engine_url} failed: {e}") from None
        if isinstance(resp, dict) and resp.get("worker_id"):
            self._ids[engine_url] = resp["worker_id"]
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
        engine_url = normalize_url(engine_url)
        worker_id = self._ids.get(engine_url) or self._find_id(engine_url)
        if worker_id is None and not self.control.legacy:
            return
        self.control.remove_worker(engine_url, worker_id)
        deadline = time.monotonic() + timeout
        while engine_url in self.workers():
            if time.monotonic() > deadline:
                raise RouterError(f"router {self.url} still lists engine {engine_url} {timeout:.0f}s after removal")
            time.sleep(0.1)

    def _find_id(self, engine_url: str) -> str | None:
        for w in self.control.workers():
            if normalize_url(w["url"]) == engine_url:
                return w.get("id")
        return None
