"""The native engine's `return_routed_experts` (SGLang's protocol, for rollout routing replay): the
experts each token was routed to, [len(prompt) + len(output) - 1, MoE layers, top-k] int32 in base64,
equal to the routing of a plain Hugging Face forward (fp32) of prompt + output[:-1], request by request
in mixed batches (left padding, identical prompts prefilled once, rows retiring), in the batched and
the deterministic (per-row forwards) paths; refused on a dense model, on a stream, and by vLLM."""

from __future__ import annotations

import base64
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from slime.engines.control import EngineError
from slime.engines.native.cli import NATIVE_PASS_THROUGH
from slime.engines.protocol import ProtocolError
from slime.engines.vllm.translate import refuse_routed_experts
from slime.utils.moe_routing import RoutingHook, decode
from slime.utils.tiny_model import build_tiny_moe_model
from tests.helpers.http import get_json, post_json
from tests.helpers.native_server import native_server

PROMPT = [1, 5, 6, 7, 20, 21, 30, 31, 40]
SHORT = [2, 9, 8]
LAYERS, TOP_K = 2, 2


@pytest.fixture(scope="module", params=["batched", "deterministic"])
def server(request, tiny_moe_model_dir, tmp_path_factory):
    extra = ("--enable-deterministic-inference", "--enable-return-routed-experts") if request.param != "batched" else ()
    log = tmp_path_factory.mktemp(f"routed_{request.param}") / "log.txt"
    with native_server(tiny_moe_model_dir, log, *extra) as (url, _):
        yield url


@pytest.fixture(scope="module")
def hf_routing(tiny_moe_model_dir):
    return _hf_routing(tiny_moe_model_dir)


