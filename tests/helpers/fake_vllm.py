"""A small fake of vLLM's OpenAI server (dev mode) and slime's vLLM adapter in front of it, for the
adapter's HTTP tests (tests/unit/engines/test_vllm_backend.py, test_vllm_lora.py): no vLLM needed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import urllib.error
import urllib.request
from pathlib import Path

from aiohttp import web

from slime.engines.vllm.translate import safetensors_names
from tests.helpers.http import AUTH


class FakeVllm:
    """Just enough of vLLM's OpenAI server (dev mode) to drive the adapter: completions answer
    ids prompt[-1]+1, +2, ... with log-prob -0.25 each; everything received is recorded."""

    def __init__(self):
        self.calls: list[tuple[str, object]] = []
        self.rpc_files_existed: list[bool] = []
        self.loras: dict[str, str] = {}
        self.gate: threading.Event | None = None  # when set, completions wait for it

    async def models(self, request):
        return web.json_response({"data": [{"id": "slime", "max_model_len": 64}]})

    async def health(self, request):
        return web.Response()

    async def completions(self, request):
        body = await request.json()
        self.calls.append(("/v1/completions", body))
        if body["model"] != "slime" and body["model"] not in self.loras:
            return web.json_response({"error": {"message": f"The model `{body['model']}` does not exist.",
                                                "type": "NotFoundError", "param": "model", "code": 404}}, status=404)
        if self.gate is not None:
            await asyncio.to_thread(self.gate.wait, 20)
        if body["temperature"] == 0.123:  # a request vLLM itself rejects
            return web.json_response({"error": {"message": "bad temperature", "type": "BadRequestError",
                                                "param": "temperature", "code": 400}}, status=400)
        n = body["max_tokens"]
        start = body["prompt"][-1] + 1
        ids = [start + i for i in range(n)]
        choice = {"index": 0, "text": " ".join(map(str, ids)), "token_ids": ids, "finish_reason": "length",
                  "stop_reason": None}
        if body.get("logprobs") is not None:
            choice["logprobs"] = {"token_logprobs": [-0.25] * n, "tokens": [f"token_id:{t}" for t in ids]}
        return web.json_response({"choices": [choice], "usage": {"prompt_tokens": len(body["prompt"]),
                                                                 "completion_tokens": n}})

    async def load_lora(self, request):
        """vLLM's answers: plain text on success, OpenAI-shaped errors."""
        body = await request.json()
        self.calls.append(("/v1/load_lora_adapter", body))
        if not os.path.exists(os.path.join(body["lora_path"], "adapter_config.json")):
            return web.json_response({"error": {"message": f"Loading lora {body['lora_name']} failed: No adapter "
                                                           f"found for {body['lora_path']}", "type": "NotFoundError",
                                                "param": None, "code": 404}}, status=404)
        self.loras[body["lora_name"]] = body["lora_path"]
        return web.Response(text=f"Success: LoRA adapter '{body['lora_name']}' added successfully.")

    async def unload_lora(self, request):
        body = await request.json()
        self.calls.append(("/v1/unload_lora_adapter", body))
        if self.loras.pop(body["lora_name"], None) is None:
            return web.json_response({"error": {"message": f"The lora adapter '{body['lora_name']}' cannot be found.",
                                                "type": "NotFoundError", "param": None, "code": 404}}, status=404)
        return web.Response(text=f"Success: LoRA adapter '{body['lora_name']}' removed successfully.")

    async def rpc(self, request):
        body = await request.json()
        self.calls.append(("/collective_rpc", body))
        method, args = body["method"], body["args"]
        if method == "slime_init_weights_update_group":
            return web.json_response({"results": [{"rank": args[2]}]})
        if method == "slime_receive_weights":
            return web.json_response({"results": [{"num_tensors": len(args[1])}]})
        if method == "slime_destroy_weights_update_group":
            return web.json_response({"results": [{"destroyed": True}]})
        self.rpc_files_existed.append(all(os.path.exists(p) for p in body["args"]))
        n = 0
        if body["method"] == "slime_load_weights":
            n = sum(len(safetensors_names(Path(p).read_bytes())) for p in body["args"])
        return web.json_response({"results": [{"num_tensors": n, "num_files": len(body["args"])}]})

    async def record(self, request):
        raw = await request.read()
        self.calls.append((request.path + (f"?{request.query_string}" if request.query_string else ""),
                           json.loads(raw) if raw else None))
        if request.path == "/abort_requests":
            return web.json_response({"status": "aborted", "aborted": 1})
        if request.path == "/reset_prefix_cache":
            return web.json_response({"success": True})
        return web.json_response({"status": "ok"})

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/collective_rpc", self.rpc)
        app.router.add_post("/v1/load_lora_adapter", self.load_lora)
        app.router.add_post("/v1/unload_lora_adapter", self.unload_lora)
        for path in ("/abort_requests", "/pause", "/resume", "/reset_prefix_cache", "/sleep", "/wake_up"):
            app.router.add_post(path, self.record)
        return app


@contextlib.contextmanager
def serve_adapter(tmp_path):
    """(adapter url, FakeVllm, AdapterState): slime's vLLM adapter (LoRA on) in front of a FakeVllm,
    both served from a background event loop, on free ports of 127.0.0.1."""
    from slime.engines.vllm.adapter import AdapterState, create_app
    from slime.utils.net import free_port

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 50}))
    fake = FakeVllm()
    up_port, port = free_port(), free_port()
    state = AdapterState(f"http://127.0.0.1:{up_port}", str(model), weights_dir=str(tmp_path / "w"), lora=True)
    os.makedirs(state.weights_dir)
    loop = asyncio.new_event_loop()
    runners = []
    started = threading.Event()

    async def start():
        for app, p in ((fake.app(), up_port), (create_app(state), port)):
            r = web.AppRunner(app)
            await r.setup()
            await web.TCPSite(r, "127.0.0.1", p).start()
            runners.append(r)
        started.set()

    thread = threading.Thread(target=lambda: (loop.run_until_complete(start()), loop.run_forever()), daemon=True)
    thread.start()
    assert started.wait(20)
    yield f"http://127.0.0.1:{port}", fake, state

    async def stop():
        for r in reversed(runners):
            await r.cleanup()

    asyncio.run_coroutine_threadsafe(stop(), loop).result(20)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def http(url, path, body=None, raw=None, method=None):
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    ctype = "application/octet-stream" if raw is not None else "application/json"
    req = urllib.request.Request(url + path, data=data, method=method or ("POST" if data is not None else "GET"),
                                 headers={"Content-Type": ctype, **AUTH})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
