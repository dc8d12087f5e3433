"""The embedded native engine: numerics vs Hugging Face, scheduler, finish reasons, and
the HTTP server (SGLang-native protocol) run as `python -m slime.engines.native`."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
import torch

from slime.engines.control import AsyncEngineControl, EngineError
from slime.engines.native.engine import NativeEngine
from slime.engines.protocol import ProtocolError
from tests.helpers.http import get_json, post_bytes, post_json
from tests.helpers.native_server import native_server
from tests.helpers.http import AUTH

PROMPTS = ["What is 12 - 3? Answer:", "1 + 1 = 2.", "please reply with only the final result", "7"]


# ---------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def hf_model(sharp_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(sharp_model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()


@pytest.fixture(scope="module")
def engine(sharp_model_dir):
    eng = NativeEngine(sharp_model_dir, num_threads=1, random_seed=0).start()
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    """`python -m slime.engines.native` on a free port; yields (url, stdout_path)."""
    log = tmp_path_factory.mktemp("native_server") / "stdout.txt"
    with native_server(tiny_model_dir, log) as (url, _):
        yield url, log


def _encode(engine, text):
    return engine.tokenizer.encode(text)


def _run_concurrently(fns):
    out = [None] * len(fns)
    errs = []

    def run(i, fn):
        try:
            out[i] = fn()
        except BaseException as e:  # noqa: BLE001
            errs.append(e)

    ths = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate(fns)]
    for t in ths:
        t.start()
    for t in ths:
        t.join(120)
    assert not errs, errs
    return out


def _ref_logprobs(model, prompt_ids, output_ids, temperature):
    full = torch.tensor([prompt_ids + output_ids])
    with torch.no_grad():
        logits = model(full).logits[0, len(prompt_ids) - 1 : -1].float()
    T = temperature if temperature > 0 else 1.0
    return torch.log_softmax(logits / T, -1).gather(1, torch.tensor(output_ids)[:, None]).view(-1)


# ---------------------------------------------------------------- engine numerics
def test_greedy_matches_hf_generate(engine, hf_model):
    prompts = [_encode(engine, p) for p in PROMPTS]
    # run them concurrently so they share a padded batch
    results = _run_concurrently(
        [lambda p=p: engine.generate(p, {"temperature": 0, "max_new_tokens": 24}) for p in prompts]
    )
    for p, r in zip(prompts, results):
        ids = torch.tensor([p])
        ref = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24,
                                pad_token_id=engine.pad_token_id)
        assert r.output_ids == ref[0, len(p):].tolist()
        assert len(set(r.output_ids)) > 3  # the sharp model does not just repeat a token


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_full_forward(engine, hf_model, temperature):
    prompts = [_encode(engine, p) for p in PROMPTS]
    sp = {"temperature": temperature, "top_p": 0.9, "top_k": 50, "max_new_tokens": 20, "ignore_eos": True}
    results = _run_concurrently(
        [lambda p=p, i=i: engine.generate(p, dict(sp, seed=100 + i)) for i, p in enumerate(prompts)]
    )
    for p, r in zip(prompts, results):
        assert len(r.output_ids) == 20 and len(r.output_token_logprobs) == 20
        ref = _ref_logprobs(hf_model, p, r.output_ids, temperature)
        diff = (ref - torch.tensor(r.output_token_logprobs)).abs().max().item()
        assert diff < 1e-4, diff


def test_seed_reproducible_regardless_of_batch(engine):
    p = _encode(engine, PROMPTS[0])
    sp = {"temperature": 1.0, "max_new_tokens": 16, "ignore_eos": True, "seed": 1234}
    alone = engine.generate(p, sp)
    others = [lambda q=_encode(engine, t): engine.generate(q, {"temperature": 1.0, "max_new_tokens": 30,
                                                               "ignore_eos": True}) for t in PROMPTS[1:]]
    batched = _run_concurrently([lambda: engine.generate(p, sp)] + others * 2)[0]
    assert batched.output_ids == alone.output_ids
    assert max(abs(a - b) for a, b in zip(batched.output_token_logprobs, alone.output_token_logprobs)) < 1e-4
    other_seed = engine.generate(p, dict(sp, seed=99))
    assert other_seed.output_ids != alone.output_ids


def test_prefix_sharing_for_n_samples(engine):
    p = _encode(engine, PROMPTS[2])
    before = engine.stats()["shared_prefix_rows"]
    sps = [{"temperature": 1.0, "max_new_tokens": 12, "ignore_eos": True, "seed": s} for s in range(6)]
    engine.pause()  # queue all 6, then admit them in one prefill
    try:
        box = []
        evs = []
        for sp in sps:
            ev = threading.Event()
            evs.append(ev)
            from slime.engines.protocol import GenerateInput, parse_sampling_params

            engine.submit(GenerateInput(rid=f"n{len(evs)}", sampling_params=parse_sampling_params(sp), input_ids=p),
                          lambda res, err, ev=ev: (box.append((res, err)), ev.set()))
    finally:
        engine.resume()
    for ev in evs:
        assert ev.wait(60)
    assert engine.stats()["shared_prefix_rows"] - before == 5
    by_rid = {res.rid: res for res, err in box}
    for i, sp in enumerate(sps):
        assert by_rid[f"n{i + 1}"].output_ids == engine.generate(p, sp).output_ids


def test_continuous_batching_join_and_leave_is_exact(engine):
    """Requests with different lengths join a running batch at different steps and leave
    it at different steps; every greedy output equals its solo run."""
    prompts = [_encode(engine, t) for t in PROMPTS]
    lens = [40, 5, 17, 9]
    solo = [engine.generate(p, {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}).output_ids
            for p, n in zip(prompts, lens)]

    def delayed(i):
        time.sleep(0.01 * i)
        return engine.generate(prompts[i], {"temperature": 0, "max_new_tokens": lens[i], "ignore_eos": True})

    engine._max_batch = 0
    got = _run_concurrently([lambda i=i: delayed(i) for i in range(4)] * 2)
    assert [g.output_ids for g in got] == solo * 2
    assert engine.stats()["max_running_batch_size"] > 1


def test_max_running_requests_bound(sharp_model_dir):
    eng = NativeEngine(sharp_model_dir, num_threads=1, max_running_requests=3).start()
    try:
        p = _encode(eng, PROMPTS[1])
        res = _run_concurrently([lambda: eng.generate(p, {"temperature": 0, "max_new_tokens": 8,
                                                          "ignore_eos": True})] * 8)
        assert all(len(r.output_ids) == 8 for r in res)
        assert eng.stats()["max_running_batch_size"] == 3
    finally:
        eng.shutdown()


def test_finish_reasons(engine):
    p = _encode(engine, PROMPTS[0])
    base = {"temperature": 1.0, "seed": 7, "max_new_tokens": 24, "ignore_eos": True}
    ref = engine.generate(p, base)
    assert ref.finish_reason == {"type": "length", "length": 24, "matched": None}

    # stop_token_ids: stop at the first occurrence of the 6th generated token
    tok = ref.output_ids[5]
    k = ref.output_ids.index(tok)
    r = engine.generate(p, dict(base, ignore_eos=False, stop_token_ids=[tok]))
    assert r.finish_reason == {"type": "stop", "matched": tok}
    assert r.output_ids == ref.output_ids[: k + 1]
    assert r.text == engine.tokenizer.decode(ref.output_ids[:k], skip_special_tokens=True)

    # stop string: cut the text before it; output_ids end with the token completing it
    full_text = engine.tokenizer.decode(ref.output_ids, skip_special_tokens=True)
    stop = engine.tokenizer.decode(ref.output_ids[6:8], skip_special_tokens=True)
    assert stop
    r = engine.generate(p, dict(base, stop=["@@never@@", stop]))
    idx = full_text.find(stop)
    assert r.finish_reason == {"type": "stop", "matched": stop}
    assert r.text == full_text[:idx]
    assert r.output_ids == ref.output_ids[: len(r.output_ids)] and len(r.output_ids) <= 8
    assert stop in engine.tokenizer.decode(r.output_ids, skip_special_tokens=True)
    assert stop not in engine.tokenizer.decode(r.output_ids[:-1], skip_special_tokens=True)
    r2 = engine.generate(p, dict(base, stop=stop, no_stop_trim=True))
    assert r2.text.endswith(stop) or stop in r2.text

    # EOS (make the greedy first token an EOS id) stops unless ignore_eos
    g = engine.generate(p, {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True})
    saved = set(engine.eos_token_ids)
    engine.eos_token_ids = saved | {g.output_ids[2]}
    try:
        r = engine.generate(p, {"temperature": 0, "max_new_tokens": 8})
        assert r.finish_reason == {"type": "stop", "matched": g.output_ids[2]}
        assert r.output_ids == g.output_ids[: g.output_ids.index(g.output_ids[2]) + 1]
        r = engine.generate(p, {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True})
        assert r.finish_reason["type"] == "length" and r.output_ids == g.output_ids
    finally:
        engine.eos_token_ids = saved
    assert engine.tokenizer.eos_token_id in engine.eos_token_ids

    r = engine.generate(p, {"max_new_tokens": 0})
    assert r.output_ids == [] and r.finish_reason["type"] == "length" and r.text == ""


def test_generation_capped_at_context(engine):
    p = _encode(engine, PROMPTS[0])
    long_prompt = (p * 200)[: engine.max_context_length - 3]
    r = engine.generate(long_prompt, {"temperature": 0, "max_new_tokens": 50, "ignore_eos": True})
    assert len(r.output_ids) == 3 and r.finish_reason["type"] == "length"
    with pytest.raises(ProtocolError, match="context length"):
        engine.generate(p * 200, {"max_new_tokens": 1})


# ---------------------------------------------------------------- HTTP server
def _post(url, path, payload, raw: bytes | None = None):
    data = raw if raw is not None else json.dumps(payload).encode()
    req = urllib.request.Request(url + path, data=data, method="POST", headers={"Content-Type": "application/json", **AUTH})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_cli_ready_line_and_info(server, tiny_model_dir):
    url, log = server
    assert f"slime native engine ready on {url}" in log.read_text()
    info = get_json(url, "/get_model_info")
    assert info["is_generation"] is True and info["max_context_length"] == 512
    assert info["model_path"] == tiny_model_dir and info["tokenizer_path"] == tiny_model_dir
    assert get_json(url, "/get_weight_version") == {"weight_version": "0"}
    assert get_json(url, "/health_generate")["status"] == "ok"
    assert post_json(url, "/flush_cache")["success"] is True


def test_cli_missing_model_dir(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "slime.engines.native", "--model-path", str(tmp_path / "nope")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "nope" in proc.stderr and "error" in proc.stderr.lower()
    assert len(proc.stderr.strip().splitlines()) == 1


def test_http_generate_roundtrip(server):
    url, _ = server
    status, body = _post(url, "/generate", {"text": "What is 2 + 2?", "rid": "r1", "return_logprob": True,
                                            "sampling_params": {"temperature": 0.5, "max_new_tokens": 5,
                                                                "ignore_eos": True, "seed": 3}})
    assert status == 200, body
    meta = body["meta_info"]
    assert meta["id"] == "r1" and meta["weight_version"] == "0"
    assert meta["finish_reason"] == {"type": "length", "length": 5, "matched": None}
    assert meta["completion_tokens"] == 5 == len(body["output_ids"])
    assert meta["prompt_tokens"] > 0
    lps = meta["output_token_logprobs"]
    assert [t for _, t, _ in lps] == body["output_ids"] and all(lp <= 0 and x is None for lp, _, x in lps)
    # the rollout timeline's split (slime.observability.spans): queue, prefill, the rest is decode
    assert meta["engine_url"] == url
    assert 0 <= meta["queue_time"] and 0 < meta["prefill_time"] and meta["queue_time"] + meta["prefill_time"] < \
        meta["e2e_latency"] < 60
    # same seed via input_ids gives the same sample
    from transformers import AutoTokenizer

    status, body2 = _post(url, "/generate", {"input_ids": AutoTokenizer.from_pretrained(get_json(
        url, "/get_model_info")["tokenizer_path"]).encode("What is 2 + 2?"), "sampling_params": {
        "temperature": 0.5, "max_new_tokens": 5, "ignore_eos": True, "seed": 3}})
    assert body2["output_ids"] == body["output_ids"] and "output_token_logprobs" not in body2["meta_info"]
    # SGLang batch form
    status, out = _post(url, "/generate", {"text": ["1 + 1 =", "2 + 2 ="], "sampling_params": {"max_new_tokens": 3,
                                                                                             "ignore_eos": True}})
    assert status == 200 and isinstance(out, list) and [len(o["output_ids"]) for o in out] == [3, 3]


BAD_REQUESTS = [
    ({"sampling_params": {"max_new_tokens": 2}}, "input_ids"),
    ({"input_ids": []}, "input_ids"),
    ({"text": ""}, "text"),
    ({"input_ids": [1, 2], "text": "x"}, "input_ids"),
    ({"input_ids": [1, "a"]}, "input_ids[1]"),
    ({"input_ids": [1, -2]}, "input_ids[1]"),
    ({"input_ids": [1, 10**6]}, "input_ids[1]"),
    ({"input_ids": [5] * 600}, "input_ids"),
    ({"input_ids": [5], "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ({"input_ids": [5], "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature"),
    ({"input_ids": [5], "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
    ({"input_ids": [5], "sampling_params": {"top_p": 1.5}}, "sampling_params.top_p"),
    ({"input_ids": [5], "sampling_params": {"top_k": 0}}, "sampling_params.top_k"),
    ({"input_ids": [5], "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens"),
    ({"input_ids": [5], "sampling_params": {"max_new_tokens": 1.5}}, "sampling_params.max_new_tokens"),
    ({"input_ids": [5], "sampling_params": {"stop": 3}}, "sampling_params.stop"),
    ({"input_ids": [5], "sampling_params": {"stop_token_ids": ["a"]}}, "sampling_params.stop_token_ids"),
    ({"input_ids": [5], "sampling_params": {"ignore_eos": "yes"}}, "sampling_params.ignore_eos"),
    ({"input_ids": [5], "sampling_params": {"seed": "x"}}, "sampling_params.seed"),
    ({"input_ids": [5], "sampling_params": {"frobnicate": 1}}, "sampling_params.frobnicate"),
    ({"input_ids": [5], "sampling_params": {"repetition_penalty": 1.3}}, "sampling_params.repetition_penalty"),
    ({"input_ids": [5], "sampling_params": "greedy"}, "sampling_params"),
    ({"input_ids": [5], "return_logprob": "yes"}, "return_logprob"),
    ({"input_ids": [5], "rid": 5}, "rid"),
    ({"input_ids": [5], "stream": "yes"}, "stream"),
    ({"input_ids": [5], "bogus": 1}, "bogus"),
    ([1, 2, 3], "body"),
]


def test_bad_requests_are_400_and_engine_keeps_serving(server):
    url, _ = server
    for payload, field in BAD_REQUESTS:
        status, body = _post(url, "/generate", payload)
        assert status == 400, (payload, body)
        assert field in body["error"]["message"], (payload, body)
    status, body = _post(url, "/generate", None, raw=b"{not json")
    assert status == 400 and "body" in body["error"]["message"] and "JSON" in body["error"]["message"]
    status, body = _post(url, "/abort_request", {})
    assert status == 400 and "rid" in body["error"]["message"]
    status, body = _post(url, "/update_weights_from_disk", {"model_path": "/does/not/exist"})
    assert status == 400 and "model_path" in body["error"]["message"]
    # still serving
    status, body = _post(url, "/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2,
                                                                                      "ignore_eos": True}})
    assert status == 200 and len(body["output_ids"]) == 2


def test_concurrent_requests_are_batched_and_health_stays_responsive(server):
    url, _ = server

    async def main():
        client = AsyncEngineControl(url, timeout=120)
        try:
            payloads = [{"input_ids": [5 + i, 6, 7], "sampling_params": {"temperature": 1.0, "max_new_tokens": 48,
                                                                          "ignore_eos": True}} for i in range(16)]
            tasks = [asyncio.create_task(client.generate(p)) for p in payloads]
            await asyncio.sleep(0.05)
            t0 = time.perf_counter()
            await client.health()
            health_latency = time.perf_counter() - t0
            outs = await asyncio.gather(*tasks)
            info = await client.server_info()
            return outs, info, health_latency
        finally:
            await client.close()

    outs, info, health_latency = asyncio.run(main())
    assert all(o["meta_info"]["completion_tokens"] == 48 for o in outs)
    assert info["max_running_batch_size"] > 1
    assert health_latency < 1.0


def test_abort_returns_partial_output(server):
    url, _ = server

    async def main():
        client = AsyncEngineControl(url, timeout=120)
        try:
            task = asyncio.create_task(client.generate({"input_ids": [5, 6], "rid": "to-abort", "sampling_params": {
                "max_new_tokens": 400, "ignore_eos": True}}))
            for _ in range(500):
                if (await client.server_info())["num_running_requests"] >= 1:
                    break
                await asyncio.sleep(0.01)
            await client.pause()
            # while paused, a new request waits in the queue
            waiting = asyncio.create_task(client.generate({"input_ids": [7], "rid": "w", "sampling_params": {
                "max_new_tokens": 4}}))
            for _ in range(500):
                if (await client.server_info())["num_waiting_requests"] >= 1:
                    break
                await asyncio.sleep(0.01)
            assert (await client.abort("to-abort"))["num_aborted"] == 1
            out = await asyncio.wait_for(task, 30)
            assert (await client.abort())["num_aborted"] == 1
            out_w = await asyncio.wait_for(waiting, 30)
            await client.continue_generation()
            after = await client.generate({"input_ids": [5], "sampling_params": {"max_new_tokens": 2,
                                                                                   "ignore_eos": True}})
            return out, out_w, after
        finally:
            await client.continue_generation()
            await client.close()

    out, out_w, after = asyncio.run(main())
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < out["meta_info"]["completion_tokens"] < 400
    assert out_w["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(after["output_ids"]) == 2


def _st_bytes(tensors):
    from safetensors.torch import save

    return save({k: v.contiguous() for k, v in tensors.items()})


def test_update_weights_from_tensor(server, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    url, _ = server
    req = {"input_ids": [5, 6, 7, 8], "return_logprob": True,
           "sampling_params": {"temperature": 0.8, "max_new_tokens": 8, "ignore_eos": True, "seed": 11}}
    status, before = _post(url, "/generate", req)
    assert status == 200
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    V = hf.config.vocab_size

    # 1. zeros into lm_head (tied to the embeddings): every logit is 0 -> log-prob -log(V), greedy picks 0
    res = post_bytes(url, "/update_weights_from_tensor",
                     _st_bytes({"lm_head.weight": torch.zeros(V, hf.config.hidden_size)}),
                     params={"weight_version": "7"}, timeout=60)
    assert res == {"success": True, "weight_version": "7", "num_tensors": 1, "message": "Succeeded."}
    status, zero = _post(url, "/generate", dict(req, sampling_params=dict(req["sampling_params"], temperature=0)))
    assert zero["meta_info"]["weight_version"] == "7" and get_json(url, "/get_weight_version")["weight_version"] == "7"
    assert zero["output_ids"] == [0] * 8
    assert all(abs(lp + math.log(V)) < 1e-5 for lp, _, _ in zero["meta_info"]["output_token_logprobs"])

    # 2. a perturbed tensor, in two buckets: engine log-probs match HF with the same weights
    sd = hf.state_dict()
    new_norm = sd["model.norm.weight"] * 3.0 + 0.5
    new_q = sd["model.layers.0.self_attn.q_proj.weight"] * -2.0
    post_bytes(url, "/update_weights_from_tensor", _st_bytes({"lm_head.weight": sd["lm_head.weight"]}),
               params={"weight_version": "8", "flush_cache": False}, timeout=60)
    post_bytes(url, "/update_weights_from_tensor",
               _st_bytes({"model.norm.weight": new_norm, "model.layers.0.self_attn.q_proj.weight": new_q}),
               params={"weight_version": "8"}, timeout=60)
    with torch.no_grad():
        hf.model.norm.weight.copy_(new_norm)
        hf.model.layers[0].self_attn.q_proj.weight.copy_(new_q)
    status, pert = _post(url, "/generate", req)
    lps = [lp for lp, _, _ in pert["meta_info"]["output_token_logprobs"]]
    ref = _ref_logprobs(hf, req["input_ids"], pert["output_ids"], 0.8)
    assert (ref - torch.tensor(lps)).abs().max().item() < 1e-4
    assert max(abs(a - b[0]) for a, b in zip(lps, before["meta_info"]["output_token_logprobs"])) > 1e-3

    # 3. bad updates are 400s naming the parameter, and change nothing
    for tensors, field in [({"model.nope.weight": torch.zeros(2)}, "model.nope.weight"),
                           ({"model.norm.weight": torch.zeros(3)}, "model.norm.weight")]:
        with pytest.raises(EngineError) as ei:
            post_bytes(url, "/update_weights_from_tensor", _st_bytes(tensors), params={"weight_version": "9"},
                       timeout=60)
        assert ei.value.status == 400 and field in str(ei.value)
    with pytest.raises(EngineError, match="safetensors"):
        post_bytes(url, "/update_weights_from_tensor", b"garbage", params={}, timeout=60)
    assert get_json(url, "/get_weight_version")["weight_version"] == "8"

    # 4. restore from disk: outputs are back to the original ones
    assert post_json(url, "/update_weights_from_disk", {"model_path": tiny_model_dir, "weight_version": "10"})[
        "weight_version"] == "10"
    status, after = _post(url, "/generate", req)
    assert after["output_ids"] == before["output_ids"] and after["meta_info"]["weight_version"] == "10"
    assert max(abs(a[0] - b[0]) for a, b in zip(after["meta_info"]["output_token_logprobs"],
                                                before["meta_info"]["output_token_logprobs"])) < 1e-5


def test_client_disconnect_frees_the_request(server):
    url, _ = server

    async def main():
        async with AsyncEngineControl(url, timeout=30) as c:
            await c.pause()
            try:
                impatient = AsyncEngineControl(url, timeout=0.5, max_retries=0)
                with pytest.raises(EngineError, match="timed out"):
                    await impatient.generate({"input_ids": [5], "rid": "gone", "sampling_params": {"max_new_tokens": 8}})
                await impatient.close()
                for _ in range(200):
                    info = await c.server_info()
                    if info["num_waiting_requests"] == 0:
                        break
                    await asyncio.sleep(0.02)
                return info
            finally:
                await c.continue_generation()

    assert asyncio.run(main())["num_waiting_requests"] == 0


def test_protocol_accepts_sglang_payloads():
    from slime.engines.protocol import parse_generate_request

    # what slime's rollout sends to SGLang
    (inp,), is_batch = parse_generate_request({
        "input_ids": [1, 2, 3], "return_logprob": True, "logprob_start_len": -1,
        "sampling_params": {"temperature": 1, "top_p": 1.0, "top_k": -1, "max_new_tokens": 8, "stop": None,
                            "stop_token_ids": None, "skip_special_tokens": False, "no_stop_trim": True,
                            "spaces_between_special_tokens": False, "n": 1, "sampling_seed": 5}})
    sp = inp.sampling_params
    assert not is_batch and inp.return_logprob and sp.seed == 5 and sp.no_stop_trim and not sp.skip_special_tokens
    assert sp.stop == [] and sp.stop_token_ids == [] and sp.top_k == -1 and sp.temperature == 1.0
    assert len(inp.rid) == 32
    inputs, is_batch = parse_generate_request({"text": ["a", "b"], "rid": ["x", "y"],
                                               "sampling_params": [{"seed": 1}, {"stop": "q"}]})
    assert is_batch and [i.rid for i in inputs] == ["x", "y"] and inputs[1].sampling_params.stop == ["q"]
    with pytest.raises(ProtocolError) as ei:
        parse_generate_request({"input_ids": [1], "sampling_params": {"n": 4}})
    assert ei.value.field == "sampling_params.n"