def _hf_routing(model_dir):
    """ids -> Tensor[len(ids), layers, top-k]: the routing of one plain fp32 forward of `ids`."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hook = RoutingHook(model)

    def route(ids: list[int]) -> torch.Tensor:
        with torch.no_grad(), hook.recording() as rec:
            model(torch.tensor([ids]), use_cache=False)
        return rec.indices()

    return route


def routed(out: dict) -> torch.Tensor:
    meta = out["meta_info"]
    assert meta["routed_experts_start_len"] == 0
    return decode(base64.b64decode(meta["routed_experts"]), LAYERS, TOP_K)


def check(out: dict, prompt: list[int], hf_routing) -> None:
    """The answer's routed experts: one row per token a forward saw, equal to Hugging Face's routing."""
    got = routed(out)
    seen = prompt + out["output_ids"][:-1]
    assert got.shape == (len(prompt) + len(out["output_ids"]) - 1, LAYERS, TOP_K)
    assert torch.equal(got, hf_routing(seen))


def refusal(url, body) -> tuple[int, str]:
    with pytest.raises(EngineError) as e:
        post_json(url, "/generate", body)
    return e.value.status, e.value.server_message


def test_single_request_equals_hugging_face(server, hf_routing):
    out = post_json(server, "/generate", {"input_ids": PROMPT, "return_routed_experts": True,
                                          "sampling_params": {"max_new_tokens": 12, "ignore_eos": True, "seed": 3}})
    assert len(out["output_ids"]) == 12
    check(out, PROMPT, hf_routing)
    # with prompt log-probs (their forward of the prompt adds no rows) and greedy, stopping on its own
    out = post_json(server, "/generate", {"input_ids": PROMPT, "return_routed_experts": True, "return_logprob": True,
                                          "logprob_start_len": 0, "sampling_params": {"max_new_tokens": 6,
                                                                                      "temperature": 0}})
    assert len(out["meta_info"]["input_token_logprobs"]) == len(PROMPT)
    check(out, PROMPT, hf_routing)
    # one output token: the prompt's rows only
    out = post_json(server, "/generate", {"input_ids": SHORT, "return_routed_experts": True,
                                          "sampling_params": {"max_new_tokens": 1}})
    check(out, SHORT, hf_routing)
    plain = post_json(server, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
    assert "routed_experts" not in plain["meta_info"] and "routed_experts_start_len" not in plain["meta_info"]


def test_nothing_generated_gives_the_prompt_rows_but_the_last(server, hf_routing):
    for extra in ({}, {"return_logprob": True, "logprob_start_len": 2}):
        out = post_json(server, "/generate", {"input_ids": PROMPT, "return_routed_experts": True, **extra,
                                              "sampling_params": {"max_new_tokens": 0}})
        assert out["output_ids"] == []
        assert torch.equal(routed(out), hf_routing(PROMPT)[:-1])


def test_batch_rows_belong_to_their_requests(server, hf_routing):
    """Identical prompts (prefilled once), a shorter one (left padded), per-prompt flags and lengths
    (rows retire at different steps), all admitted in one prefill while the engine is paused."""
    prompts = [PROMPT, SHORT, PROMPT, PROMPT, [3, 4, 5, 6, 7]]
    flags = [True, True, True, False, True]
    body = {"input_ids": prompts, "return_routed_experts": flags,
            "sampling_params": [{"max_new_tokens": m, "ignore_eos": True, "seed": s, "temperature": 1.0}
                                for m, s in zip([10, 7, 3, 9, 5], [1, 2, 3, 4, 5])]}
    before = get_json(server, "/get_server_info")["shared_prefix_rows"]
    post_json(server, "/pause_generation")
    box = []
    sender = threading.Thread(target=lambda: box.append(post_json(server, "/generate", body)))
    sender.start()
    try:
        deadline = time.monotonic() + 30
        while get_json(server, "/get_server_info")["num_waiting_requests"] < len(prompts):
            assert time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        post_json(server, "/continue_generation")
        sender.join(60)
    outs = box[0]
    assert get_json(server, "/get_server_info")["shared_prefix_rows"] - before == 2
    assert outs[0]["output_ids"] != outs[2]["output_ids"]  # the samples of one prompt differ
    for prompt, flag, out in zip(prompts, flags, outs):
        if flag:
            check(out, prompt, hf_routing)
        else:
            assert "routed_experts" not in out["meta_info"]


def test_streamed_request_is_refused(server):
    status, message = refusal(server, {"input_ids": PROMPT, "return_routed_experts": True, "stream": True})
    assert status == 400 and message.startswith("return_routed_experts:") and "without stream" in message
    assert "\n" not in message


@pytest.mark.parametrize("body,field,words", [
    ({"return_routed_experts": "yes"}, "return_routed_experts", "boolean"),
    ({"return_routed_experts": [True]}, "return_routed_experts", "boolean"),  # a list is for a batch
    ({"input_ids": [PROMPT, SHORT], "return_routed_experts": [True]}, "return_routed_experts", "one value per prompt"),
    ({"input_ids": [PROMPT, SHORT], "return_routed_experts": [True, 1]}, "return_routed_experts[1]", "boolean"),
])
def test_bad_values_are_a_400_naming_the_field(server, body, field, words):
    status, message = refusal(server, {"input_ids": PROMPT, **body})
    assert status == 400 and message.startswith(field + ":") and words in message and "\n" not in message


def test_dense_model_refuses_the_field(tiny_model_dir, tmp_path):
    with native_server(tiny_model_dir, tmp_path / "log.txt", "--enable-return-routed-experts") as (url, _):
        status, message = refusal(url, {"input_ids": PROMPT, "return_routed_experts": True})
        assert status == 400 and message.startswith("return_routed_experts:") and "mixture-of-experts" in message
        assert "\n" not in message
        out = post_json(url, "/generate", {"input_ids": PROMPT, "return_routed_experts": False,
                                           "sampling_params": {"max_new_tokens": 1}})
        assert "routed_experts" not in out["meta_info"]


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_other_families_round_trip(family, tmp_path):
    model_dir = str(build_tiny_moe_model(tmp_path / family, seed=0, family=family))
    with native_server(model_dir, tmp_path / "log.txt") as (url, _):
        outs = post_json(url, "/generate", {"input_ids": [PROMPT, SHORT], "return_routed_experts": True,
                                            "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}})
    route = _hf_routing(model_dir)
    for prompt, out in zip([PROMPT, SHORT], outs):
        check(out, prompt, route)


def test_flag_passes_through_and_vllm_refuses():
    argv, dests = NATIVE_PASS_THROUGH.forward({"enable_return_routed_experts": True})
    assert argv == ["--enable-return-routed-experts"] and "enable_return_routed_experts" in dests
    assert refuse_routed_experts({"input_ids": [1], "return_routed_experts": False}) == {"input_ids": [1]}
    assert refuse_routed_experts({"input_ids": [[1], [2]], "return_routed_experts": [False, None]}) == {
        "input_ids": [[1], [2]]}
    for value in (True, [False, True]):
        with pytest.raises(ProtocolError) as e:
            refuse_routed_experts({"input_ids": [1], "return_routed_experts": value})
        assert e.value.field == "return_routed_experts" and "vLLM" in e.value.message


def test_a_request_no_forward_saw_leaves_the_samples_routing():
    """An abort can reach a request before any forward did (it waited): no rows come back (the native
    engine sends no field, an empty payload means the same), and the sample keeps the routing of its
    earlier calls; a partial rollout continues it later with the whole sequence's."""
    from slime.rollout.api import parse_engine_output

    meta = {"finish_reason": {"type": "abort"}, "prompt_tokens": 5, "output_token_logprobs": []}
    for extra in ({}, {"routed_experts": "", "routed_experts_start_len": 0}):
        assert parse_engine_output({"output_ids": [], "meta_info": {**meta, **extra}}).routed_experts is None
    rows = torch.arange(4 * 2 * 2, dtype=torch.int32).reshape(4, 2, 2)  # 5 prompt tokens - 1, 2 layers, top-2
    one = {**meta, "routed_experts": base64.b64encode(rows.numpy().tobytes()).decode(), "routed_experts_start_len": 0}
    assert torch.equal(parse_engine_output({"output_ids": [], "meta_info": one}).routed_experts, rows.reshape(4, -1))
