"""The vLLM adapter's translation of prompt log-probs (`logprob_start_len`, scoring with
`max_new_tokens: 0`) and top log-probs (`top_logprobs_num`) to vLLM's `prompt_logprobs` /
`logprobs` and back to SGLang's shapes. vLLM's answers are built here the way vLLM 0.32 builds
them (`CompletionResponseChoice`), from a Hugging Face forward of the tiny model, so the
translated numbers can be checked against that forward."""

from __future__ import annotations

import pytest
import torch

from slime.engines.protocol import ProtocolError, parse_generate_request
from slime.engines.vllm.logprobs import logprob_params, wants_prompt_logprobs
from slime.engines.vllm.translate import UpstreamError, empty_response, from_completion_response, to_completion_request

PROMPT = [1, 5, 6, 7, 20, 21, 30, 31]
TOL = 1e-6


def one(body):
    (inp,), _ = parse_generate_request(body)
    return inp


@pytest.fixture(scope="module")
def log_softmax(tiny_model_dir):
    """ids -> [len(ids), V] log_softmax of the tiny model's logits (row p: the distribution of token p + 1)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()

    def fn(ids, temperature=1.0):
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float() / temperature, -1)

    return fn


def vllm_choice(lsm, prompt, output, n, prompt_logprobs: bool, temperature=1.0) -> dict:
    """vLLM's choice for `prompt` -> `output`: `prompt_logprobs` (null, then per position the prompt
    token and the n most likely, keyed by id) and `logprobs.top_logprobs` (the sampled token and the n
    most likely, keyed `token_id:<id>`), in vLLM's order (the chosen token first)."""
    raw = lsm(prompt)
    choice = {"index": 0, "text": "x" * len(output), "token_ids": list(output), "finish_reason": "length",
              "stop_reason": None, "prompt_token_ids": list(prompt)}
    if prompt_logprobs:
        rows = [None]
        for p in range(1, len(prompt)):
            vals, ids = torch.topk(raw[p - 1], n) if n else (torch.empty(0), torch.empty(0, dtype=torch.long))
            row = {str(prompt[p]): {"logprob": float(raw[p - 1, prompt[p]]), "rank": 1, "decoded_token": "t"}}
            for r, (v, i) in enumerate(zip(vals.tolist(), ids.tolist())):
                row.setdefault(str(i), {"logprob": v, "rank": r + 1, "decoded_token": "t"})
            rows.append(row)
        choice["prompt_logprobs"] = rows
    full = lsm(prompt + output, temperature)
    token_lps, tops = [], []
    for i, t in enumerate(output):
        row = full[len(prompt) - 1 + i]
        token_lps.append(float(row[t]))
        top = {f"token_id:{t}": float(row[t])}
        vals, ids = torch.topk(row, n) if n else (torch.empty(0), torch.empty(0, dtype=torch.long))
        for v, j in zip(vals.tolist(), ids.tolist()):
            top.setdefault(f"token_id:{j}", v)
        tops.append(top)
    choice["logprobs"] = {"token_logprobs": token_lps, "tokens": [f"token_id:{t}" for t in output],
                          "top_logprobs": tops, "text_offset": list(range(len(output)))}
    return {"id": "cmpl-r-0", "choices": [choice],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(output)}}


# ---------------------------------------------------------------- requests
def test_scoring_request_asks_vllm_for_prompt_logprobs_and_one_token():
    inp = one({"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 3,
               "sampling_params": {"max_new_tokens": 0, "temperature": 0.8, "top_k": 5}})
    body = to_completion_request(inp, "slime")
    assert body["prompt_logprobs"] == 3 and body["logprobs"] == 3 and body["return_tokens_as_token_ids"] is True
    assert body["max_tokens"] == 1 and body["temperature"] == 0.0 and "top_k" not in body


