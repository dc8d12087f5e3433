"""The rollout side's engines as one object: servers, the router in front of them, the request pool,
health checks and restarts.

`EngineFleet(args, placement, loop)` lives in the RolloutManager. `start()` launches one
`EngineServer` Ray actor per engine on its placement bundle (the command of the run's engine kind,
`slime.engines.kinds`), starts sglang-router (or connects to `--sglang-router-ip/port`), registers
every engine and, with `--use-fault-tolerance`, starts the health monitor. The launch can happen
before the fleet exists (`launch_engines`, handed over as `launched=`): the RolloutManager's process
then starts beside its engines instead of before them. Then:

- `await fleet.generate(payload)`: one `/generate` through the router, at most
  `--sglang-server-concurrency` x engines in flight, retried under fault tolerance (`EnginePool`);
  rollout and custom code reach the engines this way (`slime.rollout.api.context().engines`);
- `await fleet.abort_all()`, `pause()`, `continue_generation()`: on every admitted engine;
- `release_memory(tags)`, `resume_memory(tags)` (colocation; returns the seconds it took),
  `resident_memory_mb()`;
- `await fleet.settle()`: return once no restart is in progress; `take_restart_count()`,
  `restart_events`, `pids()`;
- `close()`: monitor, pool, router (or deregistration from an external one), engine processes.

The trainer pushes weights to `fleet.urls` itself (`slime.training.weight_sync`); a restarted
engine gets them through the `give_weights(url, version)` callback the fleet is started with.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
from urllib.parse import urlparse

import psutil
import ray

from slime.engines.control import AsyncEngineControl, EngineControl, EngineError, normalize_url
from slime.engines.health import HealthMonitor
from slime.engines.kinds import POLICY_LORA_NAME, engine_kind
from slime.engines.launcher import EngineServer
from slime.engines.router import RouterAdmin, connect_router, start_router
from slime.utils.ray_calls import get

logger = logging.getLogger(__name__)

FT_MAX_ATTEMPTS = 10  # tries of one request under --use-fault-tolerance
SHUTDOWN_TIMEOUT_S = 60  # an engine's stop: SIGTERM to its process group, SIGKILL after 10 s


def _retryable(e: EngineError) -> bool:
    """A failure that a restarted engine or another engine can fix: no HTTP answer (connection
    refused/reset; not a timeout, which means the request itself is too slow) or an HTTP 5xx."""
    if e.status is None:
        return "timed out after" not in str(e)
    return e.status >= 500


class EnginePool:
    """The engines behind one router, as requests see them.

    urls: the engines' own URLs (for the calls on every engine and fault tolerance); router_url:
    where `generate` goes; concurrency: requests in flight per engine (the semaphore holds
    concurrency x len(urls)); fault_tolerant: retry requests whose engine failed under them;
    lora_name: the LoRA adapter every `/generate` uses unless it names one (`lora_path`), for
    --lora-sync adapter, where the engines hold the policy as the base plus that adapter;
    routed_experts: every `/generate` asks for the experts each token was routed to
    (`return_routed_experts`, --use-rollout-routing-replay) unless it says otherwise.
    """

    def __init__(self, urls: list[str], timeout: float, router_url: str, concurrency: int = 512,
                 fault_tolerant: bool = False, lora_name: str | None = None, routed_experts: bool = False):
        if not urls:
            raise ValueError("EnginePool needs at least one engine URL")
        self.urls = [normalize_url(u) for u in urls]
        self.router_url = normalize_url(router_url)
        self.limit = concurrency * len(self.urls)
        self.fault_tolerant = fault_tolerant
        self.lora_name = lora_name
        self.routed_experts = routed_experts
        self.router = AsyncEngineControl(self.router_url, timeout=timeout)
        self.engines = {u: AsyncEngineControl(u, timeout=timeout) for u in self.urls}
        self._direct = {u: 0 for u in self.urls}  # requests sent to each engine itself (`_post`)
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
        if self.lora_name is not None and payload.get("lora_path") is None:
            payload = {**payload, "lora_path": self.lora_name}
        if self.routed_experts and "return_routed_experts" not in payload:
            payload = {**payload, "return_routed_experts": True}
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
                return await self._post(payload)
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

    async def _post(self, payload: dict) -> dict:
        """One `/generate` through the router; a request asking for the routed experts goes to an engine
        itself (the admitted one with the fewest such requests in flight): sglang-router (0.3.x) drops
        request fields it does not know, `return_routed_experts` among them."""
        if not payload.get("return_routed_experts"):
            return await self.router.generate(payload)
        admitted = [u for u in self.urls if u not in self.down]
        if not admitted:
            raise EngineError("no engine is admitted (all are being restarted)")
        url = min(admitted, key=lambda u: self._direct[u])
        self._direct[url] += 1
        try:
            return await self.engines[url].generate(payload)
        finally:
            self._direct[url] -= 1

    async def on_each(self, call: Callable[[AsyncEngineControl], object]) -> list:
        """`call(engine)` on every admitted engine, in order (an engine being restarted is skipped:
        it gets fresh state when it comes back)."""
        return [await call(self.engines[u]) for u in self.urls if u not in self.down]

    def mark_down(self, url: str) -> None:
        self.down.add(normalize_url(url))
        if self._admitted is not None and len(self.down) == len(self.urls):
            self._admitted.clear()

    def mark_up(self, url: str) -> None:
        self.down.discard(normalize_url(url))
        if self._admitted is not None:
            self._admitted.set()

    def fail(self, err: BaseException) -> None:
        """The monitor gave up: every waiting and future request raises `err`."""
        self.fatal = err
        if self._admitted is not None:
            self._admitted.set()

    async def close(self) -> None:
        await self.router.close()
        for c in self.engines.values():
            await c.close()


@dataclass
class LaunchedEngines:
    """Engine actors whose start-up is under way (`launch_engines`), for the `EngineFleet` that will
    serve through them: `connect` waits for `starts`, one ref of each server's URL."""
    servers: list
    starts: list


