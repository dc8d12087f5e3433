"""A verifiers environment's episodes become Samples whose tokens, loss masks, log-probs and rewards are what
the environment itself recorded (slime.rollout.environments.verifiers_env), against a real native engine
server on the tiny model; and the --env-id flags' one-line errors."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from slime.types import Sample
from slime.utils.errors import SlimeConfigError
from tests.helpers.args import make_args
from tests.helpers.native_server import native_server

NEEDS = "the verifiers adapter needs `verifiers` 0.3 (pip install 'verifiers>=0.3.1,<0.4')"
if not hasattr(pytest.importorskip("verifiers", reason=NEEDS), "OpenAIChatCompletionsClient"):
    pytest.skip(NEEDS, allow_module_level=True)

from slime.rollout.environments import verifiers_env  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
ENV_FILE = str(ROOT / "examples" / "verifiers_env" / "check_env.py")
ADAPTER = "slime.rollout.environments.verifiers_env.generate"
# With seed 4 the tiny model's replies to the first row hold no special token and are never empty, so a 3-turn
# episode is one Sample; with seed 0 its second reply is empty, which verifiers rejects (the episode ends with an
# error and that call is not in its trajectory).
# Each reply is at most 6 tokens (the environment's max_tokens), the episode's response budget 200.
PARAMS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 200, "sampling_seed": 4}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with native_server(tiny_model_dir, tmp_path_factory.mktemp("vf") / "log.txt", "--max-total-tokens", "512") as s:
        yield s


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _args(tiny_model_dir, tmp_path, turns, *flags):
    env_args = f'{{"turns": {turns}, "num_examples": 8, "max_tokens": 6}}'
    return make_args(tiny_model_dir, tmp_path, "--custom-generate-function-path", ADAPTER, "--env-id", ENV_FILE,
                     "--env-args", env_args, "--rollout-request-timeout", 60, *flags)


def _check_against_the_environment(s: Sample, trajectory, reward: float):
    """The Sample is the environment's trajectory token for token: each step's prompt extends the Sample so
    far by environment tokens (mask 0, log-prob 0), then its completion is model tokens (mask 1, the step's
    log-probs); nothing else is in the Sample."""
    steps = [t["tokens"] for t in trajectory]
    assert all(t is not None for t in steps), "verifiers recorded no tokens (the server returned no token ids?)"
    pos = s.prompt_length
    assert s.tokens[:pos] == steps[0]["prompt_ids"]
    for step in steps:
        assert step["prompt_ids"][:pos] == s.tokens[:pos]
        for t in step["prompt_ids"][pos:]:
            j = pos - s.prompt_length
            assert (s.tokens[pos], s.loss_mask[j], s.rollout_log_probs[j]) == (t, 0, 0.0)
            pos += 1
        assert len(step["completion_ids"]) == len(step["completion_logprobs"]) >= 1
        for t, lp in zip(step["completion_ids"], step["completion_logprobs"]):
            j = pos - s.prompt_length
            assert (s.tokens[pos], s.loss_mask[j], s.rollout_log_probs[j]) == (t, 1, pytest.approx(lp))
            pos += 1
    assert pos == len(s.tokens) == s.prompt_length + s.response_length
    assert sum(s.loss_mask) == sum(len(t["completion_ids"]) for t in steps)
    assert s.metadata["env_reward"] == reward and s.metadata["env_turns"] == len(steps)
    assert verifiers_env.reward(None, s) == reward


@pytest.mark.parametrize("turns", [1, 3])
def test_episodes_match_the_environments_records(server, tokenizer, tiny_model_dir, tmp_path, turns):
    url, _ = server
    args = _args(tiny_model_dir, tmp_path, turns)
    # --env-id sets the adapter's reward and, without --prompt-data, its data source as defaults
    assert args.custom_rm_path == "slime.rollout.environments.verifiers_env.reward"
    env = verifiers_env.load_environment(args.env_id, args.env_args)
    source = verifiers_env.VerifiersDataSource(make_args(tiny_model_dir, tmp_path, "--custom-generate-function-path",
                                                         ADAPTER, "--env-id", ENV_FILE))
    [[sample]] = source.get_samples(1)
    row = env.build_dataset()[0]
    assert sample.metadata["vf_input"]["prompt"] == row["prompt"] and sample.label == row["answer"]
    sample.index = 0

    samples, state = asyncio.run(verifiers_env.episode(args, sample, PARAMS, base_url=url + "/v1",
                                                       tokenizer=tokenizer))
    assert len(state["trajectory"]) == turns and state["error"] is None
    [s] = samples
    _check_against_the_environment(s, state["trajectory"], state["reward"])
    assert s.metadata["env_metrics"] == {k: float(v) for k, v in state["metrics"].items()}
    assert s.metadata["calls"] == turns and "env_error" not in s.metadata
    # the environment's completion messages are the model's replies, and the rubric scored the last one
    replies = [m.content or "" for m in state["completion"] if m.role == "assistant"]
    assert replies == [t["completion"][-1].content or "" for t in state["trajectory"]]
    texts = [tokenizer.decode(t["tokens"]["completion_ids"], skip_special_tokens=True) for t in state["trajectory"]]
    assert [r.strip() for r in replies] == [t.strip() for t in texts]
    first = replies[-1].split()[:1]
    assert state["reward"] == float(first == [row["answer"]])


def test_a_call_the_environment_rejected_is_not_trained_on(server, tokenizer, tiny_model_dir, tmp_path):
    url, _ = server
    args = _args(tiny_model_dir, tmp_path, 3)
    row = verifiers_env.load_environment(args.env_id, args.env_args).build_dataset()[0]
    sample = Sample(prompt=row["prompt"], label=row["answer"], index=0, metadata={"vf_input": dict(row)})
    params = dict(PARAMS, sampling_seed=0)
    [s], _ = asyncio.run(verifiers_env.episode(args, sample, params, base_url=url + "/v1", tokenizer=tokenizer))
    # the model made two calls; verifiers kept the first in its trajectory and ended on the empty second reply
    assert s.metadata["calls"] == 1 == s.metadata["env_turns"] and "EmptyModelResponseError" in s.metadata["env_error"]
    assert s.loss_mask == [1] * s.response_length and s.metadata["env_reward"] == 0.0


def test_flag_errors(tiny_model_dir, tmp_path):
    def err(*flags):
        with pytest.raises(SlimeConfigError) as e:
            make_args(tiny_model_dir, tmp_path, *flags)
        msg = str(e.value)
        assert "\n" not in msg
        return msg

    msg = err("--custom-generate-function-path", ADAPTER, "--env-id", "owner/no-such-env")
    assert "no verifiers environment 'owner/no-such-env' is installed" in msg and "pip install no-such-env" in msg
    assert "--env-id" in err("--custom-generate-function-path", ADAPTER)
    assert ADAPTER in err("--env-id", "wordle")
    assert "does not exist" in err("--custom-generate-function-path", ADAPTER, "--env-id", "nope/env.py")
    assert "OpenEnv flag" in err("--custom-generate-function-path", ADAPTER, "--env-id", ENV_FILE, "--env-server")


def test_loads_off_the_main_thread_and_leaves_the_signal_handlers():
    """verifiers' Environment sets SIGINT/SIGTERM handlers when built; the rollout (a Ray actor) builds it off
    the main thread and keeps its own handlers."""
    import signal
    from concurrent.futures import ThreadPoolExecutor

    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with ThreadPoolExecutor(1) as pool:
        env = pool.submit(verifiers_env.load_environment, ENV_FILE, {"turns": 2, "num_examples": 3}).result()
    assert env.max_turns == 2 and (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
