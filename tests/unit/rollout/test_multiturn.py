"""Multi-turn rollout helpers (slime.rollout.multiturn) and the contract of every rollout extension point,
loaded from a temporary module file (`path/to/file.py:function`) and run through RolloutManager without
engines: the engine is a scripted fake behind `slime.rollout.api.set_context`."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from slime.rollout import api
from slime.rollout.multiturn import (ToolCall, call_tool, env_message_tokens, parse_tool_calls,
                                     run_tool_loop)
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

    from test_fsdp_trainer import TEMPERATURE, _grads_after_train, assert_states_close, make_args, synthetic_batch

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
    grads, metrics = _grads_after_train(args, batch)

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
    grads_all, _ = _grads_after_train(args, all_ones)
    assert_states_close({k: grads_all[k] for k in everything}, everything, atol=1e-6, rtol=1e-4)


# ---------------------------------------------------------------- extension-point contract


USER_MODULE = '''
import asyncio
from slime.rollout.api import context, continue_sample
from slime.rollout.multiturn import run_tool_loop
from slime.types import Sample

CALLS = []

async def generate(args, sample, sampling_params):
    """Two samples per prompt: a tool episode and a plain single turn."""
    CALLS.append(("generate", sample.index, sampling_params["sampling_seed"]))
    tool = Sample(prompt=sample.prompt, label=sample.label, index=sample.index, tokens=list(sample.tokens))
    await run_tool_loop(args, tool, sampling_params, {"add": lambda a, b: a + b})
    await continue_sample(sample, {**sampling_params, "temperature": 0.0})
    sample.response = "single"
    return [tool, sample]

async def reward(args, sample):
    await asyncio.sleep(0)
    return {"score": float(sample.metadata.get("tool_calls", 0)), "turns": float(sample.metadata.get("turns", 1))}

def group_reward(args, samples):
    return [float(i) for i, _ in enumerate(samples)]

class Source:
    def __init__(self, args):
        self.args, self.next, self.added = args, 0, []
    def get_samples(self, num_groups):
        out = [[Sample(prompt=[{"role": "user", "content": "q"}], label=self.next + i, tokens=[1, 2, 3])
                for _ in range(self.args.n_samples_per_prompt)] for i in range(num_groups)]
        self.next += num_groups
        return out
    def add_samples(self, groups):
        self.added.extend(groups)
    def state_dict(self):
        return {"next": self.next}
    def load_state_dict(self, state):
        self.next = state["next"]

def rollout(args, rollout_id, data_source, evaluation=False):
    groups = data_source.get_samples(args.rollout_batch_size)
    for g in groups:
        for s in g:
            s.tokens = s.tokens + [7, 8]
            s.response_length, s.loss_mask, s.rollout_log_probs = 2, [1, 0], [-0.5, 0.0]
            s.reward = float(s.label)
    return groups

async def evaluate(args, rollout_id):
    return {"mine": 0.25 * rollout_id, "eval/already": 1.0}

def label_reward(args, sample):
    return float(sample.label)

def drop_odd_labels(args, groups):
    for g in groups:
        for s in g:
            s.remove_sample = s.label % 2 == 1

def newest_first(args, buffer, num_groups):
    return list(reversed(buffer))[:num_groups]
'''


@pytest.fixture
def user_module(tmp_path):
    path = tmp_path / "my_rollout.py"
    path.write_text(USER_MODULE)
    yield str(path)
    from slime.utils.hooks import load_function

    load_function.cache_clear()


def _manager(tiny_model_dir, tmp_path, monkeypatch, *extra, fleet=None):
    """A RolloutManager built from the flags, its engines scripted (custom code reaches them through
    slime.rollout.api.context(), as it would the real fleet)."""
    from slime.rollout.manager import RolloutManager

    tmp_path.mkdir(parents=True, exist_ok=True)
    monkeypatch.setattr("ray.put", lambda x: x)  # no Ray: the batch itself stands for its ref
    m = RolloutManager(make_args(tiny_model_dir, tmp_path, "--n-samples-per-prompt", 2, *extra),
                       fleet=fleet or ScriptedFleet([]))
    m.init()
    return m


def test_custom_generate_data_source_and_reward_through_the_manager(tiny_model_dir, tmp_path, tok, user_module,
                                                                    monkeypatch):
    eos = tok.eos_token_id
    call = ids(tok, "compute") + [eos]
    answer = ids(tok, "7") + [eos]

    def answer_by_request(payload):  # episodes run concurrently: answer by what the request is
        if payload["sampling_params"]["temperature"] == 0.0:  # the plain single turn
            return "yes", ids(tok, "yes") + [eos], "stop", eos
        if payload["input_ids"] == [1, 2, 3]:  # an episode's first turn: a tool call
            return CALL, call, "stop", eos
        return "7", answer, "stop", eos

    m = _manager(tiny_model_dir, tmp_path, monkeypatch, "--rollout-batch-size", 2, "--global-batch-size", 4,
                 "--custom-generate-function-path", f"{user_module}:generate",
                 "--custom-rm-path", f"{user_module}:reward", "--reward-key", "score",
                 "--data-source-path", f"{user_module}:Source", "--max-turns", 3,
                 fleet=ScriptedFleet(answer_by_request))
    try:
        refs, metrics = m.generate(0)
    finally:
        api.set_context(None)
    [batch] = refs
    # 2 prompts x 2 samples, each call returning 2 Samples: 8 samples, each group keeps its index; the
    # trainer takes rollout_batch_size * n_samples_per_prompt = 4, the rest is dropped and counted
    assert len(batch) == 4 and batch.group_indices == [0, 0, 0, 0]
    assert metrics["rollout/dropped_samples"] == 4.0
    env = env_message_tokens(tok, [{"role": "tool", "content": "7"}])
    tool_mask = [1] * len(call) + [0] * len(env) + [1] * len(answer)
    assert batch.loss_masks == [tool_mask, [1, 1], tool_mask, [1, 1]]
    assert batch.raw_rewards == [1.0, 0.0] * 2  # score = tool calls
    assert batch.tokens[0] == [1, 2, 3] + call + env + answer and batch.tokens[1] == [1, 2, 3] + ids(tok, "yes") + [eos]
    assert metrics["rollout/reward/turns"] == 1.5 and metrics["rollout/raw_reward"] == 0.5
    from slime.utils.hooks import load_function

    calls = load_function(f"{user_module}:generate", "--custom-generate-function-path").__globals__["CALLS"]
    assert sorted(c[1] for c in calls) == [0, 1, 2, 3]
    assert len({c[2] for c in calls}) == 4  # every sample its own seed


def test_group_reward_contract(tiny_model_dir, tmp_path, user_module):
    from slime.rollout.generate import score_group
    from slime.rollout.rewards import build_reward

    args = make_args(tiny_model_dir, tmp_path, "--rollout-batch-size", 2, "--n-samples-per-prompt", 3,
                     "--global-batch-size", 6, "--custom-rm-path", f"{user_module}:group_reward", "--group-rm")
    reward = build_reward(args)
    assert reward.group
    out = asyncio.run(score_group(reward, args, [Sample(index=i) for i in range(3)]))
    assert [s.reward for s in out] == [0.0, 1.0, 2.0]


def test_rollout_function_sample_filter_and_eval_function(tiny_model_dir, tmp_path, user_module, monkeypatch):
    m = _manager(tiny_model_dir, tmp_path, monkeypatch, "--rollout-batch-size", 3, "--global-batch-size", 6,
                 "--rollout-function-path", f"{user_module}:rollout", "--data-source-path", f"{user_module}:Source",
                 "--eval-function-path", f"{user_module}:evaluate")
    [batch], metrics = m.generate(0)
    assert batch.raw_rewards == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0]
    assert batch.loss_masks == [[1, 0]] * 6 and batch.group_indices == [0, 0, 1, 1, 2, 2]
    assert m.state_dict()["data_source"] == {"next": 3}
    assert m.eval(4) == {"eval/mine": 1.0, "eval/already": 1.0}

    # --rollout-sample-filter-path: samples it removes stay in the batch with an all-zero loss mask
    # (the Source's prompt [1, 2, 3] + a scripted answer [5, 5], scored by its label)
    m = _manager(tiny_model_dir, tmp_path / "b", monkeypatch, "--rollout-batch-size", 3, "--global-batch-size", 6,
                 "--data-source-path", f"{user_module}:Source", "--custom-rm-path", f"{user_module}:label_reward",
                 "--rollout-sample-filter-path", f"{user_module}:drop_odd_labels",
                 fleet=ScriptedFleet(lambda payload: ("ab", [5, 5], "stop", None)))
    [batch], metrics = m.generate(0)
    assert [sum(x) for x in batch.loss_masks] == [2, 2, 0, 0, 2, 2]
    assert metrics["rollout/removed_samples"] == 2.0


def test_buffer_filter_contract(tiny_model_dir, tmp_path, user_module, tok):
    from slime.data.dataset import Prompt
    from slime.data.source import RolloutDataSource

    args = make_args(tiny_model_dir, tmp_path, "--rollout-batch-size", 2, "--n-samples-per-prompt", 1,
                     "--global-batch-size", 2, "--buffer-filter-path", f"{user_module}:newest_first")
    src = RolloutDataSource(args, [Prompt(prompt="p", input_ids=[1, 2], label=i) for i in range(4)])
    src.add_samples([[Sample(label=f"b{i}")] for i in range(3)])
    assert [g[0].label for g in src.get_samples(2)] == ["b2", "b1"]
    assert [g[0].label for g in src.get_samples(2)] == ["b0", 0]


def test_bad_extension_path_names_the_flag(tiny_model_dir, tmp_path, user_module):
    from slime.utils.errors import SlimeConfigError

    with pytest.raises(SlimeConfigError, match="--custom-generate-function-path .*has no attribute 'nope'"):
        make_args(tiny_model_dir, tmp_path, "--rollout-batch-size", 2, "--n-samples-per-prompt", 2,
                  "--custom-generate-function-path", f"{user_module}:nope")


def test_custom_generate_must_return_samples(tiny_model_dir, tmp_path):
    from slime.rollout.group_generation import GroupRunner, generate_groups
    from slime.rollout.rewards import RewardFunction

    async def bad(args, sample, params):
        return "text"

    args = make_args(tiny_model_dir, tmp_path, "--rollout-max-response-len", 4)
    runner = GroupRunner(args, None, RewardFunction(lambda a, s: 0.0), bad)
    with pytest.raises(TypeError, match=r"returned \[?'text'\]?; expected a Sample or a non-empty list"):
        asyncio.run(generate_groups(runner, [[Sample(index=0)]], 0, False))
