"""What the native engine's server refuses, and that it keeps serving meanwhile (issue 20, items 10
and 11): undecodable and too deeply nested bodies, bodies over a route's cap (refused before they
are read), prompts and prompt lists over the caps, n x prompts over the queue (429), truncated
safetensors on the weight routes, distributed shapes the model does not have, chat templates in a
request, tokenization off the event loop, and weight-group rendezvous that never complete."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save

from slime.engines.control import EngineControl
from slime.engines.native.limits import Admission, GroupThreads, ServerLimits
from slime.engines.protocol import (
    MAX_JSON_DEPTH,
    ProtocolError,
    json_depth,
    parse_json_body,
)
from slime.utils.net import free_port
from tests.helpers.http import AUTH
from tests.helpers.native_server import native_server

CAP = 16_000_000  # --max-request-bytes of the module's server
ROOM = "(--max-prompt-tokens, below the model's context length)"


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("doors_weights")


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory, weights_dir):
    log = tmp_path_factory.mktemp("doors") / "log.txt"
    with native_server(tiny_model_dir, log, "--max-request-bytes", str(CAP), "--max-prompts-per-request", "4",
                       "--max-prompt-tokens", "100", "--max-queued-requests", "16", "--weight-group-timeout", "60",
                       "--weight-dirs", str(weights_dir)) as (url, proc):
        yield url, proc


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _call(url: str, path: str, body: bytes | None = None, payload=None, content_type="application/json",
          timeout: float = 60.0):
    """(status, decoded JSON answer) of one POST (GET without a body)."""
    if payload is not None:
        body = json.dumps(payload).encode()
    headers = {**AUTH, "Content-Type": content_type} if body is not None else dict(AUTH)
    req = urllib.request.Request(url + path, data=body, method="POST" if body is not None else "GET",
                                 headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _message(answer) -> str:
    return answer["error"]["message"]


def _health_latency(url: str) -> float:
    t0 = time.perf_counter()
    status, body = _call(url, "/health", timeout=5)
    assert status == 200 and body["status"] == "ok"
    return time.perf_counter() - t0


def _still_serving(url: str) -> None:
    status, out = _call(url, "/generate", payload={"input_ids": [5, 6], "sampling_params": {
        "max_new_tokens": 2, "ignore_eos": True}})
    assert status == 200 and len(out["output_ids"]) == 2, out


# ---------------------------------------------------------------- bodies
def test_undecodable_bytes_are_400_naming_the_body(server):
    url, proc = server
    for path in ("/generate", "/v1/completions", "/v1/chat/completions", "/abort_request"):
        status, body = _call(url, path, b"\xff\xfe{}")
        assert status == 400 and _message(body) == "body: is not valid UTF-8: byte 0xff at offset 0 (invalid start byte)"
    # a lone surrogate escaped in valid JSON cannot be tokenized: 400 naming the prompt
    status, body = _call(url, "/generate", b'{"text": "a\\ud800b"}')
    assert status == 400 and _message(body).startswith("text: cannot be tokenized: "), body
    _still_serving(url)
    assert proc.poll() is None


def test_json_nested_too_deep_is_400(server):
    url, _ = server
    too_deep = f"body: JSON nested deeper than {MAX_JSON_DEPTH} levels of arrays and objects"
    for depth in (MAX_JSON_DEPTH + 1, 100_000):  # parses in Python / overflows Python's recursion
        status, body = _call(url, "/generate", b"[" * depth + b"]" * depth)
        assert (status, _message(body)) == (400, too_deep)
    nested = {"input_ids": [5], "rid": "x"}
    for _ in range(MAX_JSON_DEPTH):
        nested = {"a": nested}
    status, body = _call(url, "/abort_request", payload=nested)
    assert (status, _message(body)) == (400, too_deep)
    _still_serving(url)


def test_protocol_json_depth_and_number_limits():
    assert json_depth('{"a": [[1], {"b": "]]]}}[[["}], "c": 2}') == 3
    assert json_depth("7") == 0 and json_depth("[]") == 1
    assert parse_json_body(b'{"s": "' + b"[" * 500 + b'"}') == {"s": "[" * 500}  # brackets in strings do not count
    with pytest.raises(ProtocolError) as ei:
        parse_json_body(b"1" * 5000)
    assert ei.value.field == "body" and str(ei.value).startswith("body: malformed JSON: Exceeds the limit")


def _open(url: str, path: str, headers: dict) -> http.client.HTTPConnection:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.putrequest("POST", path)
    for k, v in {**AUTH, **headers}.items():
        conn.putheader(k, v)
    conn.endheaders()
    return conn


def test_a_body_over_the_cap_is_413_before_it_is_read(server, tiny_model_dir):
    url, _ = server
    # Content-Length says 1 TB and not a byte of it is sent: the answer comes at once
    conn = _open(url, "/generate", {"Content-Type": "application/json", "Content-Length": str(10**12)})
    t0 = time.perf_counter()
    resp = conn.getresponse()
    answer = json.loads(resp.read())
    assert time.perf_counter() - t0 < 1.0
    assert resp.status == 413 and resp.getheader("Connection") == "close"
    assert _message(answer) == f"body: 1000000000000 bytes is over the {CAP}-byte limit of POST /generate " \
                               "(--max-request-bytes)"
    conn.close()
    assert _health_latency(url) < 1.0

    # a chunked body is cut off as soon as it passes the cap
    conn = _open(url, "/v1/completions", {"Content-Type": "application/json", "Transfer-Encoding": "chunked"})
    chunk = b"[" + b"1," * (1 << 19)
    sent = 0
    while sent <= CAP:
        conn.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        sent += len(chunk)
    resp = conn.getresponse()
    message = _message(json.loads(resp.read()))
    assert resp.status == 413 and message.startswith("body: at least ")
    assert message.endswith(f"bytes is over the {CAP}-byte limit of POST /v1/completions (--max-request-bytes)")
    conn.close()

    # the tensor route's cap: every parameter at 8 bytes an element, plus headers
    from transformers import AutoModelForCausalLM

    sd = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict(keep_vars=True)
    names = sum(len(n) + 128 for n in sd)
    cap = sum(p.numel() for p in sd.values()) * 8 + 8 + (1 << 20) + names
    conn = _open(url, "/update_weights_from_tensor", {"Content-Type": "application/octet-stream",
                                                      "Content-Length": str(cap + 1)})
    resp = conn.getresponse()
    assert resp.status == 413 and _message(json.loads(resp.read())) == (
        f"body: {cap + 1} bytes is over the {cap}-byte limit of POST /update_weights_from_tensor "
        "(the model's parameters at 8 bytes an element, plus headers)")
    conn.close()
    # and every other route's
    conn = _open(url, "/abort_request", {"Content-Type": "application/json", "Content-Length": str(10**9)})
    resp = conn.getresponse()
    assert resp.status == 413 and _message(json.loads(resp.read())) == (
        f"body: 1000000000 bytes is over the {(1 << 20) + names}-byte limit of POST /abort_request "
        "(the cap of control routes)")
    conn.close()
    _still_serving(url)


def test_derived_caps():
    engine = SimpleNamespace(max_context_length=512, weight_body_bytes=lambda: 1000, parameter_names_bytes=lambda: 10)
    adm = Admission(engine, ServerLimits())
    assert adm.max_prompts == 256 and adm.max_prompt_tokens == 511 and adm.max_queued == 4096
    assert adm.caps["/generate"][0] == adm.caps["/v1/chat/completions"][0] == 256 * 511 * 16 + (1 << 20)
    assert adm.caps["/update_weights_from_tensor"] == (1000, ("the model's parameters at 8 bytes an element, "
                                                             "plus headers"))
    assert adm.default_cap == ((1 << 20) + 10, "the cap of control routes")
    adm.close()
    big = Admission(SimpleNamespace(max_context_length=131072, weight_body_bytes=lambda: 1,
                                    parameter_names_bytes=lambda: 1), ServerLimits(max_prompt_tokens=10**9))
    assert big.max_prompt_tokens == 131071 and big.caps["/generate"][0] == 256 << 20
    big.close()
    with pytest.raises(ValueError, match="max_queued_requests must be > 0, got 0"):
        ServerLimits(max_queued_requests=0)


# ---------------------------------------------------------------- prompts and the queue
def test_prompt_caps_are_400_naming_the_field(server, tokenizer):
    url, _ = server
    five = "5 prompts in one request, more than the 4 this server takes (--max-prompts-per-request)"
    cases = [
        ("/generate", {"input_ids": [[5]] * 5}, f"input_ids: {five}"),
        ("/generate", {"text": ["a"] * 5}, f"text: {five}"),
        ("/v1/completions", {"prompt": ["a"] * 5}, f"prompt: {five}"),
        ("/v1/completions", {"prompt": [[5]] * 5}, f"prompt: {five}"),
        ("/generate", {"input_ids": [5] * 101}, (f"input_ids: the prompt has 101 tokens, more than the 100 this "
                                                f"server takes {ROOM}")),
        ("/generate", {"input_ids": [[5], [5] * 10**6]}, (f"input_ids[1]: the prompt has 1000000 tokens, more "
                                                         f"than the 100 this server takes {ROOM}")),
        ("/v1/completions", {"prompt": [[5], [6] * 101]}, (f"prompt[1]: the prompt has 101 tokens, more than "
                                                          f"the 100 this server takes {ROOM}")),
    ]
    long_text = "one two three four " * 40
    n = len(tokenizer.encode(long_text))
    assert n > 100
    cases += [("/generate", {"text": long_text}, (f"text: the prompt has {n} tokens, more than the 100 this server "
                                                 f"takes {ROOM}")),
              ("/v1/completions", {"prompt": ["x", long_text]}, (f"prompt[1]: the prompt has {n} tokens, more than "
                                                                f"the 100 this server takes {ROOM}"))]
    for path, payload, message in cases:
        status, body = _call(url, path, payload=payload)
        assert (status, _message(body)) == (400, message), payload if len(str(payload)) < 200 else path
    _still_serving(url)


def test_n_times_prompts_beyond_the_queue_is_429(server):
    url, _ = server
    status, body = _call(url, "/v1/completions", payload={"prompt": [[5], [6], [7], [8]], "n": 5, "max_tokens": 1})
    assert (status, _message(body)) == (429, ("n: asks for 20 generations (n x prompts), more than the engine's "
                                             "queue holds (--max-queued-requests 16); split the request"))
    ctl = EngineControl(url, timeout=30)
    out = {}

    def call(key, path, payload):
        out[key] = _call(url, path, payload=payload)

    def wait_for(waiting):
        for _ in range(1000):
            if ctl.server_info()["num_waiting_requests"] == waiting:
                return
            time.sleep(0.01)
        raise AssertionError(f"{waiting} requests never waited")

    ctl.pause()
    try:
        threads = [threading.Thread(target=call, args=(i, "/generate", {
            "input_ids": [5, i], "rid": f"q{i}", "sampling_params": {"max_new_tokens": 4}})) for i in range(10)]
        for t in threads:
            t.start()
        wait_for(10)
        call("full", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 7,
                                              "max_tokens": 1})
        threads.append(threading.Thread(target=call, args=("batch", "/generate", {
            "input_ids": [[5]] * 4, "sampling_params": {"max_new_tokens": 1}})))  # 10 + 4 fit
        threads[-1].start()
        wait_for(14)
        ctl.abort()
        for t in threads:
            t.join(timeout=60)
    finally:
        ctl.continue_generation()
    (status, body), (bstatus, bbody) = out["full"], out["batch"]
    waited = [out[i] for i in range(10)]
    assert (status, _message(body)) == (429, ("n: 7 more generations (n x prompts) do not fit the engine's queue: 10 "
                                             "of 16 are taken (--max-queued-requests); retry later"))
    assert bstatus == 200 and len(bbody) == 4
    assert all(s == 200 and out["meta_info"]["finish_reason"]["type"] == "abort" for s, out in waited)
    _still_serving(url)


def test_health_answers_while_a_huge_prompt_is_tokenized(server):
    url, _ = server
    text = "hello world what is 2 + 2 " * 200_000  # 5.2 MB: legal by size, seconds to tokenize
    box = {}

    def post():
        box["answer"] = _call(url, "/generate", payload={"text": text}, timeout=120)

    t = threading.Thread(target=post)
    t0 = time.perf_counter()
    t.start()
    time.sleep(0.3)
    latencies = []
    while t.is_alive():
        latencies.append(_health_latency(url))
        time.sleep(0.05)
    t.join()
    assert time.perf_counter() - t0 > 1.0 and len(latencies) >= 5  # the tokenization did take a while
    assert max(latencies) < 1.0, latencies
    status, body = box["answer"]
    assert status == 400 and _message(body).startswith("text: the prompt has ")
    assert _message(body).endswith(f"tokens, more than the 100 this server takes {ROOM}")


# ---------------------------------------------------------------- chat templates in a request
REFUSED = ("a request may not carry a chat template (the server renders the model's own); start the server with "
           "--trust-request-templates to allow it")
MSGS = [{"role": "user", "content": "what is 1 plus 1 ?"}]


def test_templates_in_a_request_are_refused_unless_trusted(server, tokenizer):
    url, _ = server
    cases = [({"chat_template": "{{ 7 }}"}, f"chat_template: {REFUSED}"),
             ({"chat_template_kwargs": {"chat_template": "{{ 7 }}"}}, f"chat_template_kwargs.chat_template: {REFUSED}"),
             ({"chat_template_kwargs": {"tokenize": False}},
              "chat_template_kwargs.tokenize: is an argument of the template call, not a template variable")]
    for extra, message in cases:
        status, body = _call(url, "/v1/chat/completions", payload={"messages": MSGS, "max_tokens": 1, **extra})
        assert (status, _message(body)) == (400, message)
    # template variables are data: accepted
    status, body = _call(url, "/v1/chat/completions", payload={
        "messages": MSGS, "max_tokens": 1, "chat_template_kwargs": {"enable_thinking": False}})
    assert status == 200 and body["prompt_token_ids"] == tokenizer.apply_chat_template(
        MSGS, tokenize=True, add_generation_prompt=True, return_dict=False)


def test_a_trusting_server_renders_the_request_template(tiny_model_dir, tokenizer):
    from aiohttp.test_utils import TestClient, TestServer

    from slime.engines.native.engine import NativeEngine
    from slime.engines.native.server import create_app

    engine = NativeEngine(tiny_model_dir, num_threads=1)
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"

    async def go():
        app = create_app(engine, limits=ServerLimits(trust_request_templates=True))
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            resp = await client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 1,
                                                                   "chat_template": template})
            return resp.status, await resp.json()

    status, body = asyncio.run(go())
    assert status == 200 and body["prompt_token_ids"] == tokenizer.encode("[what is 1 plus 1 ?]",
                                                                          add_special_tokens=False)


# ---------------------------------------------------------------- weight routes
def _st(tensors) -> bytes:
    return save({k: v.contiguous() for k, v in tensors.items()})


def test_truncated_safetensors_are_400_naming_the_route(server, weights_dir):
    url, _ = server
    version = EngineControl(url).weight_version()
    good = _st({"model.norm.weight": torch.ones(128)})
    hlen = int.from_bytes(good[:8], "little")
    data = len(good) - 8 - hlen
    sent = "body: the safetensors bytes sent to /update_weights_from_tensor are"
    cases = [(good[:-10], (f"{sent} truncated: the header places tensor data up to byte {data}, {data - 10} bytes of it "
                          "arrived")),
             (good[:5], f"{sent} truncated: 5 bytes, fewer than the 8 of the header's length"),
             (good[:20], f"{sent} truncated: the header says it is {hlen} bytes, 12 follow"),
             (_st({"model.norm.weight": torch.ones(10**4)}),  # refused by its header, before it is loaded
              "model.norm.weight: shape mismatch: got (10000,), model has (128,)")]
    for body, message in cases:
        status, answer = _call(url, "/update_weights_from_tensor", body, content_type="application/octet-stream")
        assert (status, _message(answer)) == (400, message)
    # a truncated file on disk
    path = weights_dir / "model.safetensors"
    path.write_bytes(good[:-10])
    status, answer = _call(url, "/update_weights_from_disk", payload={"model_path": str(weights_dir)})
    assert (status, _message(answer)) == (400, (f"model_path: /update_weights_from_disk: {path} is truncated: the header "
                                               f"places tensor data up to byte {data}, {data - 10} bytes of it arrived"))
    assert EngineControl(url).weight_version() == version
    _still_serving(url)


def test_distributed_shapes_the_model_does_not_have_are_refused_before_receiving(server):
    from slime.engines.native.weight_group import new_group

    url, _ = server
    port = free_port()

    async def go():
        join = asyncio.create_task(asyncio.to_thread(_call, url, "/init_weights_update_group", None, {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": "doors", "backend": "gloo"}))
        pg, store = await asyncio.to_thread(new_group, "127.0.0.1", port, 0, 2, "doors", "gloo", 60)
        return await join, pg, store

    (status, joined), _pg, _store = asyncio.run(go())
    assert status == 200 and joined["success"] is True, joined
    base = {"group_name": "doors", "weight_version": "never"}
    cases = [({"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[10**6, 10**6]]},
              "names[0]: 'model.norm.weight': shape mismatch: got (1000000, 1000000), model has (128,)"),
             ({"names": ["model.norm.weight", "model.nope"], "dtypes": ["float32"] * 2, "shapes": [[128], [2]]},
              "names[1]: 'model.nope': unknown parameter name (not in the model's state dict)"),
             ({"names": ["model.norm.weight"], "dtypes": ["int64"], "shapes": [[128]]},
              "names[0]: 'model.norm.weight': dtype mismatch: got torch.int64, model has torch.float32")]
    for payload, message in cases:
        t0 = time.perf_counter()
        status, answer = _call(url, "/update_weights_from_distributed", payload={**payload, **base}, timeout=10)
        assert (status, _message(answer)) == (400, message)
        assert time.perf_counter() - t0 < 1.0  # nothing was waited for
    assert EngineControl(url).weight_version() != "never"
    assert _call(url, "/destroy_weights_update_group", payload={"group_name": "doors"})[0] == 200
    _still_serving(url)


# ---------------------------------------------------------------- item 11: rendezvous that never complete
@pytest.fixture(scope="module")
def stuck_server(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("doors_stuck") / "log.txt"
    with native_server(tiny_model_dir, log, "--weight-group-timeout", "5") as s:
        yield s


def test_stuck_rendezvous_leave_pause_weight_and_memory_routes_answering(stuck_server, tiny_model_dir):
    url, proc = stuck_server
    nobody = free_port()  # nothing listens there: every rendezvous waits for its whole timeout
    answers = {}

    def join(i):
        answers[i] = _call(url, "/init_weights_update_group", payload={
            "master_address": "127.0.0.1", "master_port": nobody, "rank_offset": 1, "world_size": 2,
            "group_name": f"g{i}", "backend": "gloo"}, timeout=120)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=join, args=(i,)) for i in range(GroupThreads().most)]
    for t in threads:
        t.start()
    full = (429, ("/init_weights_update_group: 8 weight-group operations are already waiting for their peers (at "
                 "most 8); retry when one completes or times out"))
    for _ in range(500):  # until all 8 are waiting
        if EngineControl(url).server_info()["weight_group_operations_waiting"] == 8:
            break
        time.sleep(0.01)
    status, body = _call(url, "/init_weights_update_group", payload={
        "master_address": "127.0.0.1", "master_port": nobody, "rank_offset": 1, "world_size": 2,
        "group_name": "one-more", "backend": "gloo"}, timeout=5)
    assert (status, _message(body)) == full
    status, body = _call(url, "/init_weights_update_group", payload={
        "master_address": "127.0.0.1", "master_port": nobody, "rank_offset": 1, "world_size": 2,
        "group_name": "g0", "backend": "gloo"})
    assert (status, _message(body)) == (400, "group_name: a rendezvous of group 'g0' is already in progress")
    # every other route answers at once
    calls = [("/pause_generation", {}), ("/continue_generation", {}),
             ("/update_weights_from_disk", {"model_path": tiny_model_dir, "weight_version": "d"}),
             ("/release_memory_occupation", {"tags": ["kv_cache"]}), ("/resume_memory_occupation", {}),
             ("/update_weight_version", {"new_version": "e"}), ("/flush_cache", {})]
    for path, payload in calls:
        t1 = time.perf_counter()
        status, body = _call(url, path, payload=payload, timeout=10)
        assert status == 200 and body["success"] is True, (path, body)
        assert time.perf_counter() - t1 < 1.0, path
    assert _health_latency(url) < 1.0
    assert EngineControl(url).weight_version() == "e"
    _still_serving(url)
    assert all(t.is_alive() for t in threads) and time.perf_counter() - t0 < 5.0  # still waiting meanwhile
    # the rendezvous end within their timeout, each with one line naming its group
    for t in threads:
        t.join(timeout=60)
    assert time.perf_counter() - t0 < 30
    for i in range(8):
        status, body = answers[i]
        assert status == 400 and body["success"] is False
        assert body["message"].startswith(f"failed to join group 'g{i}' within --weight-group-timeout 5s: "
                                          "DistNetworkError: ") and "\n" not in body["message"]
    assert proc.poll() is None
