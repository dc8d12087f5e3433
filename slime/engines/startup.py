"""Waiting for a server slime started: `wait_until_healthy` polls its `/health` until it answers,
fails at once when the process exits, and with the process given accepts the answer only from
that process (a `ForeignListener` otherwise: another process took the port first)."""

from __future__ import annotations

import subprocess
import time
import urllib.parse

from slime.engines.control import EngineControl, EngineError, Route, normalize_url
from slime.utils.processes import listens_on


class ForeignListener(EngineError):
    """The server answering on a port is not the process that was started for it."""


def wait_until_healthy(url: str, timeout: float, process: subprocess.Popen | None = None,
                       poll_interval: float = 0.25) -> None:
    """Poll GET /health until it answers 200. Raises EngineError naming the URL when the timeout
    expires, or at once (with its exit code) when `process` exits first. With `process`, the
    answer must come from it: a 200 from another process listening on the port (one that took the
    port first) is a ForeignListener."""
    base = normalize_url(url)
    deadline = time.monotonic() + timeout
    last = "no answer yet"
    while True:
        if process is not None and process.poll() is not None:
            raise EngineError(f"server at {base} exited with code {process.returncode} before becoming healthy "
                              f"(last: {last})", url=base, endpoint=Route.HEALTH.path)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            extra = ""
            if process is not None:
                rc = process.poll()
                extra = f"; process {'is still running' if rc is None else f'exited with code {rc}'}"
            raise EngineError(f"server at {base} not healthy after {timeout:.1f}s (GET /health: {last}){extra}",
                              url=base, endpoint=Route.HEALTH.path)
        try:
            EngineControl(base, timeout=max(0.1, min(5.0, remaining))).health()
        except EngineError as e:
            last = str(e)
        else:
            port = urllib.parse.urlsplit(base).port
            if process is None or port is None or listens_on(process, port) is not False:
                return
            raise ForeignListener(f"{base} answers, but not from the server started for it (pid {process.pid}): "
                                  f"another process listens on port {port}", url=base, endpoint=Route.HEALTH.path)
        time.sleep(max(0.0, min(poll_interval, deadline - time.monotonic())))
