"""`--rm-type llm_judge`: a served judge model grades each sample (slime.rollout.rewards.llm_judge).

The score parsing (pattern, last match, max_score, an unparseable answer failing the sample) runs
against a stub pool with scripted answers; the request (the judge's chat template on the filled
template) and one real round trip run against a native engine serving the tiny model; every bad
input of `validate_judge` is one line naming the flag, or the template file and its field."""

from __future__ import annotations

import asyncio
import re
import shutil
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from slime.arguments import build_parser
from slime.engines.control import AsyncEngineControl
from slime.reward_flags import DEFAULT_PATTERN, load_judge_template, validate_judge
from slime.rollout import api
from slime.rollout.api import RolloutContext
from slime.rollout.generate import score
from slime.rollout.rewards import RewardMix, build_reward
from slime.rollout.rewards.llm_judge import LLMJudgeReward, prompt_text
from slime.types import Sample, SampleStatus
from slime.utils.errors import SlimeConfigError
from tests.helpers.args import make_args
from tests.helpers.native_server import native_server

TEMPLATE = """
system: "You grade answers. Label: {label}"
prompt: |-
  Question: {prompt}
  Answer: {response}
  Reply with Score: N.
max_score: 10
max_new_tokens: 12
"""


def _write(tmp_path, text: str, name: str = "judge.yaml") -> str:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return str(p)


def judge_args(model_dir, template: str | None, **over):
    """The attributes the judge reads, as the parser leaves them after --sglang-config serves `judge`."""
    args = dict(judge_model="judge", judge_template=template, rm_type="llm_judge", reward_functions=None,
                served_models=(SimpleNamespace(name="judge", model_path=model_dir, update_weights=False),),
                policy_model_name="actor", hf_checkpoint=model_dir, sglang_config="served.yaml",
                rm_timeout=30.0, reward_key=None, custom_rm_path=None, group_rm=False, reward_weights=None)
    args.update(over)
    return SimpleNamespace(**args)


class StubPool:
    """An engine pool that answers with scripted texts and records the payloads."""

    def __init__(self, *answers: str, finish: str = "stop"):
        self.answers, self.finish, self.payloads = list(answers), finish, []

    async def generate(self, payload: dict) -> dict:
        self.payloads.append(payload)
        return {"text": self.answers.pop(0), "output_ids": [], "meta_info": {"finish_reason": {"type": self.finish}}}


class RecordingPool:
    """A real engine client as the judge's pool, keeping each payload and answer."""

    def __init__(self, client):
        self.client, self.calls = client, []

    async def generate(self, payload: dict) -> dict:
        out = await self.client.generate(payload)
        self.calls.append((payload, out))
        return out


@pytest.fixture
def with_pool():
    """Serve `pool` as the judge for one test (the rollout context a RolloutManager would set)."""

    def put(pool, args=None):
        api.set_context(RolloutContext(args=args, tokenizer=None, engines=None, base_url="http://127.0.0.1:1",
                                       models={"judge": pool}))
        return pool

    yield put
    api.set_context(None)


def sample(response="2", prompt="what is 1 plus 1 ?", label="2"):
    return Sample(prompt=prompt, response=response, label=label, index=3)


def score_one(args, s):
    return asyncio.run(score(build_reward(args), args, s))


# ---- the score ------------------------------------------------------------------------------------


@pytest.mark.parametrize("answer, expected", [
    ("The answer is right. Score: 7", 0.7),
    ("score = 7.5", 0.75),
    ("SCORE:-2", -0.2),
    ("Score: 2 at first ... on reflection, Score: 9", 0.9),  # the last match wins
    ("Score: 3\nScore: 10\n", 1.0),
])
def test_the_last_match_divided_by_max_score_is_the_reward(tiny_model_dir, tmp_path, with_pool, answer, expected):
    args = judge_args(tiny_model_dir, _write(tmp_path, TEMPLATE))
    with_pool(StubPool(answer))
    s = score_one(args, sample())
    assert s.status != SampleStatus.FAILED and s.reward == pytest.approx(expected)


def test_without_max_score_the_number_itself_and_a_custom_pattern(tiny_model_dir, tmp_path, with_pool):
    path = _write(tmp_path, """
        prompt: "{response}"
        pattern: '<grade>(\\d+)</grade>'
        """)
    with_pool(StubPool("<grade>3</grade> then <grade>4</grade> and Score: 9"))
    s = score_one(judge_args(tiny_model_dir, path), sample())
    assert s.reward == 4.0


