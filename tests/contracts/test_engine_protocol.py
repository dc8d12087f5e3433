"""The SGLang backend's protocol without SGLang: every control call of the engine client
(`slime.engines.control`) made against the native engine (which speaks SGLang's protocol), with bodies checked against
SGLang's request structs, and the weight-update group's two ends. The command lines are in
test_sglang_command.py."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time

import pytest
import torch

from slime.engines.control import AsyncEngineControl, EngineControl, EngineError
from slime.engines.sglang import broadcast_layout
from slime.engines.startup import wait_until_healthy
from tests.helpers.native_server import native_server

# ----------------------------------------------------------------- captured from SGLang 0.5.23
# Field names of the request structs in sglang/srt/managers/io_struct.py (BaseReq adds rid and
# http_worker_ipc to each). A body slime sends must use only these names.
_BASE = {"rid", "http_worker_ipc"}
SGLANG_REQUEST_FIELDS = {
    "/abort_request": _BASE | {"abort_all", "finished_reason", "abort_message", "weight_versions"},
    "/pause_generation": _BASE | {"mode"},
    "/continue_generation": _BASE | {"torch_empty_cache"},
    "/release_memory_occupation": _BASE | {"tags"},
    "/resume_memory_occupation": _BASE | {"tags"},
    "/update_weights_from_disk": _BASE | {
        "model_path", "load_format", "abort_all_requests", "weight_version", "is_async", "torch_empty_cache",
        "keep_pause", "recapture_cuda_graph", "token_step", "flush_cache", "manifest"},
    "/init_weights_update_group": _BASE | {
        "master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"},
    "/update_weights_from_distributed": _BASE | {
        "names", "dtypes", "shapes", "group_name", "flush_cache", "abort_all_requests", "weight_version",
        "load_format", "selector", "torch_empty_cache"},
    "/update_weights_from_tensor": _BASE | {
        "serialized_named_tensors", "load_format", "flush_cache", "abort_all_requests", "weight_version",
        "selector", "torch_empty_cache"},
    "/destroy_weights_update_group": _BASE | {"group_name"},
    "/begin_weight_update": _BASE | {"selector"},
    "/end_weight_update": _BASE,
    "/flush_cache": set(),  # takes a `timeout` query parameter, no body fields
}
REQUIRED_FIELDS = {
    "/update_weights_from_disk": {"model_path"},
    "/init_weights_update_group": {"master_address", "master_port", "rank_offset", "world_size"},
    "/update_weights_from_distributed": {"names", "dtypes", "shapes"},
    "/update_weights_from_tensor": {"serialized_named_tensors"},
}


def test_broadcast_layout():
    # 3 engines of TP 2: trainer rank 0, engine i's TP ranks at 1 + 2i and 2 + 2i
    assert broadcast_layout(3, 2) == (7, [1, 3, 5])
    assert broadcast_layout(1, 1) == (2, [1])
    with pytest.raises(ValueError):
        broadcast_layout(0, 1)


_ENGINE_END = """
import datetime, json, os, sys, torch
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, rendezvous
t = datetime.timedelta(seconds=60)
store, _, _ = next(rendezvous(f"tcp://127.0.0.1:{sys.argv[1]}", 1, 2, timeout=t))
store.set_timeout(t)
pg, _ = _new_process_group_helper(2, 1, [], Backend("gloo"), PrefixStore("wug", store), group_name="wug", timeout=t)
bufs = [torch.empty(3), torch.empty(2, 2, dtype=torch.bfloat16)]
for w in [pg.broadcast(b, 0) for b in bufs]:
    w.wait()
