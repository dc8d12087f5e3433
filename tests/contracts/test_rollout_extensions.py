"""The contract of every rollout extension point (docs/custom_rollout.md), loaded from a temporary
module file (`path/to/file.py:function`) and run through the RolloutManager on scripted engines:
custom generate (several samples per call, through `slime.rollout.api`), per-sample and group
rewards (dict rewards with --reward-key), a data source, a rollout function, sample and buffer
filters, an eval function; bad paths fail at parse time naming the flag. The algorithm hooks are in
test_algorithm_hooks.py; that every extension flag has a contract test and a documented signature
is checked at the end."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from slime.arguments import build_parser
from slime.rollout import api
from slime.rollout.multiturn import env_message_tokens
from slime.types import Sample
from tests.helpers.args import make_args
from tests.helpers.rollout import ScriptedFleet

ROOT = Path(__file__).resolve().parents[2]
CALL = '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>'


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


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


# the flags naming a user function or class (--custom-config-path names a YAML file,
# --lora-adapter-path a peft adapter directory, --rm-path a reward model's directory)
NOT_FUNCTIONS = ("--custom-config-path", "--lora-adapter-path", "--rm-path")
EXTENSION_FLAGS = sorted(s for a in build_parser()._actions for s in a.option_strings
                         if s.endswith("-path") and s not in NOT_FUNCTIONS)


def test_every_extension_point_has_a_contract_test_and_a_documented_signature():
    contracts = "".join(p.read_text() for p in Path(__file__).parent.glob("test_*.py"))
    docs = (ROOT / "docs" / "custom_rollout.md").read_text() + (ROOT / "docs" / "algorithms.md").read_text()
    assert len(EXTENSION_FLAGS) >= 12, EXTENSION_FLAGS
    for flag in EXTENSION_FLAGS:
        assert f'"{flag}"' in contracts or flag[2:].replace("-", "_") in contracts, \
            f"{flag}: no contract test in tests/contracts/"
        assert f"`{flag}`" in docs or f"### `{flag}`" in docs, f"{flag}: no signature in docs/"
