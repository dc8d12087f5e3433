"""Streaming responses of the native engine (`python -m slime.engines.native`): SGLang's
`/generate` with `"stream": true` and the OpenAI endpoints with `stream: true`, against a
real engine on the tiny model."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import aiohttp
import pytest

from tests.helpers.http import get_json, post_json
from tests.helpers.native_server import native_server
from tests.helpers.http import AUTH
from slime.engines.auth import env_api_key

openai = pytest.importorskip("openai")

SAMPLED = {"temperature": 1.0, "seed": 5, "max_new_tokens": 24, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with native_server(tiny_model_dir, tmp_path_factory.mktemp("stream") / "log.txt") as (url, _):
        yield url


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def parse_sse(raw: str) -> list:
    """The `data:` payloads of an SSE body; checks the framing and that `[DONE]` ends it."""
    blocks = raw.split("\n\n")
    assert blocks[-1] == "", raw[-200:]
    datas = []
    for b in blocks[:-1]:
        assert b.startswith("data: ") and "\n" not in b, b
        datas.append(b[len("data: "):])
    assert datas and datas[-1] == "[DONE]" and "[DONE]" not in datas[:-1]
    return [json.loads(d) for d in datas[:-1]]


def stream(url: str, path: str, payload: dict) -> list[dict]:
    req = urllib.request.Request(url + path, data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json", **AUTH})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        return parse_sse(r.read().decode("utf-8"))


# per-request values: the request id, and the timings a non-streamed response carries for the rollout
# timeline (streamed events carry none)
VOLATILE = ("id", "queue_time", "prefill_time", "e2e_latency", "engine_url")


def _no_id(resp: dict) -> dict:
    return {**resp, "meta_info": {k: v for k, v in resp["meta_info"].items() if k not in VOLATILE}}


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) < 1e-5 for x, y in zip(a, b))


# ---------------------------------------------------------------- POST /generate
def test_generate_stream_equals_non_streaming(server):
    body = {"text": "what is 2 plus 3 ?", "return_logprob": True, "sampling_params": SAMPLED}
    ref = post_json(server, "/generate", body)
    events = stream(server, "/generate", {**body, "stream": True})
    assert len(events) > 1  # it streamed: more than the final event
    last = events[-1]
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 24, "matched": None}
    lps = [x[0] for x in last["meta_info"]["output_token_logprobs"]]
    ref_lps = [x[0] for x in ref["meta_info"]["output_token_logprobs"]]
    assert _close(lps, ref_lps)
    for ev in (last, ref):
        ev["meta_info"]["output_token_logprobs"] = [x[1:] for x in ev["meta_info"]["output_token_logprobs"]]
    assert _no_id(last) == _no_id(ref)
    # earlier events: cumulative text / output_ids / log-probs, no finish reason yet
    prev = 0
    for ev in events[:-1]:
        m = ev["meta_info"]
        assert m["finish_reason"] is None and m["id"] == last["meta_info"]["id"]
        assert set(ev) == {"text", "output_ids", "meta_info"}
        n = len(ev["output_ids"])
        assert prev < n < 24 and m["completion_tokens"] == n and m["prompt_tokens"] == ref["meta_info"]["prompt_tokens"]
        assert ev["output_ids"] == ref["output_ids"][:n]
        assert [x[1] for x in m["output_token_logprobs"]] == ev["output_ids"]
        assert _close([x[0] for x in m["output_token_logprobs"]], ref_lps[:n])
        assert ref["text"].startswith(ev["text"]) and m["weight_version"] == "0"
        prev = n


def test_generate_stream_batch_interleaves_with_index(server):
    body = {"text": ["what is 2 plus 3 ?", "say yes"], "sampling_params": [SAMPLED, {**SAMPLED, "seed": 9}]}
    ref = post_json(server, "/generate", body)
    events = stream(server, "/generate", {**body, "stream": True})
    assert {ev["index"] for ev in events} == {0, 1}
    for i in (0, 1):
        mine = [ev for ev in events if ev["index"] == i]
        assert [ev["meta_info"]["finish_reason"] is None for ev in mine] == [True] * (len(mine) - 1) + [False]
        final = dict(mine[-1])
        del final["index"]
        assert _no_id(final) == _no_id(ref[i])


def test_stop_strings_never_stream(server, tokenizer):
    prompt = "what is 2 plus 3 ?"
    ref = post_json(server, "/generate", {"text": prompt, "sampling_params": SAMPLED})
    ids = ref["output_ids"]
    special = set(tokenizer.all_special_ids)
    k = next(i for i in range(3, len(ids) - 1) if ids[i] not in special and ids[i + 1] not in special)
    stop = tokenizer.decode(ids[k:k + 2], skip_special_tokens=True)  # two words: "w1 w2"
    assert " " in stop
    cases = [{"stop": ["@@never@@", stop]}, {"stop_token_ids": [ids[k]], "ignore_eos": False}]
    for extra in cases:
        sp = {**SAMPLED, **extra}
        want = post_json(server, "/generate", {"text": prompt, "sampling_params": sp})
        assert want["meta_info"]["finish_reason"]["type"] == "stop"
        events = stream(server, "/generate", {"text": prompt, "stream": True, "sampling_params": sp})
        assert events[-1]["text"] == want["text"] and events[-1]["output_ids"] == want["output_ids"]
        for ev in events:  # nothing past the final text ever streamed, not even part of the stop string
            assert want["text"].startswith(ev["text"]), (ev["text"], want["text"], extra)
        # the OpenAI stream holds the same text back
        chunks = stream(server, "/v1/completions", {"prompt": prompt, "stream": True, "max_tokens": 24,
                                                    **{k: v for k, v in sp.items() if k != "max_new_tokens"}})
        text = ""
        for c in chunks:
            text += c["choices"][0]["text"]
            assert want["text"].startswith(text)
        assert text == want["text"] and chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_incremental_streaming_output(tiny_model_dir):
    """`--incremental-streaming-output` (here `create_app`'s argument, served in-process):
    each event carries only what is new; the pieces add up to the non-streaming response."""
    from aiohttp.test_utils import TestServer

    from slime.engines.native.engine import NativeEngine
    from slime.engines.native.server import create_app

    body = {"text": "what is 2 plus 3 ?", "return_logprob": True, "sampling_params": SAMPLED}

    async def main():
        app = create_app(NativeEngine(tiny_model_dir, num_threads=1, random_seed=0), incremental_streaming_output=True)
        srv = TestServer(app, host="127.0.0.1")
        await srv.start_server()
        try:
            async with aiohttp.ClientSession(headers=AUTH) as s:
                async with s.post(srv.make_url("/generate"), json=body) as r:
                    ref = await r.json()
                async with s.post(srv.make_url("/generate"), json={**body, "stream": True}) as r:
                    return ref, parse_sse(await r.text())
        finally:
            await srv.close()  # shuts the engine down

    ref, events = asyncio.run(main())
    assert len(events) > 1
    assert "".join(ev["text"] for ev in events) == ref["text"]
    assert sum((ev["output_ids"] for ev in events), []) == ref["output_ids"]
    lps = sum((ev["meta_info"]["output_token_logprobs"] for ev in events), [])
    assert [x[1] for x in lps] == ref["output_ids"]
    assert _close([x[0] for x in lps], [x[0] for x in ref["meta_info"]["output_token_logprobs"]])
    total = 0
    for ev in events:
        total += len(ev["output_ids"])
        assert ev["meta_info"]["completion_tokens"] == total  # always the running total
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"


# ---------------------------------------------------------------- OpenAI endpoints
@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=env_api_key(), timeout=60, max_retries=0)


def test_openai_completions_stream(client):
    kw = dict(model="m", prompt=["what is 2 plus 3 ?", "say yes"], max_tokens=12, temperature=1.0, seed=3, n=2,
              logprobs=1, extra_body={"ignore_eos": True})
    ref = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "text_completion" and c.id == chunks[0].id for c in chunks)
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.model_dump(exclude_none=True) == ref.usage.model_dump(exclude_none=True)
    assert usage.model_extra["weight_version"] == "0"
    assert all(c.usage is None and len(c.choices) == 1 for c in chunks[:-1])
    for want in ref.choices:
        mine = [c.choices[0].model_dump() for c in chunks[:-1] if c.choices[0].index == want.index]
        w = want.model_dump()
        assert "".join(c["text"] for c in mine) == w["text"]
        assert sum((c["token_ids"] for c in mine), []) == w["token_ids"]
        assert mine[0]["prompt_token_ids"] == w["prompt_token_ids"]
        assert all("prompt_token_ids" not in c for c in mine[1:])
        assert [c["finish_reason"] for c in mine] == [None] * (len(mine) - 1) + ["length"]
        lp = [c["logprobs"] for c in mine]
        assert sum((x["tokens"] for x in lp), []) == w["logprobs"]["tokens"]
        assert sum((x["text_offset"] for x in lp), []) == w["logprobs"]["text_offset"]
        assert _close(sum((x["token_logprobs"] for x in lp), []), w["logprobs"]["token_logprobs"])


def test_openai_chat_stream(client):
    msgs = [{"role": "system", "content": "say yes"}, {"role": "user", "content": "what is 1 plus 1 ?"}]
    kw = dict(model="m", messages=msgs, max_tokens=10, temperature=1.0, seed=4, logprobs=True,
              extra_body={"ignore_eos": True})
    ref = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert all(c.object == "chat.completion.chunk" and len(c.choices) == 1 and c.usage is None for c in chunks)
    first = chunks[0]
    assert first.choices[0].delta.role == "assistant" and first.choices[0].delta.content == ""
    assert first.model_extra["prompt_token_ids"] == ref.model_extra["prompt_token_ids"]
    body = [c.choices[0] for c in chunks[1:]]
    assert "".join(c.delta.content or "" for c in body) == ref.choices[0].message.content
    assert sum((c.model_dump()["token_ids"] for c in body), []) == ref.choices[0].model_dump()["token_ids"]
    assert [c.finish_reason for c in body] == [None] * (len(body) - 1) + ["length"]
    got = [t for c in body for t in c.logprobs.content]
    assert [t.token for t in got] == [t.token for t in ref.choices[0].logprobs.content]
    assert _close([t.logprob for t in got], [t.logprob for t in ref.choices[0].logprobs.content])
    assert chunks[-1].model_extra["weight_version"] == "0"


def test_stream_requests_are_validated_before_streaming(server):
    import urllib.error

    for path, payload, field in [
        ("/generate", {"input_ids": [5], "stream": True, "sampling_params": {"temperature": -1}}, "temperature"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True,
                                  "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ]:
        req = urllib.request.Request(server + path, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json", **AUTH})
        with pytest.raises(urllib.error.HTTPError) as ei:
            urllib.request.urlopen(req, timeout=30)
        assert ei.value.code == 400 and field in json.loads(ei.value.read())["error"]["message"]


# ---------------------------------------------------------------- disconnect and abort
async def _next_event(resp) -> str:
    line = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 30)
    assert line.startswith(b"data: ")
    return line[len(b"data: "):-2].decode()


async def _wait_for(session, url, key, value):
    for _ in range(500):
        async with session.get(url + "/get_server_info") as r:
            info = await r.json()
        if info[key] == value:
            return info
        await asyncio.sleep(0.01)
    raise AssertionError(f"{key} never became {value}: {info}")


def test_client_disconnect_mid_stream_frees_the_request(server):
    long = {"max_new_tokens": 400, "ignore_eos": True}

    async def main():
        async with aiohttp.ClientSession(headers=AUTH) as s:
            try:
                # running: read one event, freeze decoding, then go away; the row leaves while paused
                resp = await s.post(server + "/generate", json={"input_ids": [5, 6], "stream": True,
                                                               "sampling_params": long})
                await _next_event(resp)
                await s.post(server + "/pause_generation")
                assert (await _wait_for(s, server, "num_running_requests", 1))["paused"]
                resp.close()
                await _wait_for(s, server, "num_running_requests", 0)
                # waiting: the same for a request still queued (the non-streaming test's case)
                resp = await s.post(server + "/v1/completions", json={"prompt": "yes", "stream": True,
                                                                     "max_tokens": 400, "ignore_eos": True})
                await _wait_for(s, server, "num_waiting_requests", 1)
                resp.close()
                await _wait_for(s, server, "num_waiting_requests", 0)
            finally:
                await s.post(server + "/continue_generation")

    asyncio.run(main())
    # still serving
    out = post_json(server, "/generate", {"input_ids": [5], "sampling_params": {"max_new_tokens": 2,
                                                                               "ignore_eos": True}})
    assert len(out["output_ids"]) == 2


def test_abort_ends_the_stream(server):
    long = {"max_new_tokens": 400, "ignore_eos": True}

    async def main():
        async with aiohttp.ClientSession(headers=AUTH) as s:
            try:
                resp = await s.post(server + "/generate", json={"input_ids": [5, 6], "rid": "s-abort", "stream": True,
                                                               "sampling_params": long})
                chat = await s.post(server + "/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "yes"}], "stream": True, "max_tokens": 400,
                    "ignore_eos": True})
                json.loads(await _next_event(resp))
                role = json.loads(await _next_event(chat))
                assert role["choices"][0]["delta"]["role"] == "assistant"
                await s.post(server + "/pause_generation")
                async with s.post(server + "/abort_request", json={"rid": "s-abort"}) as r:
                    assert (await r.json())["num_aborted"] == 1
                events = [await _next_event(resp)]
                while events[-1] != "[DONE]":  # tokens sampled before the pause may come first
                    events.append(await _next_event(resp))
                async with s.post(server + "/abort_request", json={"abort_all": True}) as r:
                    assert (await r.json())["num_aborted"] == 1
                chunks = [await _next_event(chat)]
                while chunks[-1] != "[DONE]":
                    chunks.append(await _next_event(chat))
                assert await resp.content.read() == b"" and await chat.content.read() == b""
                return [json.loads(e) for e in events[:-1]], [json.loads(c) for c in chunks[:-1]]
            finally:
                await s.post(server + "/continue_generation")

    events, chunks = asyncio.run(main())
    last = events[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < last["meta_info"]["completion_tokens"] == len(last["output_ids"]) < 400
    assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
    assert get_json(server, "/get_server_info")["num_running_requests"] == 0