@pytest.mark.parametrize("extra,prompt_lp", [
    ({}, None),  # SGLang's default start: the last prompt token, nothing to compute
    ({"logprob_start_len": len(PROMPT) - 1}, None),
    ({"logprob_start_len": 2}, 0),
    ({"logprob_start_len": 2, "top_logprobs_num": 4}, 4),
])
def test_prompt_logprobs_only_when_a_position_is_computed(extra, prompt_lp):
    inp = one({"input_ids": PROMPT, "return_logprob": True, **extra, "sampling_params": {"max_new_tokens": 4}})
    body = to_completion_request(inp, "slime")
    assert body.get("prompt_logprobs") == prompt_lp and body["max_tokens"] == 4
    assert body["logprobs"] == extra.get("top_logprobs_num", 0)
    # options without return_logprob are ignored, as SGLang ignores them
    quiet = one({"input_ids": PROMPT, **extra})
    assert logprob_params(quiet) == {} and not wants_prompt_logprobs(quiet)
    # a text prompt's length is unknown until vLLM tokenizes it: any start >= 0 asks
    text = one({"text": "hi", "return_logprob": True, "logprob_start_len": 5})
    assert to_completion_request(text, "slime")["prompt_logprobs"] == 0


def test_top_logprobs_ask_for_token_ids_even_with_texts():
    inp = one({"input_ids": PROMPT, "return_logprob": True, "return_text_in_logprobs": True, "top_logprobs_num": 2})
    assert to_completion_request(inp, "slime")["return_tokens_as_token_ids"] is True
    inp = one({"input_ids": PROMPT, "return_logprob": True, "return_text_in_logprobs": True})
    assert to_completion_request(inp, "slime")["return_tokens_as_token_ids"] is False


# ---------------------------------------------------------------- responses
@pytest.mark.parametrize("start", [0, 3])
def test_scoring_response_equals_hugging_face(log_softmax, start):
    n = 3
    inp = one({"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": start, "top_logprobs_num": n,
               "sampling_params": {"max_new_tokens": 0}})
    resp = vllm_choice(log_softmax, PROMPT, [9], n, prompt_logprobs=True)  # the one token vLLM had to make
    out = from_completion_response(inp, resp, "2")
    meta = out["meta_info"]
    assert out["output_ids"] == [] and out["text"] == "" and meta["completion_tokens"] == 0
    assert meta["output_token_logprobs"] == [] and meta["output_top_logprobs"] == []
    assert meta["finish_reason"] == {"type": "length", "length": 0, "matched": None}
    ref = log_softmax(PROMPT)
    entries = meta["input_token_logprobs"]
    assert [e[1] for e in entries] == PROMPT[start:] and entries[0][0] is None
    positions = range(start + 1, len(PROMPT))
    assert max(abs(e[0] - float(ref[p - 1, PROMPT[p]])) for p, e in zip(positions, entries[1:])) < TOL
    tops = meta["input_top_logprobs"]
    assert len(tops) == len(entries) and tops[0] is None
    for p, row in zip(range(start + 1, len(PROMPT)), tops[1:]):
        vals, ids = torch.topk(ref[p - 1], n)  # the prompt token, when not among them, is cut
        assert [e[1] for e in row] == ids.tolist() and all(e[2] is None for e in row)
        assert max(abs(e[0] - v) for e, v in zip(row, vals.tolist())) < TOL


def test_output_top_logprobs_equal_torch_topk(log_softmax):
    n, temperature, output = 4, 0.7, [40, 2, 17]
    inp = one({"input_ids": PROMPT, "return_logprob": True, "top_logprobs_num": n,
               "sampling_params": {"max_new_tokens": 3, "temperature": temperature}})
    out = from_completion_response(inp, vllm_choice(log_softmax, PROMPT, output, n, False, temperature), "0")
    meta = out["meta_info"]
    assert out["output_ids"] == output
    full = log_softmax(PROMPT + output, temperature)
    for i, row in enumerate(meta["output_top_logprobs"]):
        vals, ids = torch.topk(full[len(PROMPT) - 1 + i], n)
        assert [e[1] for e in row] == ids.tolist()
        assert [e[0] for e in row] == sorted((e[0] for e in row), reverse=True)
        assert max(abs(e[0] - v) for e, v in zip(row, vals.tolist())) < TOL
    assert meta["input_token_logprobs"] == [[None, PROMPT[-1], None]] and meta["input_top_logprobs"] == [None]


