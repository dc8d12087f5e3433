"""sglang-router in front of native engines (slime.engines.router): requests spread over the
engines, --sglang-server-concurrency bounds what each engine has in flight, registration and
removal, and clear errors for a router that is not there."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import pytest
from aiohttp import web

from slime.engines.auth import env_api_key
from slime.engines.control import EngineControl
from slime.engines.fleet import EnginePool
from slime.engines.router import RouterAdmin, RouterError, connect_router, start_router
from tests.helpers.native_server import free_port, native_server

pytest.importorskip("sglang_router")


class CountingProxy:
    """Forwards every request to one engine and counts the /generate calls it has in flight."""

    def __init__(self, target: str):
        self.target = target
        self.in_flight = 0
        self.max_in_flight = 0
        self.generated = 0
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        counted = request.path == "/generate"
        if counted:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            async with self.session.request(request.method, self.target + request.path_qs, data=body,
                                            headers={"Content-Type": request.content_type,
                                                     # the router passes the run's key on to its workers
                                                     **({"Authorization": request.headers["Authorization"]}
                                                        if "Authorization" in request.headers else {})}) as resp:
                data = await resp.read()
                return web.Response(body=data, status=resp.status, content_type=resp.content_type)
        finally:
            if counted:
                self.in_flight -= 1
                self.generated += 1

    async def start(self) -> None:
        self.session = aiohttp.ClientSession()
        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        await self.session.close()
        await self.runner.cleanup()


@pytest.fixture(scope="module")
def two_engines(tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("engines")
    with native_server(tiny_model_dir, logs / "e0.log") as (u0, _), \
            native_server(tiny_model_dir, logs / "e1.log") as (u1, _):
        yield [u0, u1]


@pytest.fixture
def router(tmp_path):
    r = start_router(tmp_path / "logs" / "router.log", request_timeout=120, api_key=env_api_key())
    try:
        yield r
    finally:
        r.stop()


def _payload(i: int, max_new_tokens: int = 12) -> dict:
    # distinct prompts; ignore_eos so every request generates max_new_tokens tokens
    return {"input_ids": [5 + (i * 7 + k) % 40 for k in range(6 + i % 5)], "return_logprob": True,
            "sampling_params": {"temperature": 1.0, "max_new_tokens": max_new_tokens, "ignore_eos": True,
                                "sampling_seed": i}}


@pytest.mark.parametrize("per_engine", [1, 3])
def test_requests_spread_over_engines_and_per_engine_concurrency_holds(two_engines, router, per_engine):
    async def main():
        proxies = [CountingProxy(u) for u in two_engines]
        for p in proxies:
            await p.start()
        admin = RouterAdmin(router.url)
        try:
            for p in proxies:
                await asyncio.to_thread(admin.add, p.url)
            assert set(await asyncio.to_thread(admin.workers)) == {p.url for p in proxies}
            pool = EnginePool([p.url for p in proxies], timeout=120, router_url=router.url, concurrency=per_engine)
            outs = await asyncio.gather(*(pool.generate(_payload(i)) for i in range(24)))
            await pool.close()
            return proxies, pool, outs
        finally:
            for p in proxies:
                await p.stop()

    proxies, pool, outs = asyncio.run(main())
    assert all(len(o["output_ids"]) == 12 and len(o["meta_info"]["output_token_logprobs"]) == 12 for o in outs)
    counts = [p.generated for p in proxies]
    assert sum(counts) == 24 and min(counts) >= 4, counts  # both engines served a real share
    peaks = [p.max_in_flight for p in proxies]
    # at most N in flight on one engine, give or take one: the router counts a request finished a
    # moment after the client saw its answer, so the client's next request may still see the old
    # load (measured: a peak of N + 1 in about 1 of 6 runs, before and after the engine key)
    assert max(peaks) <= per_engine + 1, peaks
    assert pool.max_in_flight == 2 * per_engine  # the client semaphore (N x engines) was the binding limit
    print(f"N={per_engine}: requests per engine {counts}, peak in flight per engine {peaks}")


def test_removed_engine_gets_no_requests_and_comes_back(two_engines, router):
    admin = RouterAdmin(router.url)
    for u in two_engines:
        admin.add(u)
    before = [EngineControl(u).server_info()["total_requests"] for u in two_engines]
    admin.remove(two_engines[1])
    assert set(admin.workers()) == {two_engines[0].rstrip("/")}

    async def run(n):
        pool = EnginePool(two_engines, timeout=60, router_url=router.url, concurrency=4)
        outs = await asyncio.gather(*(pool.generate(_payload(i, 4)) for i in range(n)))
        await pool.close()
        return outs

    asyncio.run(run(8))
    mid = [EngineControl(u).server_info()["total_requests"] for u in two_engines]
    assert mid[0] - before[0] == 8 and mid[1] == before[1]
    admin.add(two_engines[1])
    asyncio.run(run(16))
    after = [EngineControl(u).server_info()["total_requests"] for u in two_engines]
    assert after[1] > mid[1] and (after[0] - mid[0]) + (after[1] - mid[1]) == 16


def test_router_ignores_proxies_of_the_environment(two_engines, tmp_path, monkeypatch):
    """With a proxy in the environment (one that refuses connections), the router slime starts and
    the clients that talk to it and to the engines still reach them directly."""
    dead = f"http://127.0.0.1:{free_port()}"
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.setenv(name, dead)
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    r = start_router(tmp_path / "router.log", request_timeout=60, api_key=env_api_key())
    try:
        RouterAdmin(r.url).add(two_engines[0], timeout=30)

        async def run():
            pool = EnginePool(two_engines[:1], timeout=60, router_url=r.url, concurrency=2)
            outs = await asyncio.gather(*(pool.generate(_payload(i, 4)) for i in range(4)))
            await pool.close()
            return outs

        assert [len(o["output_ids"]) for o in asyncio.run(run())] == [4, 4, 4, 4]
    finally:
        r.stop()


def test_bad_router_address_is_a_clear_error():
    port = free_port()  # nothing listens there
    with pytest.raises(RouterError, match=rf"--sglang-router-ip 127\.0\.0\.1 --sglang-router-port {port}: "
                                          rf"no router answers at http://127\.0\.0\.1:{port}"):
        connect_router("127.0.0.1", port, timeout=2)


def test_router_that_refuses_the_key_is_a_clear_error(tmp_path, router):
    """An external router started with another --api-key: one line naming it and what to do; the
    run's own router (started with the run's key) is accepted."""
    other = start_router(tmp_path / "other.log", request_timeout=30, api_key="another-run-key-0123456789")
    try:
        port = int(other.url.rsplit(":", 1)[1])
        with pytest.raises(RouterError, match=rf"--sglang-router-ip 127\.0\.0\.1 --sglang-router-port {port}: the "
                                              r"router at http://127\.0\.0\.1:\d+ refuses the run's engine key \(HTTP 401\); "
                                              r"start it with --api-key set to this run's --engine-api-key"):
            connect_router("127.0.0.1", port)
    finally:
        other.stop()
    assert connect_router("127.0.0.1", int(router.url.rsplit(":", 1)[1])) == router.url


def test_engine_the_router_cannot_reach_is_a_clear_error(router):
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(RouterError, match=rf"did not list engine {dead} as healthy within 3s"):
        RouterAdmin(router.url).add(dead, timeout=3)


def test_router_dies_with_its_owner(tmp_path):
    """The router process gets SIGKILL when the process that started it dies."""
    import subprocess
    import sys
    import time

    import psutil

    code = (f"from slime.engines.router import start_router\n"
            f"r = start_router({str(tmp_path / 'router.log')!r}, 60, None)\n"
            f"print(r.process.pid, flush=True)\n"
            f"import time; time.sleep(600)\n")
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        router_pid = int(owner.stdout.readline())
        assert psutil.pid_exists(router_pid)
        owner.kill()
        owner.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(psutil.NoSuchProcess):
                if psutil.Process(router_pid).status() == psutil.STATUS_ZOMBIE:
                    break
            if not psutil.pid_exists(router_pid):
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"router pid {router_pid} outlived its owner")
    finally:
        if owner.poll() is None:
            owner.kill()
