"""The engine client (slime.engines.control), async and blocking: retries, timeouts, error messages;
and a round trip against the real native engine served by `python -m slime.engines.native`."""

from __future__ import annotations

import asyncio
import gc
import subprocess
import sys
import threading
import time
import warnings

import pytest
from aiohttp import web

from slime.engines.control import AsyncEngineControl, EngineControl, EngineError
from slime.engines.startup import wait_until_healthy
from slime.utils.net import free_port


class FakeEngine:
    """An aiohttp server in a background thread with scripted endpoints and hit counters."""

    def __init__(self):
        self.hits: dict[str, int] = {}
        self.flaky_failures = 2
        self.last_body = None
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _count(self, request):
        self.hits[request.path] = self.hits.get(request.path, 0) + 1
        return self.hits[request.path]

    def _app(self):
        async def health(request):
            self._count(request)
            return web.json_response({"status": "ok"})

        async def generate(request):
            self._count(request)
            body = await request.json()
            return web.json_response({"text": "hi", "output_ids": [1], "meta_info": {"echo": body}})

        async def bad(request):
            self._count(request)
            return web.json_response({"error": {"message": "sampling_params.top_p: must be in (0, 1]"}}, status=400)

        async def flaky(request):
            n = self._count(request)
            if n <= self.flaky_failures:
                return web.json_response({"error": {"message": "overloaded"}}, status=503)
            return web.json_response({"ok": n})

        async def slow(request):
            self._count(request)
            await asyncio.sleep(5)
            return web.json_response({})

        async def text(request):
            self._count(request)
            return web.Response(text="Cache flushed.")

        async def empty(request):
            self._count(request)
            return web.Response(status=200)

        async def upload(request):
            self._count(request)
            data = await request.read()
            self.last_body = data
            return web.json_response({"n": len(data), "query": dict(request.query),
                                      "ctype": request.content_type})

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_post("/generate", generate)
        app.router.add_route("*", "/bad", bad)
        app.router.add_route("*", "/flaky", flaky)
        app.router.add_route("*", "/slow", slow)
        app.router.add_route("*", "/text", text)
        app.router.add_route("*", "/empty", empty)
        app.router.add_post("/upload", upload)
        return app

    def _run(self):
        asyncio.set_event_loop(self._loop)
        self._runner = web.AppRunner(self._app(), shutdown_timeout=0.2)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())
        self._loop.close()

    def start(self):
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def stop(self):
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@pytest.fixture
def fake():
    f = FakeEngine().start()
    yield f
    f.stop()


def _fast_client(url, **kw) -> AsyncEngineControl:
    c = AsyncEngineControl(url, **kw)
    c.backoff_base = 0.01
    return c


async def _and_close(client, coro):
    try:
        return await coro
    finally:
        await client.close()


def test_generate_get_post_and_session_reuse(fake):
    async def main():
        c = _fast_client(fake.url)
        try:
            out = await c.generate({"input_ids": [1, 2]})
            s1 = c._session
            assert (await c.health()) == {"status": "ok"}
            assert (await c.request("POST", "/text", json={})) == {"text": "Cache flushed."}
            assert (await c.request("POST", "/empty")) == {}
            assert c._session is s1
            return out
        finally:
            await c.close()

    out = asyncio.run(main())
    assert out["meta_info"]["echo"] == {"input_ids": [1, 2]}
    # a client can be reused from a new event loop (a fresh session is made there)
    c = _fast_client(fake.url)
    assert asyncio.run(_and_close(c, c.health())) == {"status": "ok"}
    assert asyncio.run(_and_close(c, c.health())) == {"status": "ok"}
    # ... even if it was not closed in the old one (the stale session is dropped)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        assert asyncio.run(c.health()) == {"status": "ok"}
        assert asyncio.run(_and_close(c, c.health())) == {"status": "ok"}
        gc.collect()
    assert fake.hits["/health"] == 5


def test_4xx_is_not_retried_and_names_everything(fake):
    c = _fast_client(fake.url, max_retries=3)
    with pytest.raises(EngineError) as ei:
        asyncio.run(_and_close(c, c.request("POST", "/bad", json={"x": 1})))
    msg = str(ei.value)
    assert fake.url in msg and "/bad" in msg and "400" in msg and "sampling_params.top_p" in msg
    assert ei.value.status == 400 and ei.value.endpoint == "/bad"
    assert ei.value.server_message == "sampling_params.top_p: must be in (0, 1]"
    assert fake.hits["/bad"] == 1


def test_5xx_is_retried(fake):
    c = _fast_client(fake.url, max_retries=3)
    assert asyncio.run(_and_close(c, c.request("POST", "/flaky", json={}))) == {"ok": 3}
    assert fake.hits["/flaky"] == 3
    fake.hits.clear()
    c = _fast_client(fake.url, max_retries=1)
    with pytest.raises(EngineError) as ei:
        asyncio.run(_and_close(c, c.request("POST", "/flaky", json={})))
    assert ei.value.status == 503 and "overloaded" in str(ei.value) and "2 attempts" in str(ei.value)
    assert fake.hits["/flaky"] == 2


def test_timeout_raises_instead_of_hanging(fake):
    c = _fast_client(fake.url, timeout=0.5)
    t0 = time.monotonic()
    with pytest.raises(EngineError, match="timed out") as ei:
        asyncio.run(_and_close(c, c.request("GET", "/slow")))
    assert time.monotonic() - t0 < 3
    assert "/slow" in str(ei.value) and fake.hits["/slow"] == 1  # a read timeout is not retried