def launch_engines(args, placement, name: str | None = None) -> LaunchedEngines:
    """Create one `EngineServer` actor per engine of the policy (or of the frozen model `name`, with
    `args` its `model_args`) on its placement bundle and start them all at once (each start-up is
    bounded by its health wait). Callable from any process: the driver launches the engines while the
    RolloutManager's process is still starting."""
    bundles = None if placement is None else (
        placement.engine_bundles if name is None else placement.model_bundles[name])
    server_cls = ray.remote(num_cpus=0)(EngineServer)
    prefix = "engine" if name is None else f"engine_{name}"
    servers = []
    for rank in range(args.num_engines):
        opts = {} if placement is None else {"scheduling_strategy": placement.strategy(bundles[rank])}
        servers.append(server_cls.options(**opts).remote(args, rank, f"{prefix}_{rank}"))
    return LaunchedEngines(servers, [s.start.remote() for s in servers])


class EngineFleet:
    """The engines of one served model (see the module docstring): the policy's, or with `name` those
    of a frozen model of `--sglang-config` (`args` is then `slime.engines.served_models.model_args`).
    `placement` is a `slime.ray.placement.Placement` (or None: Ray schedules the engine actors
    anywhere); `loop` the rollout's event loop, on which the pool's requests and the health monitor run;
    `launched` the engines `launch_engines` already started for it (None: `launch` starts them)."""

    def __init__(self, args, placement, loop: asyncio.AbstractEventLoop, name: str | None = None,
                 launched: LaunchedEngines | None = None):
        self.args = args
        self.placement = placement
        self.loop = loop
        self.name = name
        self.launched = launched  # the engines' actors and start-up calls, waited for by `connect`
        self.servers: list = list(launched.servers) if launched else []
        self.urls: list[str] = []
        self.pool: EnginePool | None = None
        self.router = None  # RouterAdmin
        self.router_process = None  # the sglang-router slime started (None: an external one)
        self.monitor: HealthMonitor | None = None
        self._monitor_future = None

    # ------------------------------------------------------------ start / stop
    def start(self, give_weights: Callable[[str, str], None]) -> list[str]:
        """Launch the engines, the router and (with --use-fault-tolerance) the health monitor;
        returns the engine URLs. `give_weights(url, version)` hands a restarted engine the weights."""
        self.launch()
        return self.connect(give_weights)

    def launch(self) -> None:
        """Start every engine's actor and its start-up (they run in parallel; `connect` waits for them),
        so several fleets start at once; nothing when `launch_engines` already did. The router is
        started by `connect`, in the calling thread: a process started from a thread that ends would
        die with it (`die_with_parent`)."""
        if self.launched is None:
            self.launched = launch_engines(self.args, self.placement, self.name)
            self.servers = list(self.launched.servers)

    def connect(self, give_weights: Callable[[str, str], None]) -> list[str]:
        """Start the router (or connect to `--sglang-router-ip/port`) while the engines `launch` started
        come up, wait for them, register them and start the health monitor; the engine URLs."""
        args = self.args
        log_path = Path(args.output_dir) / "logs" / ("router.log" if self.name is None else f"router_{self.name}.log")
        if args.sglang_router_ip is not None:
            router_url = connect_router(args.sglang_router_ip, args.sglang_router_port)
        else:
            self.router_process = start_router(log_path, args.rollout_request_timeout, args.engine_api_key)
            router_url = self.router_process.url
        self.urls = [get(ref, "engine start-up", self._who(rank), args.engine_startup_timeout + 60)
                     for rank, ref in enumerate(self.launched.starts)]
        self.router = RouterAdmin(router_url, log_path=log_path if self.router_process else None)
        for url in self.urls:
            self.router.add(url, timeout=args.engine_startup_timeout)
        self.pool = EnginePool(self.urls, timeout=args.rollout_request_timeout, router_url=router_url,
                               concurrency=args.sglang_server_concurrency, fault_tolerant=args.use_fault_tolerance,
                               lora_name=POLICY_LORA_NAME if args.lora_sync == "adapter" else None,
                               routed_experts=args.use_rollout_routing_replay)
        if args.use_fault_tolerance:
            self.monitor = HealthMonitor(self.pool, self.router, self.servers, self.urls,
                                         args.rollout_health_check_interval, args.rollout_health_check_timeout,
                                         give_weights)
            self._monitor_future = asyncio.run_coroutine_threadsafe(self.monitor.run(), self.loop)
        return self.urls

    def _who(self, rank: int) -> str:
        return f"EngineServer {rank}" if self.name is None else f"EngineServer {rank} of model {self.name}"

    @property
    def router_url(self) -> str | None:
        return self.pool.router_url if self.pool is not None else None

    def close(self) -> None:
        if self.monitor is not None:
            self.loop.call_soon_threadsafe(self.monitor.stop)
            try:
                self._monitor_future.result(timeout=30)
            except Exception:  # noqa: BLE001 - shutting down
                pass
            self.monitor = None
        if self.pool is not None:
            asyncio.run_coroutine_threadsafe(self.pool.close(), self.loop).result(timeout=30)
            self.pool = None
        if self.router_process is not None:
            self.router_process.stop()
        elif self.router is not None:  # an external router: do not leave our engines registered there
            for url in self.urls:
                try:
                    self.router.remove(url, timeout=10)
                except Exception:  # noqa: BLE001 - shutting down
                    pass
        self.router = self.router_process = None
        stops = [s.shutdown.remote() for s in self.servers]
        for rank, ref in enumerate(stops):
            get(ref, "shutdown", self._who(rank), SHUTDOWN_TIMEOUT_S)
        self.servers, self.launched = [], None

    # ------------------------------------------------------------ generation (on the rollout loop)
    async def generate(self, payload: dict) -> dict:
        """One `/generate` through the router (SGLang-native payload and answer)."""
        return await self.pool.generate(payload)

    async def abort_all(self) -> None:
        await self.pool.on_each(lambda e: e.abort())

    async def pause(self) -> None:
        """Hold every request in flight while the weights change (the kind's pause mode)."""
        mode = engine_kind(self.args).pause_mode
        await self.pool.on_each(lambda e: e.pause(mode))

    async def continue_generation(self) -> None:
        await self.pool.on_each(lambda e: e.continue_generation())

    # ------------------------------------------------------------ memory (blocking)
    def _each_engine(self, call: Callable[[EngineControl], object]) -> float:
        """`call` on every engine at once (blocking); the seconds it took."""
        start = time.perf_counter()
        timeout = self.args.stage_timeout or 600.0
        with ThreadPoolExecutor(max_workers=len(self.urls)) as pool:
            list(pool.map(lambda u: call(EngineControl(u, timeout=timeout)), self.urls))
        return time.perf_counter() - start

    def release_memory(self, tags: list[str] | None) -> float:
        return self._each_engine(lambda e: e.release_memory(tags))

    def resume_memory(self, tags: list[str] | None) -> float:
        return self._each_engine(lambda e: e.resume_memory(tags))

    def resident_memory_mb(self) -> float | None:
        """Total resident memory (MiB) of the engine processes, found by the port they listen on;
        None when any of them is not a process on this host (another node)."""
        ports = {urlparse(u).port for u in self.urls}
        pids = {c.laddr.port: c.pid for c in psutil.net_connections(kind="tcp")
                if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port in ports and c.pid}
        if set(pids) != ports:
            return None
        try:
            return sum(psutil.Process(pid).memory_info().rss for pid in set(pids.values())) / 2**20
        except psutil.Error:
            return None

    # ------------------------------------------------------------ fault tolerance
    async def settle(self) -> None:
        """--use-fault-tolerance: check every engine now and return once no restart is in progress."""
        if self.monitor is not None:
            await self.monitor.settle()

    def take_restart_count(self) -> int | None:
        """Restarts begun since the last call (None without --use-fault-tolerance)."""
        return self.monitor.take_restart_count() if self.monitor is not None else None

    @property
    def restart_events(self) -> list[dict]:
        return list(self.monitor.events) if self.monitor is not None else []

    def pids(self) -> list[int | None]:
        return [get(s.pid.remote(), "engine pids", self._who(rank), 30) for rank, s in enumerate(self.servers)]
