"""Engine health monitor for `--use-fault-tolerance`.

Every `--rollout-health-check-interval` seconds each admitted engine is checked: its process
must be alive (asked of its `EngineServer` actor) and `GET /health` must answer within
`--rollout-health-check-timeout` seconds. An engine that fails is

1. taken out: out of the pool's calls on every engine (`slime.engines.fleet.EnginePool`) and
   removed from the router, so no new request reaches it;
2. restarted by its `EngineServer` (SIGKILL, then the same command on the same port, so the
   URLs the trainer pushes weights to stay valid);
3. given the current weights (`give_weights(url, version)`: the rollout manager asks the
   attached trainer to push its weights to that URL, and with `--check-weight-update-equal`
   to verify them) before it serves anything;
4. registered with the router again.

Requests that were in flight on it fail (connection reset, or HTTP 5xx from the router) and
`EnginePool` retries them through the router. The weight version given is the one the other
engines serve (or, with no other engine up, the last one this engine reported on `/health`).

An engine that cannot be restarted, or that needed more than `max_restarts` restarts in one
run, ends the run: every pending and later request raises the error.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import ray

from slime.engines.control import AsyncEngineControl, EngineControl, EngineError
from slime.utils.errors import RunFailure

logger = logging.getLogger(__name__)


class EngineRestartError(RunFailure):
    """--use-fault-tolerance could not bring an engine back."""


class HealthMonitor:
    """pool: the fleet's `EnginePool`; admin: its `RouterAdmin`; servers[i] is the `EngineServer` actor
    handle of the engine at urls[i]."""

    def __init__(self, pool, admin, servers: list, urls: list[str], interval: float,
                 timeout: float, give_weights: Callable[[str, str], None], max_restarts: int = 10):
        self.pool = pool
        self.admin = admin
        self.servers = list(servers)
        self.urls = [u.rstrip("/") for u in urls]
        self.interval = interval
        self.timeout = timeout
        self.give_weights = give_weights
        self.max_restarts = max_restarts
        self.clients = [AsyncEngineControl(u, timeout=timeout, connect_timeout=min(timeout, 10.0), max_retries=0)
                        for u in self.urls]
        self.versions: dict[str, str] = {}  # last weight version each engine reported on /health
        self.restarts = [0] * len(self.urls)  # per engine, whole run
        self.events: list[dict] = []  # one per restart: rank, url, reason, seconds, weight_version
        self._unread = 0  # restarts not yet reported by take_restart_count()
        self._restarting: dict[int, asyncio.Task] = {}
        self._stop = asyncio.Event()

    # ------------------------------------------------------------------ checks
    async def check(self, i: int) -> str | None:
        """None when engine i is healthy, else why not."""
        try:
            alive = await asyncio.to_thread(ray.get, self.servers[i].is_alive.remote(), timeout=self.timeout)
        except Exception as e:  # noqa: BLE001 - the actor itself is gone or stuck
            return f"its EngineServer actor did not answer ({type(e).__name__}: {e})"
        if not alive:
            return "its process exited"
        try:
            body = await self.clients[i].health()
        except EngineError as e:
            return f"GET /health failed: {e}"
        if isinstance(body, dict) and body.get("weight_version") is not None:
            self.versions[self.urls[i]] = str(body["weight_version"])
        return None

    def current_version(self, url: str) -> str:
        """The weight version a restarted engine must serve: what the admitted engines serve."""
        seen = []
        for other in self.urls:
            if other == url or other in self.pool.down:
                continue
            try:
                seen.append(EngineControl(other, timeout=self.timeout).weight_version())
            except (EngineError, KeyError, TypeError):
                continue
        if seen:
            return max(seen, key=lambda v: (v.isdigit(), int(v) if v.isdigit() else 0, v))
        return self.versions.get(url, "0")

    # ------------------------------------------------------------------ restart
    async def restart(self, i: int, reason: str) -> None:
        url = self.urls[i]
        start = time.perf_counter()
        self.restarts[i] += 1
        if self.restarts[i] > self.max_restarts:
            raise EngineRestartError(f"engine {i} at {url} failed again ({reason}) after {self.max_restarts} "
                                     "restarts in this run; giving up (--use-fault-tolerance)")
        logger.warning("engine %d at %s is unhealthy (%s): restarting it (--use-fault-tolerance)", i, url, reason)
        self._unread += 1  # counted in the rollout during which the failure was found
        version = await asyncio.to_thread(self.current_version, url)
        self.pool.mark_down(url)
        try:
            await asyncio.to_thread(self.admin.remove, url)
        except EngineError as e:  # the router may already have dropped it; go on
            logger.warning("could not remove engine %s from the router: %s", url, e)
        try:
            await asyncio.to_thread(ray.get, self.servers[i].restart.remote())
        except Exception as e:  # noqa: BLE001
            raise EngineRestartError(f"engine {i} at {url} ({reason}) could not be restarted: {e}") from None
        await asyncio.to_thread(self.give_weights, url, version)
        await asyncio.to_thread(self.admin.add, url)
        self.pool.mark_up(url)
        self.versions[url] = version
        self.events.append({"rank": i, "url": url, "reason": reason, "weight_version": version,
                            "seconds": time.perf_counter() - start})
        logger.warning("engine %d at %s is back with weight version %s after %.1f s", i, url, version,
                       time.perf_counter() - start)

    async def _restart_task(self, i: int, reason: str) -> None:
        try:
            await self.restart(i, reason)
        except Exception as e:  # noqa: BLE001 - every request waiting on the pool gets it
            err = e if isinstance(e, RunFailure) else EngineRestartError(
                f"engine {i} at {self.urls[i]}: restart failed: {type(e).__name__}: {e}")
            logger.error("%s", err)
            self.pool.fail(err)
            self._stop.set()
        finally:
            self._restarting.pop(i, None)

    # ------------------------------------------------------------------ loop
    async def check_all(self) -> None:
        """One round: check every engine not being restarted; start a restart for each that fails."""
        todo = [i for i in range(len(self.urls)) if i not in self._restarting]
        reasons = await asyncio.gather(*(self.check(i) for i in todo))
        for i, reason in zip(todo, reasons):
            if reason is not None and not self._stop.is_set() and i not in self._restarting:
                self._restarting[i] = asyncio.create_task(self._restart_task(i, reason))

    async def settle(self) -> None:
        """Check every engine now and wait until no restart is in progress (raises when one failed)."""
        await self.check_all()
        while self._restarting:
            await asyncio.gather(*list(self._restarting.values()), return_exceptions=True)
        if self.pool.fatal is not None:
            raise self.pool.fatal

    async def run(self) -> None:
        """Check every interval until `stop()`; restarts run as tasks so other engines keep being checked."""
        while not self._stop.is_set():
            try:
                await asyncio.wait_for(self._stop.wait(), timeout=self.interval)
                break
            except asyncio.TimeoutError:
                pass
            await self.check_all()
        for task in list(self._restarting.values()):
            task.cancel()
        for c in self.clients:
            await c.close()

    def stop(self) -> None:
        self._stop.set()

    def take_restart_count(self) -> int:
        """Restarts begun since the last call (the rollout metric `rollout/engine_restarts`)."""
        n, self._unread = self._unread, 0
        return n