def test_connection_refused_is_retried_then_raises():
    url = f"http://127.0.0.1:{free_port()}"
    c = _fast_client(url, max_retries=2, connect_timeout=1)
    t0 = time.monotonic()
    with pytest.raises(EngineError) as ei:
        asyncio.run(_and_close(c, c.generate({"input_ids": [1]})))
    assert time.monotonic() - t0 < 5
    msg = str(ei.value)
    assert url in msg and "/generate" in msg and "connection" in msg.lower() and "3 attempts" in msg
    assert ei.value.status is None


def test_blocking_client(fake):
    assert EngineControl(fake.url, timeout=5).health() == {"status": "ok"}
    out = EngineControl(fake.url, timeout=5).request("POST", "/upload", data=b"\x00\x01abc",
                                                     params={"weight_version": "3", "flush_cache": False})
    assert out == {"n": 5, "query": {"weight_version": "3", "flush_cache": "false"},
                   "ctype": "application/octet-stream"}
    assert fake.last_body == b"\x00\x01abc"
    with pytest.raises(EngineError) as ei:
        EngineControl(fake.url, timeout=5).request("POST", "/bad", json={})
    assert ei.value.status == 400 and "sampling_params.top_p" in str(ei.value) and fake.url in str(ei.value)
    with pytest.raises(EngineError, match="/health"):
        EngineControl(f"http://127.0.0.1:{free_port()}", timeout=2).health()
    # max_retries retries a 5xx in the blocking client too (none by default)
    fake.hits.clear()
    flaky = EngineControl(fake.url, timeout=5, max_retries=3)
    flaky.backoff_base = 0.01
    assert flaky.request("POST", "/flaky", json={}) == {"ok": 3} and fake.hits["/flaky"] == 3
    wait_until_healthy(fake.url, timeout=5)


def test_wait_until_healthy_failures():
    url = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(EngineError) as ei:
        wait_until_healthy(url, timeout=0.6)
    assert url in str(ei.value) and time.monotonic() - t0 < 3
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    try:
        with pytest.raises(EngineError) as ei:
            wait_until_healthy(url, timeout=30, process=proc)
        assert url in str(ei.value) and "code 3" in str(ei.value)
    finally:
        proc.kill()
        proc.wait()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(EngineError, match="still running"):
            wait_until_healthy(url, timeout=0.5, process=sleeper)
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.fixture(scope="module")
def native_server(tiny_model_dir, tmp_path_factory):
    from tests.helpers.native_server import native_server as serve

    with serve(tiny_model_dir, tmp_path_factory.mktemp("engine") / "engine.log") as (url, _):
        yield url


def test_client_against_native_engine(native_server):
    async def main():
        async with AsyncEngineControl(native_server, timeout=60) as c:
            outs = await asyncio.gather(*[
                c.generate({"input_ids": [5, 6, i + 7], "return_logprob": True,
                            "sampling_params": {"max_new_tokens": 6, "ignore_eos": True, "seed": i}})
                for i in range(8)
            ])
            with pytest.raises(EngineError) as ei:
                await c.generate({"input_ids": [5], "sampling_params": {"top_p": 2}})
            info = await c.model_info()
            return outs, ei.value, info

    outs, err, info = asyncio.run(main())
    assert all(len(o["output_ids"]) == 6 and len(o["meta_info"]["output_token_logprobs"]) == 6 for o in outs)
    assert err.status == 400 and "sampling_params.top_p" in str(err) and native_server in str(err)
    assert info["is_generation"] is True


def test_clients_ignore_proxies_of_the_environment(fake, monkeypatch):
    """A proxy in the environment (here one that refuses connections) does not reroute calls to the
    run's servers: urllib's default opener would go through it."""
    import urllib.error
    import urllib.request

    dead = f"http://127.0.0.1:{free_port()}"
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "all_proxy"):
        monkeypatch.setenv(name, dead)
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(urllib.error.URLError):  # the bad case: a default opener uses the environment's proxy
        urllib.request.build_opener().open(fake.url + "/health", timeout=5)
    assert EngineControl(fake.url, timeout=5).health() == {"status": "ok"}
    wait_until_healthy(fake.url, timeout=5)
    c = AsyncEngineControl(fake.url, timeout=5, max_retries=0)
    assert asyncio.run(_and_close(c, c.health())) == {"status": "ok"}


def test_health_wait_refuses_a_foreign_server_on_the_port(fake):
    """The process started for a port is not the one answering on it (another took the port first):
    a ForeignListener naming the port, not a healthy engine."""
    from slime.engines.startup import ForeignListener

    port = int(fake.url.rsplit(":", 1)[1])
    ours = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with pytest.raises(ForeignListener, match=rf"{fake.url} answers, but not from the server started for it "
                                                  rf"\(pid {ours.pid}\): another process listens on port {port}"):
            wait_until_healthy(fake.url, timeout=5, process=ours)
    finally:
        ours.kill()
        ours.wait()


def test_health_wait_accepts_the_started_server():
    port = free_port()
    code = ("import http.server as h\n"
            "class H(h.BaseHTTPRequestHandler):\n"
            "    def do_GET(self):\n"
            "        self.send_response(200); self.send_header('Content-Type', 'application/json'); self.end_headers()\n"
            "        self.wfile.write(b'{}')\n"
            f"h.HTTPServer(('127.0.0.1', {port}), H).serve_forever()\n")
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        wait_until_healthy(f"http://127.0.0.1:{port}", timeout=20, process=proc)
    finally:
        proc.kill()
        proc.wait()
