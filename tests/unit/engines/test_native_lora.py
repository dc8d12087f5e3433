"""LoRA adapters on the native engine (SGLang's protocol): log-probs equal peft's, mixed batches,
reloading under a name, refused adapter directories, weight versions, and the client's calls."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from slime.engines.auth import Access, env_api_key
from slime.engines.control import EngineControl, EngineError
from slime.engines.native.engine import NativeEngine
from slime.engines.native.server import create_app
from slime.engines.protocol import GenerateInput, ProtocolError, parse_sampling_params
from slime.utils.net import free_port
from tests.helpers.http import get_json, post_json

PROMPTS = ["What is 12 - 3? Answer:", "1 + 1 = 2.", "please reply with only the final result"]
GREEDY = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}


# ---------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def model_dir(sharp_model_dir):
    """The sharpened tiny model (tests/unit/engines/conftest.py): an adapter changes its greedy output."""
    return sharp_model_dir


def _peft_model(model_dir: str, seed: int):
    """A peft LoRA (r=4, alpha=8, every Linear) over the model, with random nonzero lora_B."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    pm = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return pm.eval()


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    """{name: (peft model, adapter dir)} for two adapters, 'a' and 'b'."""
    out = {}
    for name, seed in (("a", 1), ("b", 2)):
        pm = _peft_model(model_dir, seed)
        d = tmp_path_factory.mktemp(f"lora_{name}")
        pm.save_pretrained(d)
        out[name] = (pm, str(d))
    return out