@pytest.mark.parametrize("answer, pattern, message", [
    ("I cannot grade this.", None, "does not match pattern"),
    ("", None, "does not match pattern"),
    ("grade: excellent", "(?i)grade: (\\w+)", "is not a finite number"),
    ("grade: nan", "(?i)grade: (\\w+)", "is not a finite number"),
])
def test_an_unparseable_answer_fails_the_sample_never_scores_zero(tiny_model_dir, tmp_path, with_pool, answer,
                                                                   pattern, message, caplog):
    extra = f"pattern: '{pattern}'\n" if pattern else ""
    args = judge_args(tiny_model_dir, _write(tmp_path, TEMPLATE + extra))
    with_pool(StubPool(answer))
    s = score_one(args, sample())
    assert s.status == SampleStatus.FAILED and s.reward is None
    assert message in caplog.text and repr(answer[-200:]) in caplog.text  # the answer's tail is quoted
    # the reward itself raises (the failure policy is generate.score's)
    with_pool(StubPool(answer))
    reward = LLMJudgeReward(args)
    with pytest.raises(ValueError, match=re.escape(message)):
        asyncio.run(reward(args, sample()))


def test_the_tail_of_a_long_answer_is_quoted(tiny_model_dir, tmp_path, with_pool):
    args = judge_args(tiny_model_dir, _write(tmp_path, TEMPLATE))
    with_pool(StubPool("x" * 1000 + "THE END"))
    with pytest.raises(ValueError) as e:
        asyncio.run(LLMJudgeReward(args)(args, sample()))
    assert "THE END" in str(e.value) and len(str(e.value)) < 400


def test_an_aborted_judge_call_fails_the_sample(tiny_model_dir, tmp_path, with_pool):
    args = judge_args(tiny_model_dir, _write(tmp_path, TEMPLATE))
    with_pool(StubPool("Score: 10", finish="abort"))
    s = score_one(args, sample())
    assert s.status == SampleStatus.FAILED and s.reward is None


def test_judge_as_one_of_several_rewards(tiny_model_dir, tmp_path, with_pool):
    args = judge_args(tiny_model_dir, _write(tmp_path, TEMPLATE), rm_type=None, reward_functions=["exact", "llm_judge"],
                      reward_weights=[1.0, 0.5])
    reward = build_reward(args)
    assert isinstance(reward, RewardMix) and reward.names == ["exact", "llm_judge"]
    with_pool(StubPool("Score: 6", "no score at all"))
    s = asyncio.run(score(reward, args, sample()))
    assert s.reward_dict == {"exact": 1.0, "llm_judge": pytest.approx(0.6)} and s.reward == pytest.approx(1.3)
    s = asyncio.run(score(reward, args, sample()))
    assert s.status == SampleStatus.FAILED and s.reward is None


def test_the_pool_is_looked_up_at_the_first_call(tiny_model_dir, tmp_path, with_pool):
    args = judge_args(tiny_model_dir, _write(tmp_path, TEMPLATE))
    api.set_context(None)
    reward = build_reward(args)  # no rollout context yet: building the reward does not need the engines
    pool = with_pool(StubPool("Score: 5", "Score: 8"))
    assert asyncio.run(reward(args, sample())) == 0.5 and asyncio.run(reward(args, sample())) == 0.8
    assert len(pool.payloads) == 2


# ---- the request ----------------------------------------------------------------------------------


def test_the_request_is_the_judges_chat_template_on_the_filled_template(tiny_model_dir, tmp_path, with_pool):
    args = judge_args(tiny_model_dir, _write(tmp_path, TEMPLATE + "temperature: 0.5\n"))
    pool = with_pool(StubPool("Score: 1"))
    score_one(args, sample(response="it is 2", label="2"))
    (payload,) = pool.payloads
    assert payload == {
        "text": "<|im_start|>system\nYou grade answers. Label: 2<|im_end|>\n"
                "<|im_start|>user\nQuestion: what is 1 plus 1 ?\nAnswer: it is 2\nReply with Score: N.<|im_end|>\n"
                "<|im_start|>assistant\n",
        "sampling_params": {"temperature": 0.5, "max_new_tokens": 12},
    }


