"""Multi-turn rollout helpers (slime.rollout.multiturn) and the contract of every rollout extension point,
loaded from a temporary module file (`path/to/file.py:function`) and run through RolloutManager without
engines: the engine is a scripted fake behind `slime.rollout.api.set_context`."""

from __future__ import annotations

import asyncio

import pytest
import torch

from slime.rollout import api
from slime.rollout.multiturn import ToolCall, call_tool, env_message_tokens, parse_tool_calls, run_tool_loop
from slime.types import Sample, SampleStatus
from tests.helpers.args import make_args
from tests.helpers.rollout import ScriptedFleet


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------- environment tokens


def test_env_message_tokens_follow_the_chat_template(tok):
    eos = tok.eos_token_id
    msgs = [{"role": "user", "content": "result 7"}]
    env = env_message_tokens(tok, msgs)
    assert tok.convert_ids_to_tokens(env) == ["<|im_start|>", "user", "result", "7", "<|im_end|>",
                                              "<|im_start|>", "assistant"]
    assert env_message_tokens(tok, msgs, turn_ended=False) == [eos] + env
    assert env_message_tokens(tok, msgs, add_generation_prompt=False) == env[:-2]
    # prompt + model turn + env tokens is exactly what the template renders for the whole conversation:
    # appending never re-tokenizes the earlier turns
    prompt = [{"role": "user", "content": "what is 3 plus 4 ?"}]
    p_ids = ids(tok, tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True))
    model_turn = ids(tok, "compute 3 plus 4") + [eos]
    full = prompt + [{"role": "assistant", "content": "compute 3 plus 4"}] + msgs
    want = ids(tok, tok.apply_chat_template(full, tokenize=False, add_generation_prompt=True))
    assert p_ids + model_turn + env == want
    two = [{"role": "tool", "content": "7"}, {"role": "user", "content": "say the answer"}]
    assert tok.convert_ids_to_tokens(env_message_tokens(tok, two)) == [
        "<|im_start|>", "<unk>", "7", "<|im_end|>", "<|im_start|>", "user", "say", "the", "answer", "<|im_end|>",
        "<|im_start|>", "assistant"]


# ---------------------------------------------------------------- tool calls


def test_parse_tool_calls_hermes_format():
    text = ('think <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> and '
            '<tool_call>\n{"name": "now"}\n</tool_call> <tool_call>{"name": "s", "arguments": "{\\"q\\": 1}"}</tool_call>')
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("add", {"a": 1, "b": 2}, None), ("now", {}, None), ("s", {"q": 1}, None)]
    bad = parse_tool_calls('<tool_call>{"name": 3}</tool_call><tool_call>{oops</tool_call>'
                           '<tool_call>{"name": "x", "arguments": [1]}</tool_call>')
    assert [c.name for c in bad] == ["", "", ""] and all(c.error.startswith("malformed tool call") for c in bad)
    assert "arguments must be an object" in bad[2].error
    assert parse_tool_calls("no calls here") == [] and parse_tool_calls("<tool_call>{}") == []


def test_call_tool_turns_every_failure_into_a_message():
    async def slow():
        await asyncio.sleep(5)

    def boom(x):
        raise KeyError(x)

    tools = {"add": lambda a, b: a + b, "obj": lambda: {"k": [1]}, "slow": slow, "boom": boom,
             "text": lambda: "plain"}

    async def go(call, timeout=2.0):
        return await call_tool(tools, call, timeout)

    assert asyncio.run(go(ToolCall("add", {"a": 2, "b": 5}))) == "7"
    assert asyncio.run(go(ToolCall("obj", {}))) == '{"k": [1]}'
    assert asyncio.run(go(ToolCall("text", {}))) == "plain"
    assert asyncio.run(go(ToolCall("nope", {}))) == "error: unknown tool 'nope' (tools: add, boom, obj, slow, text)"
    assert asyncio.run(go(ToolCall("boom", {"x": 1}))) == "error: KeyError: 1"
    assert asyncio.run(go(ToolCall("add", {"a": 1}))).startswith("error: TypeError")
    assert asyncio.run(go(ToolCall("slow", {}), timeout=0.05)) == "error: tool 'slow' timed out after 0.05 s"
    assert asyncio.run(go(ToolCall("", {}, error="malformed tool call: x"))) == "malformed tool call: x"


# ---------------------------------------------------------------- the tool loop against a scripted engine


CALL = '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>'