def test_texts_come_from_the_decoder_when_vllm_names_ids(log_softmax):
    inp = one({"input_ids": PROMPT, "return_logprob": True, "return_text_in_logprobs": True, "logprob_start_len": 5,
               "top_logprobs_num": 2, "sampling_params": {"max_new_tokens": 2}})
    out = from_completion_response(inp, vllm_choice(log_softmax, PROMPT, [3, 4], 2, True), "0",
                                   decode=lambda ids: [f"<{t}>" for t in ids])
    meta = out["meta_info"]
    for e in meta["input_token_logprobs"] + meta["output_token_logprobs"]:
        assert e[2] == f"<{e[1]}>"
    for row in meta["input_top_logprobs"][1:] + meta["output_top_logprobs"]:
        assert all(e[2] == f"<{e[1]}>" for e in row)


def test_text_prompt_positions_come_from_vllms_prompt_token_ids(log_softmax):
    inp = one({"text": "a prompt", "return_logprob": True, "logprob_start_len": 6,
               "sampling_params": {"max_new_tokens": 0}})
    meta = from_completion_response(inp, vllm_choice(log_softmax, PROMPT, [9], 0, True), "0")["meta_info"]
    assert [e[1] for e in meta["input_token_logprobs"]] == PROMPT[6:]
    assert abs(meta["input_token_logprobs"][1][0] - float(log_softmax(PROMPT)[6, PROMPT[7]])) < TOL
    too_far = one({"text": "a prompt", "return_logprob": True, "logprob_start_len": 8})
    with pytest.raises(ProtocolError) as e:
        from_completion_response(too_far, vllm_choice(log_softmax, PROMPT, [9], 0, True), "0")
    assert e.value.field == "logprob_start_len" and "8 tokens" in e.value.message


def test_inconsistent_prompt_logprobs_are_upstream_errors(log_softmax):
    inp = one({"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": 0,
               "sampling_params": {"max_new_tokens": 0}})
    short = vllm_choice(log_softmax, PROMPT, [9], 0, True)
    short["choices"][0]["prompt_logprobs"].pop()
    with pytest.raises(UpstreamError, match="7 prompt log-prob positions for a prompt of 8 tokens"):
        from_completion_response(inp, short, "0")
    wrong = vllm_choice(log_softmax, PROMPT, [9], 0, True)
    wrong["choices"][0]["prompt_logprobs"][3] = {"99": {"logprob": -1.0}}
    with pytest.raises(UpstreamError, match="lack the prompt token 7"):
        from_completion_response(inp, wrong, "0")
    inp = one({"input_ids": PROMPT, "return_logprob": True, "top_logprobs_num": 2})
    bare = vllm_choice(log_softmax, PROMPT, [9], 0, False)
    del bare["choices"][0]["logprobs"]["top_logprobs"]
    with pytest.raises(UpstreamError, match="no top log-prob positions"):
        from_completion_response(inp, bare, "0")


def test_empty_response_is_sglangs_prefill_only_answer():
    meta = empty_response(one({"input_ids": PROMPT, "return_logprob": True, "top_logprobs_num": 2,
                               "sampling_params": {"max_new_tokens": 0}}), "0")["meta_info"]
    assert meta["input_token_logprobs"] == [] and meta["input_top_logprobs"] == []
    assert meta["output_top_logprobs"] == [] and meta["completion_tokens"] == 0
    meta = empty_response(one({"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": len(PROMPT) - 1,
                               "sampling_params": {"max_new_tokens": 0}}), "0")["meta_info"]
    assert meta["input_token_logprobs"] == [[None, PROMPT[-1], None]]
    assert "input_token_logprobs" not in empty_response(one({"input_ids": PROMPT}), "0")["meta_info"]