def test_without_a_chat_template_the_plain_text(tiny_model_dir, tmp_path, with_pool):
    plain = tmp_path / "plain"
    shutil.copytree(tiny_model_dir, plain)
    tok = AutoTokenizer.from_pretrained(plain)
    tok.chat_template = None
    tok.save_pretrained(plain)
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    assert not getattr(AutoTokenizer.from_pretrained(plain), "chat_template", None)
    args = judge_args(str(plain), _write(tmp_path, TEMPLATE))
    pool = with_pool(StubPool("Score: 1"))
    score_one(args, sample(label=None))
    assert pool.payloads[0]["text"] == ("You grade answers. Label: \n\n"
                                        "Question: what is 1 plus 1 ?\nAnswer: 2\nReply with Score: N.")
    path = _write(tmp_path, 'prompt: "{response} {{literal}}"', name="nosystem.yaml")
    pool = with_pool(StubPool("Score: 1"))
    score_one(judge_args(str(plain), path), sample())
    assert pool.payloads[0]["text"] == "2 {literal}"


def test_a_chat_prompt_becomes_text():
    assert prompt_text("plain") == "plain"
    assert prompt_text([{"role": "user", "content": "hi"}]) == "hi"
    assert prompt_text([{"role": "system", "content": "be brief"}, {"role": "user", "content": [
        {"type": "text", "text": "look"}, {"type": "image_url", "image_url": {}}]}]) == "system: be brief\n\nuser: look"


def test_the_policy_may_be_the_judge(tiny_model_dir, tmp_path, with_pool):
    args = judge_args(tiny_model_dir, _write(tmp_path, TEMPLATE), judge_model="actor", served_models=(),
                      sglang_config=None)
    validate_judge(args)
    api.set_context(RolloutContext(args=None, tokenizer=None, engines=None, base_url="", models={"actor": StubPool(
        "Score: 4")}))
    assert score_one(args, sample()).reward == pytest.approx(0.4)


# ---- a real judge engine --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def judge_url(tiny_model_dir, tmp_path_factory):
    with native_server(tiny_model_dir, tmp_path_factory.mktemp("judge") / "log.txt") as (url, _):
        yield url


def _round_trip(args, url, samples):
    async def main():
        client = AsyncEngineControl(url, timeout=60)
        pool = RecordingPool(client)
        api.set_context(RolloutContext(args=args, tokenizer=None, engines=None, base_url=url,
                                       models={"judge": pool}))
        try:
            reward = build_reward(args)
            return pool, await asyncio.gather(*(score(reward, args, s) for s in samples))
        finally:
            await client.close()
            api.set_context(None)

    return asyncio.run(main())


def test_a_real_judge_gets_the_rendered_chat_and_a_non_answer_fails(tiny_model_dir, tmp_path, judge_url):
    args = judge_args(tiny_model_dir, _write(tmp_path, TEMPLATE))
    pool, (s,) = _round_trip(args, judge_url, [sample()])
    ((payload, out),) = pool.calls
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [{"role": "system", "content": "You grade answers. Label: 2"},
                {"role": "user", "content": "Question: what is 1 plus 1 ?\nAnswer: 2\nReply with Score: N."}]
    assert payload["text"] == tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # the engine tokenized exactly that text and answered greedily within max_new_tokens
    assert out["meta_info"]["prompt_tokens"] == len(tok(payload["text"])["input_ids"])
    assert 0 < out["meta_info"]["completion_tokens"] <= 12
    # the tiny random model never writes "Score: N" greedily: the sample fails, it is not scored 0
    assert not re.search(DEFAULT_PATTERN, out["text"])
    assert s.status == SampleStatus.FAILED and s.reward is None


def test_a_real_judge_round_trip_scores_what_it_answered(tiny_model_dir, tmp_path, judge_url):
    """Sampled answers of the tiny model (its vocabulary is rich in digits), graded with a pattern that
    takes any digit: each sample's reward is the last digit of its judge's answer / 10, or FAILED."""
    path = _write(tmp_path, TEMPLATE.replace("max_new_tokens: 12", "max_new_tokens: 24") +
                  "temperature: 1.0\npattern: '(\\d)'\n")
    args = judge_args(tiny_model_dir, path)
    samples = [sample(response=str(i)) for i in range(4)]
    pool, scored = _round_trip(args, judge_url, samples)
    assert len(pool.calls) == 4
    by_response = {re.search(r"Answer: (\d)", p["text"]).group(1): o["text"] for p, o in pool.calls}
    for s in scored:
        digits = re.findall(r"\d", by_response[s.response])
        if digits:
            assert s.status != SampleStatus.FAILED and s.reward == pytest.approx(int(digits[-1]) / 10)
        else:
            assert s.status == SampleStatus.FAILED and s.reward is None


