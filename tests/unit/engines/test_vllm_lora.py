"""LoRA adapters through slime's vLLM adapter (SGLang's /load_lora_adapter and /unload_lora_adapter
on vLLM's routes) against the fake vLLM of tests/helpers/fake_vllm.py, and the worker's fix of
vLLM's CPU LoRA ops (no vLLM needed)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from tests.helpers.fake_vllm import http


def peft_dir(path: Path) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    return str(path)


def test_adapter_loads_selects_and_unloads_lora_adapters(adapter, tmp_path):
    """SGLang's /load_lora_adapter and /unload_lora_adapter map onto vLLM's /v1/ routes; /generate's
    lora_path names the completions request's model (vLLM's way to select an adapter)."""
    url, fake, state = adapter
    a1, a2 = peft_dir(tmp_path / "a1"), peft_dir(tmp_path / "a2")
    status, out = http(url, "/load_lora_adapter", {"lora_name": "v1", "lora_path": a1, "pinned": False})
    assert status == 200 and out == {"success": True, "error_message": None, "loaded_adapters": {"v1": a1}}
    assert fake.calls[-1] == ("/v1/load_lora_adapter", {"lora_name": "v1", "lora_path": a1})
    status, out = http(url, "/load_lora_adapter", {"lora_name": "v2", "lora_path": a2})
    assert status == 200 and out["loaded_adapters"] == {"v1": a1, "v2": a2}

    gen = {"input_ids": [4, 5], "return_logprob": True, "sampling_params": {"max_new_tokens": 2}}
    status, out = http(url, "/generate", {**gen, "lora_path": "v1"})
    assert status == 200 and out["output_ids"] == [6, 7] and fake.calls[-1][1]["model"] == "v1"
    http(url, "/generate", gen)
    assert fake.calls[-1][1]["model"] == "slime"  # no lora_path: the base model
    # the batch form: one adapter (or None: the base) per prompt, or one for all
    status, outs = http(url, "/generate", {"input_ids": [[1], [2], [3]], "lora_path": ["v2", None, "v1"],
                                           "sampling_params": {"max_new_tokens": 1}})
    assert status == 200 and [o["output_ids"] for o in outs] == [[2], [3], [4]]
    assert sorted(c[1]["model"] for c in fake.calls[-3:]) == ["slime", "v1", "v2"]
    status, outs = http(url, "/generate", {"input_ids": [[1], [2]], "lora_path": "v2",
                                           "sampling_params": {"max_new_tokens": 1}})
    assert status == 200 and [c[1]["model"] for c in fake.calls[-2:]] == ["v2", "v2"]

    status, out = http(url, "/unload_lora_adapter", {"lora_name": "v1"})
    assert status == 200 and out == {"success": True, "error_message": None, "loaded_adapters": {"v2": a2}}
    assert fake.calls[-1] == ("/v1/unload_lora_adapter", {"lora_name": "v1"})
    assert state.lora_adapters == {"v2": a2} and fake.loras == {"v2": a2}
    # a name can be loaded again once unloaded
    assert http(url, "/load_lora_adapter", {"lora_name": "v1", "lora_path": a2})[0] == 200


@pytest.mark.parametrize("path,body,field,message", [
    ("/load_lora_adapter", {"lora_name": "v1", "lora_path": "{a1}"}, "lora_name", "already loaded"),
    ("/load_lora_adapter", {"lora_name": "x", "lora_path": "/no/such/dir"}, "lora_path", "not a directory"),
    ("/load_lora_adapter", {"lora_name": "x", "lora_path": "{empty}"}, "lora_path", "No adapter found"),  # vLLM's 404
    ("/load_lora_adapter", {"lora_name": "x"}, "lora_path", "non-empty string"),
    ("/load_lora_adapter", {"lora_name": "x", "lora_path": "{a1}", "pinned": "yes"}, "pinned", "boolean"),
    ("/unload_lora_adapter", {"lora_name": "nope"}, "lora_name", "no LoRA adapter named 'nope'"),
    ("/unload_lora_adapter", {}, "lora_name", "non-empty string"),
    ("/generate", {"input_ids": [1], "lora_path": "nope", "sampling_params": {"max_new_tokens": 1}}, "lora_path",
     "no LoRA adapter named 'nope' is loaded (loaded: v1)"),
    ("/generate", {"input_ids": [[1], [2]], "lora_path": ["v1", "nope"], "sampling_params": {"max_new_tokens": 1}},
     "lora_path[1]", "'nope'"),
    ("/generate", {"input_ids": [[1], [2]], "lora_path": ["v1"]}, "lora_path", "one entry per prompt"),
])
def test_adapter_lora_errors_are_400_naming_the_field(adapter, tmp_path, path, body, field, message):
    url, fake, state = adapter
    a1 = peft_dir(tmp_path / "a1")
    (tmp_path / "empty").mkdir()
    assert http(url, "/load_lora_adapter", {"lora_name": "v1", "lora_path": a1})[0] == 200
    body = {k: v.format(a1=a1, empty=tmp_path / "empty") if isinstance(v, str) else v for k, v in body.items()}
    n = len(fake.calls)
    status, out = http(url, path, body)
    assert status == 400, out
    assert out["error"]["param"] == field and message in out["error"]["message"], out
    assert state.lora_adapters == {"v1": a1}
    assert not [c for c in fake.calls[n:] if c[0] in ("/v1/completions", "/v1/unload_lora_adapter")]


def test_adapter_without_lora_enabled_says_so(adapter, tmp_path):
    url, fake, state = adapter
    state.lora = False
    status, out = http(url, "/load_lora_adapter", {"lora_name": "v1", "lora_path": peft_dir(tmp_path / "a")})
    assert status == 400 and "--enable-lora" in out["error"]["message"]
    assert not [c for c in fake.calls if "lora" in c[0]]


def test_unload_waits_for_the_adapters_running_requests(adapter, tmp_path):
    """As SGLang: an unload refuses new requests for the adapter at once and reaches vLLM only after
    the running ones have ended."""
    url, fake, state = adapter
    assert http(url, "/load_lora_adapter", {"lora_name": "v1", "lora_path": peft_dir(tmp_path / "a")})[0] == 200
    fake.gate = threading.Event()
    results = {}
    gen = threading.Thread(target=lambda: results.update(gen=http(url, "/generate", {
        "input_ids": [1], "lora_path": "v1", "sampling_params": {"max_new_tokens": 1}})))
    gen.start()
    deadline = time.monotonic() + 10
    while not [c for c in fake.calls if c[0] == "/v1/completions"]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    unload = threading.Thread(target=lambda: results.update(unload=http(url, "/unload_lora_adapter",
                                                                        {"lora_name": "v1"})))
    unload.start()
    time.sleep(0.5)
    assert unload.is_alive() and not [c for c in fake.calls if c[0] == "/v1/unload_lora_adapter"]
    status, out = http(url, "/generate", {"input_ids": [1], "lora_path": "v1",  # refused at once
                                          "sampling_params": {"max_new_tokens": 1}})
    assert status == 400 and out["error"]["param"] == "lora_path"
    fake.gate.set()
    gen.join(10)
    unload.join(10)
    assert results["gen"][0] == 200 and results["unload"][0] == 200
    assert results["unload"][1]["loaded_adapters"] == {}
    assert fake.calls[-1] == ("/v1/unload_lora_adapter", {"lora_name": "v1"})  # after the request ended
    assert [c[0] for c in fake.calls].count("/v1/completions") == 1 and fake.loras == {}


def test_cpu_lora_ops_skip_base_rows():
    """vLLM's CPU LoRA ops gather `weights[index]`, so a base-model token (index -1) got the last
    adapter slot's delta; the worker extension wraps them so those rows add nothing."""
    import torch

    from slime.engines.vllm.worker import _skip_base_rows

    def bgmv_shrink(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling=1.0):  # vLLM 0.32's op
        selected = lora_a_weights[lora_indices_tensor].to(dtype=output_tensor.dtype).squeeze(dim=1)
        outputs = torch.einsum("bi, boi -> bo", inputs.to(dtype=output_tensor.dtype), selected)
        output_tensor[:, : outputs.shape[1]] = scaling * outputs[:]

    g = torch.Generator().manual_seed(0)
    x, a = torch.randn(3, 4, generator=g), torch.randn(1, 1, 2, 4, generator=g)  # one adapter slot
    idx = torch.tensor([0, -1, 0])
    raw, fixed = torch.zeros(3, 2), torch.zeros(3, 2)
    bgmv_shrink(x, a, raw, idx, 0.5)
    op = _skip_base_rows(bgmv_shrink)
    op(x, a, fixed, idx, 0.5)
    assert raw[1].abs().sum() > 0  # the bug: the base row got slot 0's adapter
    assert fixed[1].abs().sum() == 0 and torch.equal(fixed[[0, 2]], raw[[0, 2]])
    assert _skip_base_rows(op) is op
    every = torch.zeros(3, 2)
    op(x, a, every, torch.zeros(3, dtype=torch.long), 0.5)  # no base rows: the op as it was
    bgmv_shrink(x, a, raw, torch.zeros(3, dtype=torch.long), 0.5)
    assert torch.equal(every, raw)
