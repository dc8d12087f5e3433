"""Native engine memory: the KV budget (--max-total-tokens) under a burst, and
/release_memory_occupation + /resume_memory_occupation (RSS drops, weights come back bitwise)."""

from __future__ import annotations

import threading
import time

import psutil
import pytest
import torch

from slime.engines.control import EngineError
from slime.engines.native.engine import NativeEngine, peak_kv_tokens
from slime.engines.protocol import GenerateInput, ProtocolError, parse_sampling_params
from slime.utils.weights import compare_digests
from tests.helpers.http import get_json, post_json
from tests.helpers.native_server import native_server


def _submit_many(engine, prompts, sp):
    done, results = threading.Event(), []
    lock = threading.Lock()

    def cb(res, err):
        with lock:
            results.append((res, err))
            if len(results) == len(prompts):
                done.set()

    for i, p in enumerate(prompts):
        engine.submit(GenerateInput(rid=f"b{i}", sampling_params=parse_sampling_params(sp), input_ids=p), cb)
    return done, results


def test_peak_kv_tokens_formula():
    assert peak_kv_tokens([]) == 0
    assert peak_kv_tokens([(10, 20)]) == 20
    # two rows: the long one grows to 30 alone, both together reach 2 x (10 + 5)
    assert peak_kv_tokens([(10, 15), (5, 30)]) == max(2 * 15, 30)
    assert peak_kv_tokens([(10, 40), (5, 30)]) == 2 * (10 + 25)  # both run 25 more steps, padded to 35


def test_kv_budget_bounds_a_burst(tiny_model_dir):
    budget = 400
    eng = NativeEngine(tiny_model_dir, num_threads=1, max_total_tokens=budget, max_running_requests=64).start()
    try:
        prompts = [[5 + (i % 7)] * (3 + i % 11) for i in range(40)]
        done, results = _submit_many(eng, prompts, {"temperature": 1.0, "max_new_tokens": 24, "ignore_eos": True})
        assert done.wait(120)
        assert all(err is None and len(res.output_ids) == 24 for res, err in results)
        st = eng.stats()
        assert 0 < st["peak_kv_tokens"] <= budget, st
        assert st["max_running_batch_size"] > 1  # still batches
        assert st["max_running_batch_size"] < 40  # ... but not everything at once
        assert st["kv_tokens"] == 0 and st["max_total_tokens"] == budget
        # a request that can never fit is refused up front, naming the field
        with pytest.raises(ProtocolError) as ei:
            eng.generate([5] * 10, {"max_new_tokens": 395})
        assert ei.value.field == "sampling_params.max_new_tokens"
        with pytest.raises(ProtocolError) as ei:
            eng.generate([5] * 450, {"max_new_tokens": 1})
        assert ei.value.field == "input_ids"
    finally:
        eng.shutdown()


def test_kv_budget_over_http(tiny_model_dir, tmp_path):
    with native_server(tiny_model_dir, tmp_path / "log.txt", "--max-total-tokens", "300") as (url, proc):
        import asyncio

        from slime.engines.control import AsyncEngineControl

        async def burst():
            async with AsyncEngineControl(url, timeout=120) as c:
                outs = await asyncio.gather(*[c.generate({"input_ids": [5 + i % 5] * 8, "sampling_params": {
                    "max_new_tokens": 30, "ignore_eos": True}}) for i in range(24)])
                return outs, await c.server_info()

        outs, info = asyncio.run(burst())
        assert all(o["meta_info"]["completion_tokens"] == 30 for o in outs)
        assert 0 < info["peak_kv_tokens"] <= 300 and info["max_total_tokens"] == 300
        with pytest.raises(EngineError) as ei:
            post_json(url, "/generate", {"input_ids": [5] * 10, "sampling_params": {"max_new_tokens": 295}})
        assert ei.value.status == 400 and "sampling_params.max_new_tokens" in str(ei.value)
        assert "max-total-tokens" in str(ei.value)
        # memory endpoints: bad tags are 400s; release/resume round trip keeps the weights bitwise
        with pytest.raises(EngineError) as ei:
            post_json(url, "/release_memory_occupation", {"tags": ["gpu"]})
        assert ei.value.status == 400 and "tags" in str(ei.value)
        before = get_json(url, "/weights_checksum")["checksums"]
        r = post_json(url, "/release_memory_occupation", {})
        assert r["success"] and r["released"] == ["kv_cache", "weights"] and "weight_version" in r
        with pytest.raises(EngineError) as ei:
            get_json(url, "/weights_checksum")
        assert ei.value.status == 400 and "resume_memory_occupation" in str(ei.value)
        post_json(url, "/resume_memory_occupation", {"tags": ["weights", "kv_cache"]})
        assert compare_digests(before, get_json(url, "/weights_checksum")["checksums"]) == []
        assert len(post_json(url, "/generate", {"input_ids": [5], "sampling_params": {
            "max_new_tokens": 2, "ignore_eos": True}})["output_ids"]) == 2
        assert proc.poll() is None


@pytest.fixture(scope="module")
def medium_model_dir(tmp_path_factory):
    """~55 MB of fp32 weights, so freeing them shows in RSS."""
    from slime.utils.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("medium"), hidden_size=512, num_layers=4, num_heads=8,
                                num_kv_heads=8, intermediate_size=1536))


def test_release_frees_rss_and_resume_is_bitwise(medium_model_dir):
    eng = NativeEngine(medium_model_dir, num_threads=1).start()
    try:
        nbytes = sum(p.numel() * p.element_size() for p in eng.model.parameters())
        ref = eng.generate([5, 6, 7], {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True})
        before = eng.weights_checksum()
        proc = psutil.Process()
        rss0 = proc.memory_info().rss
        eng.release_memory_occupation()
        rss1 = proc.memory_info().rss
        assert rss0 - rss1 > 0.6 * nbytes, (rss0, rss1, nbytes)
        # while released, requests wait (they do not run) ...
        done, results = _submit_many(eng, [[5, 6, 7]], {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True})
        assert not done.wait(0.5) and eng.stats()["num_waiting_requests"] == 1
        # ... and weight updates are refused naming the cause
        with pytest.raises(ProtocolError, match="resume_memory_occupation"):
            eng.update_weights({"model.norm.weight": torch.ones(512)})
        eng.resume_memory_occupation()
        assert done.wait(60) and results[0][0].output_ids == ref.output_ids
        assert compare_digests(before, eng.weights_checksum()) == []
        # refused while requests are running
        eng.pause()
        done, results = _submit_many(eng, [[5, 6]], {"max_new_tokens": 50, "ignore_eos": True})
        eng.resume()
        for _ in range(200):
            if eng.stats()["num_running_requests"]:
                break
            time.sleep(0.01)
        eng.pause()
        with pytest.raises(ProtocolError, match="running"):
            eng.release_memory_occupation()
        eng.resume()
        assert done.wait(60)
    finally:
        eng.shutdown()
