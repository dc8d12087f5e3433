"""An OpenEnv environment's episodes become Samples whose tokens, loss masks, log-probs and rewards are what
the environment recorded (slime.rollout.environments.openenv_env), in-process and served on loopback, against
a real native engine server on the tiny model; and the --env-id flags' one-line errors."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from slime.utils.errors import SlimeConfigError
from tests.helpers.args import make_args
from tests.helpers.native_server import native_server

pytest.importorskip("openenv", reason="the OpenEnv adapter needs `openenv-core` (pip install openenv-core)")

from slime.rollout.environments import openenv_env  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
ENV = str(ROOT / "examples" / "openenv_env" / "guess.py") + ":GuessEnvironment"
ADAPTER = "slime.rollout.environments.openenv_env.generate"
PARAMS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 200, "sampling_seed": 4}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with native_server(tiny_model_dir, tmp_path_factory.mktemp("oe") / "log.txt", "--max-total-tokens", "512") as s:
        yield s


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _args(tiny_model_dir, tmp_path, *flags):
    return make_args(tiny_model_dir, tmp_path, "--custom-generate-function-path", ADAPTER, "--env-id", ENV,
                     "--env-args", '{"max_value": 9, "max_guesses": 3}', "--env-max-turns", 3,
                     "--env-max-tokens-per-turn", 6, "--rollout-request-timeout", 60, *flags)


def _turn(tokenizer, text):
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                              add_generation_prompt=True, return_dict=False))


def test_episodes_match_the_environments_records(server, tokenizer, tiny_model_dir, tmp_path):
    url, _ = server
    args = _args(tiny_model_dir, tmp_path)
    # --env-id sets the adapter's reward and, without --prompt-data, numbered episodes as the data
    assert args.custom_rm_path == "slime.rollout.environments.openenv_env.reward"
    [[sample]] = openenv_env.EpisodeSource(args).get_samples(1)
    assert sample.metadata == {"seed": 0}
    sample.index = 0
    records = {}
    for served in (False, True):
        a = _args(tiny_model_dir, tmp_path, *(["--env-server"] if served else []))
        [s], record = asyncio.run(openenv_env.episode(a, sample, PARAMS, base_url=url + "/v1", tokenizer=tokenizer))
        records[served] = (record, s)
        steps = record["steps"]
        assert 1 <= len(steps) <= 3 and s.metadata["calls"] == len(steps)
        # the prompt is the reset observation as a user turn
        assert s.tokens[: s.prompt_length] == _turn(tokenizer, openenv_env.observation_text(record["reset"]))
        # walk the response: each reply is model tokens whose text is the action the environment received;
        # between replies, the environment's observation as a user turn (after EOS when the reply had none)
        runs, prev = [], None
        for j, m in enumerate(s.loss_mask):
            if prev != m:
                runs.append([m, j, j])
            runs[-1][2], prev = j + 1, m
        assert [m for m, _, _ in runs] == [1, 0] * (len(steps) - 1) + [1]
        resp, lps = s.response_tokens, s.rollout_log_probs
        for k, step in enumerate(steps):
            _, a0, b0 = runs[2 * k]
            assert tokenizer.decode(resp[a0:b0], skip_special_tokens=True).strip() == step["action"].strip()
            assert all(lp <= 0.0 for lp in lps[a0:b0]) and 1 <= b0 - a0 <= 6
            if k + 1 < len(steps):
                _, e0, e1 = runs[2 * k + 1]
                glue = [] if resp[b0 - 1] == tokenizer.eos_token_id else [tokenizer.eos_token_id]
                assert resp[e0:e1] == glue + _turn(tokenizer, openenv_env.observation_text(step["observation"]))
                assert all(lp == 0.0 for lp in lps[e0:e1])
        # the reward is the environment's: the summed step rewards, 1.0 once the guess was right
        assert s.metadata["env_reward"] == sum(st["reward"] for st in steps) == openenv_env.reward(a, s)
        assert s.metadata["env_done"] == steps[-1]["done"]
    # the same seeds give the same episode in-process and through the server
    (r0, s0), (r1, s1) = records[False], records[True]
    assert [(st["action"], st["reward"], st["done"]) for st in r0["steps"]] == \
        [(st["action"], st["reward"], st["done"]) for st in r1["steps"]]
    assert s0.tokens == s1.tokens and s0.loss_mask == s1.loss_mask


def test_flag_errors(tiny_model_dir, tmp_path):
    def err(*flags):
        with pytest.raises(SlimeConfigError) as e:
            make_args(tiny_model_dir, tmp_path, *flags)
        assert "\n" not in str(e.value)
        return str(e.value)

    assert "pip install no-such-env" in err("--custom-generate-function-path", ADAPTER, "--env-id",
                                            "no_such_env.server.NoSuchEnvironment")
    assert "does not exist" in err("--custom-generate-function-path", ADAPTER, "--env-id", "nope.py:Env")
    assert "--env-max-turns must be >= 1" in err("--custom-generate-function-path", ADAPTER, "--env-id", ENV,
                                                 "--env-max-turns", 0)
    with pytest.raises(SlimeConfigError, match="not an OpenEnv Environment subclass"):
        openenv_env.environment_class(str(ROOT / "examples" / "openenv_env" / "guess.py") + ":GuessAction")
