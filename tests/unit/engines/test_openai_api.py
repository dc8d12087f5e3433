"""OpenAI-compatible endpoints of the native engine, driven by the `openai` Python client."""

from __future__ import annotations

import math

import pytest

from tests.helpers.http import get_json, post_json
from tests.helpers.native_server import native_server
from tests.helpers.http import AUTH
from slime.engines.auth import env_api_key

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with native_server(tiny_model_dir, tmp_path_factory.mktemp("oai") / "log.txt", "--max-total-tokens", "256") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    url, _ = server
    return openai.OpenAI(base_url=url + "/v1", api_key=env_api_key(), timeout=60, max_retries=0)


def test_models_and_completions(client, server, tiny_model_dir):
    url, _ = server
    models = client.models.list()
    assert [m.id for m in models.data] == [tiny_model_dir]
    r = client.completions.create(model=tiny_model_dir, prompt="What is 2 + 2?", max_tokens=6, temperature=0.7,
                                  seed=3, logprobs=1, n=3, extra_body={"ignore_eos": True, "top_k": 20})
    assert len(r.choices) == 3 and r.usage.completion_tokens == 18
    extra = r.model_extra
    assert extra["weight_version"] == "0"
    for c in r.choices:
        c = c.model_dump()
        assert c["finish_reason"] == "length" and len(c["token_ids"]) == 6 and c["prompt_token_ids"]
        assert len(c["logprobs"]["token_logprobs"]) == 6 and all(lp <= 0 for lp in c["logprobs"]["token_logprobs"])
    # the same request through /generate gives the same tokens and log-probs (seed + i per sample)
    c0 = r.choices[0].model_dump()
    g = post_json(url, "/generate", {"input_ids": c0["prompt_token_ids"], "return_logprob": True, "sampling_params": {
        "temperature": 0.7, "seed": 3, "max_new_tokens": 6, "ignore_eos": True, "top_k": 20}})
    assert g["output_ids"] == c0["token_ids"]
    assert max(abs(a[0] - b) for a, b in zip(g["meta_info"]["output_token_logprobs"],
                                             c0["logprobs"]["token_logprobs"])) < 1e-5
    # token-id prompts and a batch of prompts
    r = client.completions.create(model="x", prompt=[[5, 6, 7], [8, 9]], max_tokens=2, temperature=0)
    assert [c.model_dump()["prompt_token_ids"] for c in r.choices] == [[5, 6, 7], [8, 9]]
    assert r.usage.prompt_tokens == 5


def test_chat_completions(client, server):
    url, _ = server
    msgs = [{"role": "system", "content": "say yes"}, {"role": "user", "content": "what is 1 plus 1 ?"}]
    r = client.chat.completions.create(model="m", messages=msgs, max_tokens=5, temperature=0, logprobs=True,
                                       extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert c.message.role == "assistant" and c.finish_reason == "length"
    assert len(c.logprobs.content) == 5 and all(t.logprob <= 0 for t in c.logprobs.content)
    extra = r.model_extra
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(get_json(url, "/get_model_info")["tokenizer_path"])
    ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert extra["prompt_token_ids"] == list(ids)
    assert c.model_dump()["token_ids"] == post_json(url, "/generate", {"input_ids": list(ids), "sampling_params": {
        "temperature": 0, "max_new_tokens": 5, "ignore_eos": True}})["output_ids"]
    assert math.isfinite(sum(t.logprob for t in c.logprobs.content))
    # no max_tokens: generation stops at the context / KV budget, never a 400
    r = client.chat.completions.create(model="m", messages=msgs, temperature=1.0, seed=1)
    assert r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("path,payload,field", [
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -2}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 400}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 5}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"prompt": "hi", "stream": True, "stream_options": {"x": 1}}, "stream_options.x"),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": 0.5}, "frequency_penalty"),
    ("/v1/completions", {"prompt": "hi", "bogus": 1}, "bogus"),
    ("/v1/completions", {"prompt": [5] * 600}, "prompt"),
    ("/v1/completions", {"prompt": [1, 10**7]}, "prompt"),
    ("/v1/completions", {}, "prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"content": "x"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stop": 7}, "stop"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
])
def test_bad_openai_requests_are_400(server, path, payload, field):
    import json
    import urllib.error
    import urllib.request

    url, proc = server
    req = urllib.request.Request(url + path, data=json.dumps(payload).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **AUTH})
    with pytest.raises(urllib.error.HTTPError) as ei:
        urllib.request.urlopen(req, timeout=30)
    body = json.loads(ei.value.read())
    assert ei.value.code == 400 and field in body["error"]["message"], body
    assert proc.poll() is None


def test_openai_client_sees_400(client):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="m", prompt="hi", temperature=-3)
