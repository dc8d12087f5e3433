"""Prompt log-probs (`logprob_start_len`, scoring with `max_new_tokens: 0`) and top log-probs
(`top_logprobs_num`) of the native engine's `/generate`, in SGLang's shapes, against a plain
Hugging Face forward of the tiny model (fp32) and `torch.topk` of its log-softmax."""

from __future__ import annotations

import pytest
import torch

from slime.engines.control import EngineError
from slime.engines.protocol import MAX_TOP_LOGPROBS_NUM, ProtocolError, parse_generate_request
from tests.helpers.http import post_json
from tests.helpers.native_server import native_server

PROMPT = [1, 5, 6, 7, 20, 21, 30, 31, 40]
TOL = 1e-5


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with native_server(tiny_model_dir, tmp_path_factory.mktemp("native_logprobs") / "log.txt") as (url, _):
        yield url


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def hf_log_softmax(model, ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """[len(ids), V]: row p is log_softmax(logits at p / T), the distribution of token p + 1."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits / temperature, -1)


def generate(url, **body):
    return post_json(url, "/generate", {"input_ids": PROMPT, "return_logprob": True, **body})


def refusal(url, body) -> tuple[int, str]:
    with pytest.raises(EngineError) as e:
        post_json(url, "/generate", body)
    return e.value.status, e.value.server_message


@pytest.mark.parametrize("start", [0, 3, len(PROMPT) - 2])
def test_scoring_equals_hugging_face_log_softmax(server, hf, start):
    out = generate(server, logprob_start_len=start, sampling_params={"max_new_tokens": 0})
    meta = out["meta_info"]
    assert out["output_ids"] == [] and out["text"] == ""
    assert meta["completion_tokens"] == 0 and meta["output_token_logprobs"] == []
    assert meta["finish_reason"] == {"type": "length", "length": 0, "matched": None}
    assert meta["prompt_tokens"] == len(PROMPT)
    entries = meta["input_token_logprobs"]
    assert [e[1] for e in entries] == PROMPT[start:] and all(e[2] is None for e in entries)
    assert entries[0][0] is None  # SGLang: the first returned position has no log-prob, whatever K is
    ref = hf_log_softmax(hf, PROMPT)
    want = [float(ref[p - 1, PROMPT[p]]) for p in range(start + 1, len(PROMPT))]
    got = [e[0] for e in entries[1:]]
    assert len(got) == len(want) == len(PROMPT) - start - 1
    assert max(abs(a - b) for a, b in zip(got, want)) < TOL
    assert "input_top_logprobs" not in meta and "output_top_logprobs" not in meta


def test_scoring_ignores_the_request_temperature(server, hf):
    """Prompt log-probs are plain log_softmax (temperature 1), as SGLang's are."""
    hot = generate(server, logprob_start_len=0, sampling_params={"max_new_tokens": 0, "temperature": 0.5})
    plain = generate(server, logprob_start_len=0, sampling_params={"max_new_tokens": 0})
    assert hot["meta_info"]["input_token_logprobs"] == plain["meta_info"]["input_token_logprobs"]


def test_top_logprobs_equal_torch_topk(server, hf):
    n, temperature = 5, 0.7
    out = generate(server, logprob_start_len=2, top_logprobs_num=n,
                   sampling_params={"max_new_tokens": 6, "temperature": temperature, "seed": 3, "ignore_eos": True})
    meta, output = out["meta_info"], out["output_ids"]
    assert len(output) == 6 and meta["completion_tokens"] == 6
    # output positions: log_softmax(logits / T) of the prompt + output so far
    ref_out = hf_log_softmax(hf, PROMPT + output, temperature)[len(PROMPT) - 1:-1]
    tops = meta["output_top_logprobs"]
    assert len(tops) == len(output)
    for i, row in enumerate(tops):
        vals, ids = torch.topk(ref_out[i], n)
        assert [e[1] for e in row] == ids.tolist()
        assert max(abs(e[0] - v) for e, v in zip(row, vals.tolist())) < TOL
        assert [e[0] for e in row] == sorted((e[0] for e in row), reverse=True)
        assert all(e[2] is None for e in row)
    # the sampled tokens' log-probs follow the same convention
    lps = [e[0] for e in meta["output_token_logprobs"]]
    assert max(abs(a - float(ref_out[i, t])) for i, (a, t) in enumerate(zip(lps, output))) < TOL
    # prompt positions: plain log_softmax, first None
    ref_in = hf_log_softmax(hf, PROMPT)
    in_top = meta["input_top_logprobs"]
    assert len(in_top) == len(PROMPT) - 2 and in_top[0] is None
    for p, row in zip(range(3, len(PROMPT)), in_top[1:]):
        vals, ids = torch.topk(ref_in[p - 1], n)
        assert [e[1] for e in row] == ids.tolist()
        assert max(abs(e[0] - v) for e, v in zip(row, vals.tolist())) < TOL
    entries = meta["input_token_logprobs"]
    assert [e[1] for e in entries] == PROMPT[2:]
    assert max(abs(e[0] - float(ref_in[p - 1, PROMPT[p]])) for p, e in zip(range(3, len(PROMPT)), entries[1:])) < TOL


def test_greedy_top_one_is_the_generated_token(server):
    out = generate(server, top_logprobs_num=1,
                   sampling_params={"max_new_tokens": 5, "temperature": 0, "ignore_eos": True})
    meta = out["meta_info"]
    assert [row[0][1] for row in meta["output_top_logprobs"]] == out["output_ids"]
    pairs = zip(meta["output_top_logprobs"], meta["output_token_logprobs"])
    assert max(abs(row[0][0] - e[0]) for row, e in pairs) < TOL
    # the default start (-1): the last prompt token only, with SGLang's null log-prob
    assert meta["input_token_logprobs"] == [[None, PROMPT[-1], None]]
    assert meta["input_top_logprobs"] == [None]


def test_defaults_and_nothing_to_compute(server):
    # max_new_tokens 0 with the default start: SGLang's prefill-only answer, no prompt positions
    meta = generate(server, sampling_params={"max_new_tokens": 0})["meta_info"]
    assert meta["input_token_logprobs"] == [] and meta["output_token_logprobs"] == []
    assert meta["completion_tokens"] == 0
    # max_new_tokens 0 without return_logprob: just nothing (options are ignored without return_logprob)
    out = post_json(server, "/generate", {"input_ids": PROMPT, "logprob_start_len": 0, "top_logprobs_num": 3,
                                          "sampling_params": {"max_new_tokens": 0}})
    assert out["output_ids"] == [] and out["meta_info"]["completion_tokens"] == 0
    assert not any("logprobs" in k for k in out["meta_info"])
    # start at the last prompt token: nothing past it to compute
    meta = generate(server, logprob_start_len=len(PROMPT) - 1, sampling_params={"max_new_tokens": 0})["meta_info"]
    assert meta["input_token_logprobs"] == [[None, PROMPT[-1], None]]


def test_texts_and_batches(server, hf, tokenizer):
    out = generate(server, logprob_start_len=4, top_logprobs_num=2, return_text_in_logprobs=True,
                   sampling_params={"max_new_tokens": 2, "temperature": 0})
    meta = out["meta_info"]
    for e in meta["input_token_logprobs"] + meta["output_token_logprobs"]:
        assert e[2] == tokenizer.decode([e[1]])
    for row in meta["input_top_logprobs"][1:] + meta["output_top_logprobs"]:
        assert [e[2] for e in row] == [tokenizer.decode([e[1]]) for e in row]
    # a batch with one start per prompt
    other = [2, 9, 8, 7, 6]
    outs = post_json(server, "/generate", {"input_ids": [PROMPT, other], "return_logprob": True,
                                           "logprob_start_len": [1, 0], "sampling_params": {"max_new_tokens": 0}})
    assert [len(o["meta_info"]["input_token_logprobs"]) for o in outs] == [len(PROMPT) - 1, len(other)]
    ref = hf_log_softmax(hf, other)
    got = [e[0] for e in outs[1]["meta_info"]["input_token_logprobs"][1:]]
    assert max(abs(a - float(ref[p - 1, other[p]])) for p, a in zip(range(1, len(other)), got)) < TOL


@pytest.mark.parametrize("body,field,words", [
    ({"top_logprobs_num": -1}, "top_logprobs_num", "from 0 to 20"),
    ({"top_logprobs_num": MAX_TOP_LOGPROBS_NUM + 1}, "top_logprobs_num", "got 21"),
    ({"top_logprobs_num": 2.5}, "top_logprobs_num", "integer"),
    ({"logprob_start_len": -2}, "logprob_start_len", ">= 0"),
    ({"logprob_start_len": len(PROMPT)}, "logprob_start_len", "not below the prompt's length (9 tokens)"),
    ({"logprob_start_len": "1"}, "logprob_start_len", "integer"),
    ({"logprob_start_len": 1, "stream": True}, "stream", "without stream"),
    ({"top_logprobs_num": 1, "stream": True}, "stream", "without stream"),
])
def test_bad_options_are_a_400_naming_the_field(server, body, field, words):
    status, message = refusal(server, {"input_ids": PROMPT, "return_logprob": True, **body,
                                       "sampling_params": {"max_new_tokens": 0}})
    assert status == 400 and message.startswith(field + ":") and words in message and "\n" not in message


def test_batch_refusals_name_the_item(server):
    status, message = refusal(server, {"input_ids": [PROMPT, [3, 4]], "return_logprob": True,
                                       "logprob_start_len": [0, 2]})
    assert status == 400 and message.startswith("logprob_start_len[1]:")
    status, message = refusal(server, {"input_ids": [PROMPT, [3, 4]], "return_logprob": True,
                                       "top_logprobs_num": [0]})
    assert status == 400 and message.startswith("top_logprobs_num:") and "one value per prompt (2)" in message


def test_parse_generate_request_options():
    (inp,), _ = parse_generate_request({"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": None,
                                        "top_logprobs_num": None})
    assert (inp.logprob_start_len, inp.top_logprobs_num) == (-1, 0)
    inputs, _ = parse_generate_request({"input_ids": [[1, 2], [3]], "logprob_start_len": [0, -1],
                                        "top_logprobs_num": 4})
    assert [(i.logprob_start_len, i.top_logprobs_num) for i in inputs] == [(0, 4), (-1, 4)]
    with pytest.raises(ProtocolError) as e:
        parse_generate_request({"input_ids": [1, 2], "top_logprobs_num": [1]})
    assert e.value.field == "top_logprobs_num" and "batch" in e.value.message