print(json.dumps([b.float().tolist() for b in bufs]), flush=True)
# leave without tearing gloo down at interpreter exit: its context's threads may still be joinable
# there while the other end holds the group, and the C++ runtime then aborts the process
os._exit(0)
"""


def test_trainer_group_meets_an_sglang_style_engine_end():
    """The trainer's group end (`new_group` rank 0, as `init_broadcast_group` makes it) and an
    engine process joined the way SGLang's
    init_custom_process_group joins (tcp:// rendezvous, PrefixStore(group), torch's
    _new_process_group_helper) exchange broadcasts, in order, over gloo."""
    import subprocess

    from slime.engines.native.weight_group import new_group
    from slime.utils.net import free_port

    port = free_port()
    engine = subprocess.Popen([sys.executable, "-c", _ENGINE_END, str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        pg, _store = new_group("127.0.0.1", port, 0, 2, "wug", backend="gloo", timeout_s=60)
        sent = [torch.tensor([1.0, -2.0, 3.5]), torch.tensor([[0.5, 1.5], [2.5, -4.0]], dtype=torch.bfloat16)]
        for t in sent:
            pg.broadcast(t, 0).wait()
        out, err = engine.communicate(timeout=60)
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait()
    assert engine.returncode == 0, err[-2000:]
    assert json.loads(out) == [t.float().tolist() for t in sent]


# ----------------------------------------------------------------- protocol calls


class _Recorder(AsyncEngineControl):
    """An engine client that records (method, path, body) and forwards to the server (or, with
    url None, answers {"success": true, "weight_version": "w"} itself)."""

    def __init__(self, url):
        super().__init__(url or "http://127.0.0.1:9", timeout=120)
        self.offline = url is None
        self.calls: list[tuple[str, str, dict | None]] = []

    async def request(self, method, path, *, json=None, data=None, params=None):
        self.calls.append((method, path, json))
        if self.offline:
            return {"success": True, "weight_version": "w"}
        return await super().request(method, path, json=json, data=data, params=params)


def _check_schema(calls):
    for method, path, body in calls:
        if method != "POST" or path not in SGLANG_REQUEST_FIELDS:
            continue
        extra = set(body) - SGLANG_REQUEST_FIELDS[path]
        assert not extra, f"{path}: fields SGLang does not know: {extra}"
        missing = REQUIRED_FIELDS.get(path, set()) - set(body)
        assert not missing, f"{path}: missing required {missing}"


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with native_server(tiny_model_dir, tmp_path_factory.mktemp("sgl") / "log.txt",
                       "--weight-dirs", str(tmp_path_factory.getbasetemp())) as (url, proc):
        yield url, proc


def _run(coro):
    return asyncio.run(coro)


def test_health_wait_rides_out_sglang_starting_503():
    """SGLang answers GET /health with an empty 503 while it starts; the wait keeps polling."""
    import http.server

    hits = []

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            hits.append(self.path)
            self.send_response(503 if len(hits) <= 3 else 200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        t0 = time.monotonic()
        wait_until_healthy(f"http://127.0.0.1:{srv.server_port}", timeout=10, poll_interval=0.05)
        assert hits == ["/health"] * 4 and time.monotonic() - t0 < 5
    finally:
        srv.shutdown()
        srv.server_close()


async def _running(client: AsyncEngineControl, timeout: float = 60.0) -> None:
    """Wait until the engine has a request running (not just queued)."""
    deadline = time.monotonic() + timeout
    while (await client.server_info())["num_running_requests"] < 1:
        assert time.monotonic() < deadline, "the request never started"
        await asyncio.sleep(0.05)


def test_generation_controls_against_native(server):
    url, proc = server

    async def go():
        rec = _Recorder(url)
        ctl = rec
        try:
            # a long request, then pause / abort everything: it comes back as aborted
            payload = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 400, "ignore_eos": True,
                                                                     "temperature": 0.0}, "rid": "long-1"}
            task = asyncio.create_task(rec.generate(payload))
            await _running(rec)
            await ctl.pause("retract")
            await ctl.continue_generation()
            await ctl.abort("long-1")
            out = await asyncio.wait_for(task, 60)
            assert out["meta_info"]["finish_reason"]["type"] == "abort"
            assert out["meta_info"]["completion_tokens"] < 400
            task = asyncio.create_task(rec.generate(dict(payload, rid="long-2")))
            await _running(rec)
            await ctl.abort()  # abort_all
            out = await asyncio.wait_for(task, 60)
            assert out["meta_info"]["finish_reason"]["type"] == "abort"
            await ctl.flush_cache()
            short = await rec.generate({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 3,
                                        "temperature": 0.0, "ignore_eos": True}})
            assert short["meta_info"]["completion_tokens"] == 3
            with pytest.raises(ValueError, match="pause mode"):
                await ctl.pause("sleep")
        finally:
            await rec.close()
        return rec.calls

    calls = _run(go())
    assert [(m, p) for m, p, _ in calls if p not in ("/generate", "/get_server_info")] == [
        ("POST", "/pause_generation"), ("POST", "/continue_generation"), ("POST", "/abort_request"),
        ("POST", "/abort_request"), ("POST", "/flush_cache")]
    bodies = {p: b for _, p, b in calls if p != "/abort_request"}
    assert bodies["/pause_generation"] == {"mode": "retract"}
    assert [b for _, p, b in calls if p == "/abort_request"] == [{"rid": "long-1"}, {"abort_all": True}]
    _check_schema(calls)
    assert proc.poll() is None


def test_disk_update_memory_and_weight_version_against_native(server, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from slime.utils.weights import tensor_digest

    url, proc = server
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.mul_(3.0)
    model.save_pretrained(tmp_path / "v2")

    async def go():
        rec = _Recorder(url)
        ctl = rec
        try:
            before = await ctl.weight_version()
            assert await ctl.begin_weight_update() is False  # native: no session needed (404)
            await ctl.release_memory()
            await ctl.resume_memory()
            await ctl.release_memory(["kv_cache"])
            await ctl.resume_memory(["kv_cache"])
            resp = await ctl.update_weights_from_disk(str(tmp_path / "v2"), weight_version="v2")
            assert resp["success"] is True
            assert await ctl.end_weight_update() is False
            after = await ctl.weight_version()
            out = await rec.generate({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2,
                                      "temperature": 0.0}})
            with pytest.raises(EngineError) as ei:
                await ctl.update_weights_from_disk(str(tmp_path / "missing"), weight_version="v3")
            return before, after, out, ei.value
        finally:
            await rec.close()
        return None

    before, after, out, err = _run(go())
    assert before != "v2" and after == "v2" and out["meta_info"]["weight_version"] == "v2"
    assert err.status == 400 and "missing" in str(err)
    assert EngineControl(url).weights_checksum()["model.norm.weight"] == tensor_digest(
        model.model.norm.weight)
    assert proc.poll() is None


def test_distributed_update_with_sglang_bodies_against_native(server, tiny_model_dir):
    """init_weights_update_group + update_weights_from_distributed with SGLang's bodies; the
    trainer's end is rank 0 of the group the native engine joins (gloo on CPU)."""
    from transformers import AutoModelForCausalLM

    from slime.engines.native.weight_group import new_group
    from slime.utils.net import free_port
    from slime.utils.weights import tensor_digest

    url, proc = server
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.add_(0.25)
        model.model.layers[0].mlp.down_proj.weight.mul_(0.5)
    sent = [("model.norm.weight", model.model.norm.weight.detach().clone()),
            ("model.layers.0.mlp.down_proj.weight", model.model.layers[0].mlp.down_proj.weight.detach().clone())]
    world, offsets = broadcast_layout(1, 1)
    port = free_port()

    async def go():
        rec = _Recorder(url)
        ctl = rec
        try:
            join = asyncio.create_task(ctl.init_weights_update_group("127.0.0.1", port, offsets[0], world,
                                                                     group_name="sgl", backend="gloo"))
            pg, store = await asyncio.to_thread(new_group, "127.0.0.1", port, 0, world, "sgl", "gloo", 60)
            assert (await join)["success"] is True
            upd = asyncio.create_task(ctl.update_weights_from_distributed(
                [n for n, _ in sent], [t.dtype for _, t in sent], [list(t.shape) for _, t in sent],
                group_name="sgl", weight_version="d1"))

            def bcast():
                for _, t in sent:
                    pg.broadcast(t, 0).wait()

            await asyncio.to_thread(bcast)
            resp = await upd
            version = await ctl.weight_version()
            await ctl.destroy_weights_update_group("sgl")
            return resp, version, store
        finally:
            await rec.close()

    resp, version, _store = _run(go())
    assert resp["success"] is True and version == "d1"
    sums = EngineControl(url).weights_checksum()
    assert [sums[n] for n, _ in sent] == [tensor_digest(t) for _, t in sent]
    assert "sgl" not in EngineControl(url).server_info()["weight_update_groups"]
    assert proc.poll() is None