# ---- start-up checks ------------------------------------------------------------------------------


def test_a_good_template_and_served_judge_pass(tiny_model_dir, tmp_path):
    path = _write(tmp_path, TEMPLATE)
    validate_judge(judge_args(tiny_model_dir, path))
    validate_judge(judge_args(tiny_model_dir, path, rm_type=None, reward_functions=["math", "llm_judge"]))
    t = load_judge_template(path)
    assert (t.max_score, t.max_new_tokens, t.temperature, t.pattern.pattern) == (10.0, 12, 0.0, DEFAULT_PATTERN)
    minimal = load_judge_template(_write(tmp_path, "prompt: 'grade {response}'", name="min.yaml"))
    assert (minimal.system, minimal.max_score, minimal.max_new_tokens, minimal.temperature) == (None, None, 256, 0.0)


def test_judge_flags_without_the_judge(tiny_model_dir, tmp_path):
    validate_judge(judge_args(tiny_model_dir, None, rm_type="math"))  # no judge, no judge flags: nothing to say
    with pytest.raises(SlimeConfigError, match=r"^--judge-template is an LLM-judge flag: it needs --rm-type "
                                               r"llm_judge \(or llm_judge in --reward-functions\)$"):
        validate_judge(judge_args(tiny_model_dir, "j.yaml", rm_type="math"))
    with pytest.raises(SlimeConfigError, match=r"^--judge-model is an LLM-judge flag: it needs --rm-type llm_judge"):
        validate_judge(judge_args(tiny_model_dir, None, rm_type=None, reward_functions=["math"], judge_model="g"))


def test_an_unknown_judge_model(tiny_model_dir, tmp_path):
    path = _write(tmp_path, TEMPLATE)
    with pytest.raises(SlimeConfigError) as e:
        validate_judge(judge_args(tiny_model_dir, path, judge_model="grader"))
    assert str(e.value) == ("--judge-model grader: --rm-type llm_judge needs a served model of that name; "
                            "--sglang-config served.yaml serves judge beside the policy (actor); add the judge to "
                            "--sglang-config (docs/served_models.md) or pass --judge-model NAME")
    with pytest.raises(SlimeConfigError) as e:
        validate_judge(judge_args(tiny_model_dir, path, served_models=(), sglang_config=None,
                                  rm_type=None, reward_functions=["llm_judge"]))
    assert str(e.value).startswith("--judge-model judge: --reward-functions llm_judge needs a served model of that "
                                   "name; this run serves only the policy (actor): no --sglang-config; ")


def test_no_template(tiny_model_dir):
    with pytest.raises(SlimeConfigError, match=r"^--rm-type llm_judge needs --judge-template PATH \(a YAML file"):
        validate_judge(judge_args(tiny_model_dir, None))


BAD_TEMPLATES = [
    ("prompt: [unclosed", "not valid YAML (line 1): "),
    ("- a list", "must be a mapping with a `prompt:` field, got list"),
    ("", "must be a mapping with a `prompt:` field, got NoneType"),
    ("system: hi", "prompt: required"),
    ("prompt: 'x'\npromt: 'y'", "promt: unknown field (did you mean prompt?)"),
    ("prompt: 'x'\nmodel: judge", "model: unknown field; the fields are prompt, system, pattern"),
    ("prompt: ''", "prompt: must be a non-empty string"),
    ("prompt: 3", "prompt: must be a non-empty string, got 3"),
    ("prompt: 'grade {answer} against {reference}'", "prompt: unknown placeholder(s) {answer}, {reference}; the "
                                                      "placeholders are {prompt}, {response} and {label}"),
    ("prompt: 'grade {response.upper}'", "prompt: unknown placeholder(s) {response.upper}"),
    ("prompt: 'json: {\"score\": 1}'", "prompt: unknown placeholder(s) {\"score\"}"),
    ("prompt: 'x {'", "prompt: Single '{' encountered in format string (a literal brace is written twice"),
    ("prompt: '{}'", "prompt: unknown placeholder(s) {}"),
    ("prompt: x\nsystem: 'judge {rubric}'", "system: unknown placeholder(s) {rubric}"),
    ("prompt: x\npattern: '(\\d'", "pattern: not a valid regular expression"),
    ("prompt: x\npattern: 'score \\d+'", "pattern: must have exactly one capture group (the score), "
                                         "'score \\\\d+' has 0; write other groups as (?:...)"),
    ("prompt: x\npattern: '(a)(\\d)'", "pattern: must have exactly one capture group (the score), '(a)(\\\\d)' has 2"),
    ("prompt: x\npattern: 5", "pattern: must be a regular expression string, got 5"),
    ("prompt: x\nmax_score: ten", "max_score: must be a number, got 'ten'"),
    ("prompt: x\nmax_score: 0", "max_score: must be > 0 (the score is divided by it), got 0"),
    ("prompt: x\nmax_score: true", "max_score: must be a number, got True"),
    ("prompt: x\nmax_score: .inf", "max_score: must be finite, got inf"),
    ("prompt: x\nmax_new_tokens: 0", "max_new_tokens: must be >= 1, got 0"),
    ("prompt: x\nmax_new_tokens: 12.5", "max_new_tokens: must be an integer, got 12.5"),
    ("prompt: x\ntemperature: -1", "temperature: must be >= 0, got -1"),
    ("prompt: x\ntemperature: hot", "temperature: must be a number, got 'hot'"),
]