@pytest.fixture(scope="module")
def engine(model_dir, adapters):
    eng = NativeEngine(model_dir, num_threads=1, random_seed=0).start()
    for name, (_, path) in adapters.items():
        eng.load_lora_adapter(name, path)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def url(engine, tmp_path_factory):
    """The engine served in-process (aiohttp in a thread), loading only from under pytest's base temp dir."""
    port = free_port()
    access = Access("127.0.0.1", port, api_key=env_api_key(), weight_dirs=(str(tmp_path_factory.getbasetemp()),))
    loop = asyncio.new_event_loop()
    started = threading.Event()
    box = {}

    async def serve():
        from aiohttp import web

        runner = web.AppRunner(create_app(engine, shutdown_engine=False, access=access), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        box["runner"] = runner
        started.set()

    th = threading.Thread(target=lambda: (loop.run_until_complete(serve()), loop.run_forever()), daemon=True)
    th.start()
    assert started.wait(30)
    yield f"http://127.0.0.1:{port}"
    asyncio.run_coroutine_threadsafe(box["runner"].cleanup(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    th.join(30)


def _ids(engine, text):
    return engine.tokenizer.encode(text)


def _teacher_forced(model, prompt, output, temperature):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1].float()
    t = temperature if temperature > 0 else 1.0
    return torch.log_softmax(logits / t, -1).gather(1, torch.tensor(output)[:, None]).view(-1)


def _batch(engine, items, before_resume=None):
    """Queue every (prompt, sampling params, lora) while paused, so they are prefilled and decoded
    together; their results in order."""
    results, done = {}, threading.Event()

    def cb(i):
        def f(res, err):
            results[i] = res if err is None else err
            if len(results) == len(items):
                done.set()
        return f

    engine.pause()
    try:
        for i, (p, sp, lora) in enumerate(items):
            engine.submit(GenerateInput(rid=f"mix{i}", sampling_params=parse_sampling_params(sp), input_ids=p,
                                        lora_name=lora), cb(i))
        if before_resume is not None:
            before_resume()
    finally:
        engine.resume()
    assert done.wait(60)
    return [results[i] for i in range(len(items))]


def _paused_in_flight(engine, prompt, sp, lora, after=3):
    """Submit a request and pause the engine once it has `after` tokens (its token hook holds the
    worker until the pause is requested, so the count is exact). Returns (done, box, tokens so far)."""
    seen, reached, done, box = [], threading.Event(), threading.Event(), []

    def on_token(ids, _lps):
        seen.extend(ids)
        if len(seen) == after:
            reached.set()
            for _ in range(3000):
                if engine.stats()["paused"]:
                    break
                threading.Event().wait(0.01)

    engine.submit(GenerateInput(rid=f"pause-{lora}", sampling_params=parse_sampling_params(sp), input_ids=prompt,
                                lora_name=lora), lambda res, err: (box.append((res, err)), done.set()), on_token)
    assert reached.wait(30)
    engine.pause()
    return done, box, len(seen)


def _copy_adapter(src: str, dst: Path, config=None, tensors=None) -> str:
    shutil.copytree(src, dst)
    if config is not None:
        cfg = json.loads((dst / "adapter_config.json").read_text())
        cfg.update(config)
        (dst / "adapter_config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        save_file(tensors(load_file(dst / "adapter_model.safetensors")), dst / "adapter_model.safetensors")
    return str(dst)


# ---------------------------------------------------------------- numerics
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_peft_and_differ_from_base(engine, adapters, temperature):
    pm, _ = adapters["a"]
    p = _ids(engine, PROMPTS[0])
    sp = {"temperature": temperature, "max_new_tokens": 12, "ignore_eos": True, "seed": 3}
    res = engine.generate(p, sp, lora_name="a")
    got = torch.tensor(res.output_token_logprobs)
    assert (got - _teacher_forced(pm, p, res.output_ids, temperature)).abs().max() < 1e-4
    with pm.disable_adapter():
        base = _teacher_forced(pm, p, res.output_ids, temperature)
    assert (got - base).abs().max() > 1e-2
    plain = engine.generate(p, sp)  # no adapter: the base model
    with pm.disable_adapter():
        assert (torch.tensor(plain.output_token_logprobs) - _teacher_forced(pm, p, plain.output_ids, temperature)
                ).abs().max() < 1e-4


def test_mixed_batch_rows_equal_their_solo_runs(engine):
    p0, p1 = _ids(engine, PROMPTS[0]), _ids(engine, PROMPTS[1])
    # the same prompt under three adapters (prefill dedup must keep them apart) and another prompt
    items = [(p0, GREEDY, "a"), (p0, GREEDY, None), (p0, GREEDY, "b"), (p1, GREEDY, "a"), (p1, GREEDY, None)]
    shared = engine.stats()["shared_prefix_rows"]
    mixed = _batch(engine, items)
    assert engine.stats()["shared_prefix_rows"] == shared
    solo = [engine.generate(p, sp, lora_name=lora) for p, sp, lora in items]
    for m, s in zip(mixed, solo):
        assert m.output_ids == s.output_ids
        assert max(abs(x - y) for x, y in zip(m.output_token_logprobs, s.output_token_logprobs)) < 1e-4
    assert len({tuple(m.output_ids) for m in mixed[:3]}) == 3  # each adapter changes the greedy output
    # n samples of one prompt under one adapter are still prefilled once
    _batch(engine, [(p1, dict(GREEDY, temperature=1.0, seed=s), "b") for s in range(3)])
    assert engine.stats()["shared_prefix_rows"] == shared + 2


def test_reload_under_a_name_and_unload_in_flight(engine, adapters):
    p = _ids(engine, PROMPTS[2])
    engine.load_lora_adapter("r", adapters["a"][1])
    with_a = engine.generate(p, GREEDY, lora_name="r")
    assert with_a.output_ids == engine.generate(p, GREEDY, lora_name="a").output_ids
    # a request in flight: paused after its 3rd token, the adapter behind its name swapped, resumed
    long = dict(GREEDY, max_new_tokens=16)
    done, box, k = _paused_in_flight(engine, p, long, "r")
    engine.unload_lora_adapter("r")
    engine.load_lora_adapter("r", adapters["b"][1])
    engine.resume()
    assert done.wait(30)
    res, err = box[0]
    assert err is None and res.finish_reason["type"] == "length" and len(res.output_ids) == 16
    only_a = engine.generate(p, long, lora_name="a").output_ids
    assert k == 3 and res.output_ids[:3] == only_a[:3] and res.output_ids != only_a
    assert engine.generate(p, GREEDY, lora_name="r").output_ids == engine.generate(p, GREEDY, lora_name="b").output_ids
    # unloaded while in flight: that request ends as aborted, with a message; the engine keeps serving
    done, box, k = _paused_in_flight(engine, p, long, "r")
    engine.unload_lora_adapter("r")
    engine.resume()
    assert done.wait(30)
    res, err = box[0]
    assert err is None and res.finish_reason["type"] == "abort", res.finish_reason
    assert "'r' is no longer loaded" in res.finish_reason["message"] and len(res.output_ids) == 3
    # unloaded while the request waits to be admitted: aborted with no tokens
    engine.load_lora_adapter("r", adapters["a"][1])
    [res] = _batch(engine, [(p, GREEDY, "r")], before_resume=lambda: engine.unload_lora_adapter("r"))
    assert res.finish_reason["type"] == "abort" and res.output_ids == [] and "'r'" in res.finish_reason["message"]
    with pytest.raises(ProtocolError, match="adapter 'r' is not loaded"):
        engine.generate(p, GREEDY, lora_name="r")
    assert "r" not in engine.lora_adapters()


def test_adapters_survive_memory_release_and_weight_updates(engine, model_dir):
    p = _ids(engine, PROMPTS[1])
    before = engine.generate(p, GREEDY, lora_name="b")
    engine.release_memory_occupation()
    engine.resume_memory_occupation()
    assert engine.generate(p, GREEDY, lora_name="b").output_token_logprobs == before.output_token_logprobs
    weights = load_file(Path(model_dir) / "model.safetensors")
    engine.update_weights(weights)  # the same weights again, by Hugging Face name
    assert engine.generate(p, GREEDY, lora_name="b").output_token_logprobs == before.output_token_logprobs


# ---------------------------------------------------------------- HTTP
def test_generate_lora_path_over_http(url, engine):
    p = _ids(engine, PROMPTS[0])
    one = post_json(url, "/generate", {"input_ids": p, "lora_path": "a", "sampling_params": GREEDY,
                                       "return_logprob": True})
    assert one["output_ids"] == engine.generate(p, GREEDY, lora_name="a").output_ids
    batch = post_json(url, "/generate", {"input_ids": [p, p, p], "lora_path": ["a", None, "b"],
                                         "sampling_params": GREEDY})
    assert [b["output_ids"] for b in batch] == [engine.generate(p, GREEDY, lora_name=x).output_ids
                                                for x in ("a", None, "b")]
    for body, field, words in [
        ({"lora_path": "nope"}, "lora_path", "adapter 'nope' is not loaded (loaded: a, b)"),
        ({"lora_path": ["a", "nope"], "input_ids": [p, p]}, "lora_path", "'nope' is not loaded"),
        ({"lora_path": ["a"], "input_ids": [p, p]}, "lora_path", "one entry per prompt"),
        ({"lora_path": 3}, "lora_path", "must be an adapter name"),
    ]:
        with pytest.raises(EngineError) as e:
            post_json(url, "/generate", {"input_ids": p, "sampling_params": GREEDY, **body})
        assert e.value.status == 400 and field in str(e.value) and words in str(e.value), str(e.value)
    # OpenAI routes: `model` naming an adapter uses it, any other name is the base model
    c = post_json(url, "/v1/completions", {"model": "b", "prompt": p, "max_tokens": 10, "temperature": 0,
                                           "ignore_eos": True})
    assert c["choices"][0]["token_ids"] == engine.generate(p, GREEDY, lora_name="b").output_ids
    c = post_json(url, "/v1/completions", {"model": "base", "prompt": p, "max_tokens": 10, "temperature": 0,
                                           "ignore_eos": True})
    assert c["choices"][0]["token_ids"] == engine.generate(p, GREEDY).output_ids
    assert {"a", "b"} <= {m["id"] for m in get_json(url, "/v1/models")["data"]}


BAD = {
    "no_config": (lambda d: (d / "adapter_config.json").unlink(), "has no adapter_config.json"),
    "not_lora": ({"peft_type": "IA3"}, "peft_type is 'IA3'"),
    "dora": ({"use_dora": True}, "use_dora is True; DoRA"),
    "fan_in_fan_out": ({"fan_in_fan_out": True}, "fan_in_fan_out"),
    "bias": ({"bias": "all"}, "bias is 'all'"),
    "modules_to_save": ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    "bin_only": (lambda d: (d / "adapter_model.safetensors").rename(d / "adapter_model.bin"),
                 "only safetensors adapter files are loaded (found adapter_model.bin"),
}
PFX = "base_model.model.model.layers.0."


def _tensor_edit(kind):
    def edit(t):
        q = PFX + "self_attn.q_proj.lora_A.weight"
        a, b = t[q].clone(), t[q.replace("lora_A", "lora_B")].clone()
        if kind == "unknown_module":
            t["base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight"] = a
            t["base_model.model.model.layers.9.self_attn.q_proj.lora_B.weight"] = b
        elif kind == "not_linear":
            t["base_model.model.model.embed_tokens.lora_A.weight"] = a
            t["base_model.model.model.embed_tokens.lora_B.weight"] = b
        elif kind == "shape":
            t[q] = torch.zeros(4, 64)
        elif kind == "missing_b":
            del t[q.replace("lora_A", "lora_B")]
        return t
    return edit


TENSOR_BAD = {
    "unknown_module": "module 'model.layers.9.self_attn.q_proj' is not in the model",
    "not_linear": "module 'model.embed_tokens' is a Embedding, not an nn.Linear",
    "shape": "module 'model.layers.0.self_attn.q_proj': lora_A (4, 64) and lora_B (128, 4) do not fit its "
             "nn.Linear(in=128, out=128)",
    "missing_b": "module 'model.layers.0.self_attn.q_proj' has no lora_B weight",
}


@pytest.mark.parametrize("case", list(BAD) + list(TENSOR_BAD))
def test_bad_adapter_dirs_are_400s_naming_the_problem(url, adapters, tmp_path, case):
    d = tmp_path / "adapter"
    if case in BAD:
        change, words = BAD[case]
        path = _copy_adapter(adapters["a"][1], d, config=change if isinstance(change, dict) else None)
        if callable(change):
            change(d)
    else:
        path, words = _copy_adapter(adapters["a"][1], d, tensors=_tensor_edit(case)), TENSOR_BAD[case]
    with pytest.raises(EngineError) as e:
        EngineControl(url).load_lora_adapter("bad", path)
    assert e.value.status == 400 and "lora_path" in str(e.value) and words in str(e.value), str(e.value)
    if case == "shape":  # names the model the adapter was made for
        assert json.loads((d / "adapter_config.json").read_text())["base_model_name_or_path"] in str(e.value)
    assert "bad" not in EngineControl(url).server_info()["lora_adapters"]


def test_client_calls_against_a_live_server(url, adapters, engine):
    ctl = EngineControl(url)
    resp = ctl.load_lora_adapter("c", adapters["b"][1], pinned=True)
    assert resp == {"success": True, "error_message": None,
                    "loaded_adapters": {"a": adapters["a"][1], "b": adapters["b"][1], "c": adapters["b"][1]}}
    assert ctl.model_info()["lora_adapters"]["c"] == adapters["b"][1]
    p = _ids(engine, PROMPTS[1])
    assert ctl.generate({"input_ids": p, "lora_path": "c", "sampling_params": GREEDY})["output_ids"] == \
        engine.generate(p, GREEDY, lora_name="b").output_ids
    for call, words in [(lambda: ctl.load_lora_adapter("c", adapters["a"][1]), "'c' is already loaded"),
                        (lambda: ctl.unload_lora_adapter("zzz"), "no adapter named 'zzz' is loaded"),
                        (lambda: ctl.load_lora_adapter("d", "/var/elsewhere/lora"), "outside the directories"),
                        (lambda: ctl.load_lora_adapter("", adapters["a"][1]), "lora_name")]:
        with pytest.raises(EngineError) as e:
            call()
        assert e.value.status == 400 and words in str(e.value), str(e.value)
    assert ctl.unload_lora_adapter("c")["loaded_adapters"] == {"a": adapters["a"][1], "b": adapters["b"][1]}
    # weight versions
    assert ctl.update_weight_version("v7")["success"] is True
    assert ctl.weight_version() == "v7"
    assert ctl.generate({"input_ids": p, "sampling_params": GREEDY})["meta_info"]["weight_version"] == "v7"
    assert ctl.update_weight_version(8, abort_all_requests=True)["new_version"] == "8"
    assert ctl.server_info()["weight_version"] == "8"
    with pytest.raises(EngineError) as e:
        ctl.request("POST", "/update_weight_version", json={"new_version": "9", "flush": True})
    assert e.value.status == 400 and "flush" in str(e.value)