def test_request_bodies_match_sglang_structs():
    """Every body the engine client builds (the IPC tensor update included, which the native engine takes
    only in binary form) uses only SGLang's field names and carries the required ones."""

    async def go():
        c = _Recorder(None)
        ctl = c
        await ctl.abort("r")
        await ctl.abort()
        await ctl.pause("abort")
        await ctl.continue_generation()
        await ctl.flush_cache()
        await ctl.release_memory(["weights"])
        await ctl.resume_memory()
        await ctl.begin_weight_update()
        await ctl.update_weights_from_disk("/m", weight_version=3, flush_cache=False)
        await ctl.init_weights_update_group("10.0.0.1", 29500, 3, 7, group_name="g")
        await ctl.update_weights_from_distributed(["a"], [torch.bfloat16], [[2, 3]], group_name="g",
                                                  weight_version="4")
        await ctl.update_weights_from_ipc_handles(["QUJD", "REVG"], weight_version="5")
        await ctl.end_weight_update()
        await ctl.destroy_weights_update_group("g")
        assert await ctl.weight_version() == "w"
        with pytest.raises(ValueError, match="one per TP rank"):
            await ctl.update_weights_from_ipc_handles([])
        return c.calls

    calls = _run(go())
    _check_schema(calls)
    by_path = {p: b for _, p, b in calls}
    assert by_path["/update_weights_from_distributed"] == {
        "names": ["a"], "dtypes": ["bfloat16"], "shapes": [[2, 3]], "group_name": "g", "flush_cache": True,
        "weight_version": "4"}
    assert by_path["/update_weights_from_tensor"] == {"serialized_named_tensors": ["QUJD", "REVG"],
                                                     "flush_cache": True, "weight_version": "5"}
    assert by_path["/update_weights_from_disk"] == {"model_path": "/m", "flush_cache": False,
                                                   "abort_all_requests": False, "weight_version": "3"}
    assert by_path["/init_weights_update_group"] == {"master_address": "10.0.0.1", "master_port": 29500,
                                                    "rank_offset": 3, "world_size": 7, "group_name": "g",
                                                    "backend": "nccl"}
    assert by_path["/release_memory_occupation"] == {"tags": ["weights"]}
    assert by_path["/resume_memory_occupation"] == {}
    assert ("GET", "/model_info", None) in calls


def test_success_false_is_an_error():
    """SGLang can answer {"success": false} with HTTP 200 too: that is an EngineError with its message."""
    from aiohttp import web

    async def disk(request):
        return web.json_response({"success": False, "message": "no such dir"})

    async def go():
        app = web.Application()
        app.router.add_post("/update_weights_from_disk", disk)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        ctl = AsyncEngineControl(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")
        try:
            with pytest.raises(EngineError, match="did not succeed: 'no such dir'"):
                await ctl.update_weights_from_disk("/x")
        finally:
            await ctl.close()
            await runner.cleanup()

    _run(go())