@pytest.fixture
def loop(tok, tiny_model_dir, tmp_path):
    def run(turns, max_turns=4, budget=64, **kw):
        engines = ScriptedFleet(turns)
        args = make_args(tiny_model_dir, tmp_path, "--max-turns", max_turns, "--rollout-max-response-len", budget)
        api.set_context(api.RolloutContext(args, tok, engines, "http://unused"))
        prompt = ids(tok, tok.apply_chat_template([{"role": "user", "content": "what is 3 plus 4 ?"}],
                                                  tokenize=False, add_generation_prompt=True))
        sample = Sample(prompt="q", tokens=list(prompt))
        params = {"temperature": 1.0, "max_new_tokens": budget, "sampling_seed": 100}
        try:
            out = asyncio.run(run_tool_loop(args, sample, params, {"add": lambda a, b: a + b}, **kw))
        finally:
            api.set_context(None)
        return out, prompt, engines

    return run


def test_tool_loop_masks_model_tokens_only(tok, loop):
    eos = tok.eos_token_id
    turn1 = ids(tok, "compute 3 plus 4") + [eos]
    turn2 = ids(tok, "the answer is 7") + [eos]
    s, prompt, engines = loop([(CALL, turn1, "stop", eos), ("the answer is 7", turn2, "stop", eos)])
    env = env_message_tokens(tok, [{"role": "tool", "content": "7"}])
    assert s.tokens == prompt + turn1 + env + turn2
    assert s.response_length == len(turn1) + len(env) + len(turn2)
    assert s.loss_mask == [1] * len(turn1) + [0] * len(env) + [1] * len(turn2)
    lp1 = [-0.1 * (k + 1) - 0.01 for k in range(len(turn1))]
    lp2 = [-0.1 * (k + 1) - 0.02 for k in range(len(turn2))]
    assert s.rollout_log_probs == pytest.approx(lp1 + [0.0] * len(env) + lp2)
    assert s.status == SampleStatus.COMPLETED and s.weight_version == 4
    assert s.metadata == {"turns": 2, "tool_calls": 1, "last_turn": "the answer is 7"}
    assert s.response == tok.decode(turn1 + env + turn2, skip_special_tokens=False)
    # each turn continued from exactly the tokens the sample held (no re-tokenizing), with the budget
    # left, and drew from its own sampling seed
    assert [p["input_ids"] for p in engines.payloads] == [prompt, prompt + turn1 + env]
    assert [p["sampling_params"]["max_new_tokens"] for p in engines.payloads] == [64, 64 - len(turn1) - len(env)]
    assert [p["sampling_params"]["sampling_seed"] for p in engines.payloads] == [100, 101]
    assert all(p["return_logprob"] for p in engines.payloads)


def test_tool_loop_stop_string_turn_gets_the_end_of_turn_token(tok, loop):
    eos = tok.eos_token_id
    turn1 = ids(tok, "compute 3 plus 4")  # stopped on a stop string: no EOS token in the output
    turn2 = ids(tok, "7") + [eos]
    s, prompt, _ = loop([(CALL, turn1, "stop", "</tool_call>"), ("7", turn2, "stop", eos)])
    env = env_message_tokens(tok, [{"role": "tool", "content": "7"}], turn_ended=False)
    assert env[0] == eos
    assert s.tokens == prompt + turn1 + env + turn2
    assert s.loss_mask == [1] * len(turn1) + [0] * len(env) + [1] * len(turn2)


def test_tool_loop_max_turns_and_budget(tok, loop):
    eos = tok.eos_token_id
    turn = ids(tok, "compute") + [eos]
    # --max-turns 2: the second turn's call is not run; one tool call
    s, _, engines = loop([(CALL, turn, "stop", eos)] * 3, max_turns=2)
    assert s.metadata["turns"] == 2 and s.metadata["tool_calls"] == 1 and len(engines.payloads) == 2
    assert s.loss_mask.count(1) == 2 * len(turn)
    # a budget the tool result does not fit in: the episode stops TRUNCATED before appending it
    env = env_message_tokens(tok, [{"role": "tool", "content": "7"}])
    s, prompt, _ = loop([(CALL, turn, "stop", eos)] * 3, budget=len(turn) + len(env))
    assert s.status == SampleStatus.TRUNCATED and s.tokens == prompt + turn and s.loss_mask == [1] * len(turn)
    assert s.metadata["tool_calls"] == 1 and s.metadata["turns"] == 1
    # the model runs out of budget mid-turn: finish "length", TRUNCATED, no call parsed from a cut turn
    long_turn = ids(tok, "the answer is what of plus minus times and a to in repeat digit number")
    budget = len(turn) + len(env) + 5
    s, prompt, engines = loop([(CALL, turn, "stop", eos), (CALL, long_turn, "stop", eos)], budget=budget)
    assert s.status == SampleStatus.TRUNCATED and s.response_length == budget
    assert s.loss_mask == [1] * len(turn) + [0] * len(env) + [1] * 5
    assert engines.payloads[1]["sampling_params"]["max_new_tokens"] == 5
    # the model answers without a call: one turn, no tool
    s, _, _ = loop([("7", ids(tok, "7") + [eos], "stop", eos)])
    assert s.metadata == {"turns": 1, "tool_calls": 0, "last_turn": "7"} and s.loss_mask == [1, 1]