@pytest.mark.parametrize("text, message", BAD_TEMPLATES, ids=[m.split(":")[0] + str(i)
                                                              for i, (_, m) in enumerate(BAD_TEMPLATES)])
def test_each_bad_template_is_one_line_naming_the_file_and_field(tiny_model_dir, tmp_path, text, message):
    path = _write(tmp_path, text)
    with pytest.raises(SlimeConfigError) as e:
        validate_judge(judge_args(tiny_model_dir, path))
    msg = str(e.value)
    assert msg.startswith(f"--judge-template {path}: ") and "\n" not in msg
    assert message in msg, msg


def test_a_missing_template_file(tiny_model_dir, tmp_path):
    with pytest.raises(SlimeConfigError, match=rf"^--judge-template {tmp_path}/none.yaml: file does not exist$"):
        validate_judge(judge_args(tiny_model_dir, str(tmp_path / "none.yaml")))


def test_the_example_template_parses():
    t = load_judge_template(str(Path(__file__).resolve().parents[3] / "examples" / "llm_judge" / "judge.yaml"))
    assert t.max_score and t.parse("... Score: 7") == pytest.approx(7 / t.max_score)


# ---- through the real parser ----------------------------------------------------------------------


def _judge_flags_wired() -> bool:
    options = build_parser()._option_string_actions
    return "--sglang-config" in options and "--judge-model" in options


@pytest.mark.skipif(not _judge_flags_wired(), reason="--judge-model / --sglang-config not in slime.arguments yet")
def test_through_the_parser(tiny_model_dir, tmp_path):
    judge_dir = tmp_path / "judge_model"
    shutil.copytree(tiny_model_dir, judge_dir)
    cfg = _write(tmp_path, f"""
        sglang:
          - name: actor
            server_groups: [{{worker_type: regular, num_gpus: 1}}]
          - name: judge
            model_path: {judge_dir}
            update_weights: false
            server_groups: [{{worker_type: regular, num_gpus: 1}}]
        """, name="served.yaml")
    template = _write(tmp_path, TEMPLATE)
    args = make_args(tiny_model_dir, tmp_path, "--sglang-config", cfg, "--rm-type", "llm_judge",
                     "--judge-template", template)
    assert (args.judge_model, args.judge_template) == ("judge", template)
    assert LLMJudgeReward(args).model_path == str(judge_dir)
    with pytest.raises(SlimeConfigError, match=r"^--judge-model grader: --rm-type llm_judge needs a served model"):
        make_args(tiny_model_dir, tmp_path, "--sglang-config", cfg, "--rm-type", "llm_judge",
                  "--judge-template", template, "--judge-model", "grader")
    with pytest.raises(SlimeConfigError, match=r"^--judge-template is an LLM-judge flag"):
        make_args(tiny_model_dir, tmp_path, "--judge-template", template)
    with pytest.raises(SlimeConfigError, match=rf"^--judge-template {template}: prompt: unknown placeholder"):
        _write(tmp_path, "prompt: '{answer}'")
        make_args(tiny_model_dir, tmp_path, "--sglang-config", cfg, "--rm-type", "llm_judge",
                  "--judge-template", template)