def test_tool_loop_custom_parser_and_messages(tok, loop):
    eos = tok.eos_token_id

    def parse(text):
        return [ToolCall("add", {"a": 1, "b": 1})] if "compute" in text else []

    s, prompt, _ = loop([("compute", ids(tok, "compute"), "stop", "compute"), ("2", ids(tok, "2") + [eos], "stop", eos)],
                        parse=parse, tool_messages=lambda calls, res: [{"role": "user", "content": f"result {res[0]}"}])
    env = env_message_tokens(tok, [{"role": "user", "content": "result 2"}], turn_ended=False)
    assert s.tokens == prompt + ids(tok, "compute") + env + ids(tok, "2") + [eos]
    assert tok.convert_ids_to_tokens(env)[:5] == ["<|im_end|>", "<|im_start|>", "user", "result", "2"]


# ---------------------------------------------------------------- the trainer: tool tokens get no gradient


def test_tool_tokens_get_zero_gradient(tiny_model_dir, tmp_path):
    """Train on multi-turn loss masks (model, tool, model): the gradient is the hand-computed one that sums
    only the mask-1 tokens' log-probs, and marking the tool tokens 1 changes it."""
    import dataclasses

    from transformers import AutoModelForCausalLM

    from tests.helpers.training import TEMPERATURE, assert_states_close, grads_after_train, make_args, synthetic_batch

    batch = synthetic_batch(tiny_model_dir, 4, seed=7)
    # longer responses with multi-turn masks: model tokens, a tool result, model tokens
    g = torch.Generator().manual_seed(3)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    masks = [[1, 1, 0, 0, 0, 1, 1], [1, 0, 0, 1, 1, 0, 0, 0, 1], [1, 1, 1, 0, 0, 1], [0, 0, 1, 1, 0, 1, 1, 1]]
    tokens, lps = [], []
    for mask in masks:
        t = torch.randint(5, model.config.vocab_size, (4 + len(mask),), generator=g)
        with torch.no_grad():
            logits = model(t[None]).logits[0] / TEMPERATURE
        lp = torch.log_softmax(logits, -1)[3:3 + len(mask)].gather(-1, t[4:, None]).squeeze(-1)
        tokens.append(t.tolist())
        lps.append(lp.tolist())
    batch = dataclasses.replace(batch, tokens=tokens, response_lengths=[len(m) for m in masks], loss_masks=masks,
                                rollout_log_probs=lps)
    args = make_args(tiny_model_dir, tmp_path, "--rollout-batch-size", 2, "--n-samples-per-prompt", 2,
                     "--micro-batch-size", 4, "--clip-grad", 0)
    grads, metrics = grads_after_train(args, batch)

    def reference(masks):
        model.zero_grad()
        total = sum(map(sum, masks))
        loss = 0.0
        for toks, mask, a in zip(batch.tokens, masks, batch.rewards):
            t = torch.tensor(toks)
            logits = model(t[None]).logits[0] / TEMPERATURE
            p = len(toks) - len(mask)
            lp = torch.log_softmax(logits, -1)[p - 1:p - 1 + len(mask)].gather(-1, t[p:, None]).squeeze(-1)
            loss = loss + (-a * lp * torch.tensor(mask, dtype=torch.float32)).sum() / total
        loss.backward()
        return {n: p.grad.detach().clone() for n, p in model.named_parameters()}

    ref = reference(masks)
    assert_states_close({k: grads[k] for k in ref}, ref, atol=1e-6, rtol=1e-4)
    assert metrics["train/train_rollout_logprob_abs_diff"] < 1e-5
    # marking the tool tokens trainable gives another gradient: the masks reach the loss
    everything = reference([[1] * len(m) for m in masks])
    assert max((everything[k] - ref[k]).abs().max().item() for k in ref) > 1e-4
    all_ones = dataclasses.replace(batch, loss_masks=[[1] * len(m) for m in masks])
    grads_all, _ = grads_after_train(args, all_ones)
    assert_states_close({k: grads_all[k] for k in everything}, everything, atol=1e-6, rtol=1e-4)
