"""Reward flags: which reward (`--rm-type`, `--rm-url`, `--rm-path`, `--reward-functions` and
friends, `add_reward_flags`), and the LLM judge's (`--judge-model`, `--judge-template`), its
template file and their start-up checks (docs/custom_rollout.md, "LLM judge").

`--rm-type llm_judge` (or `llm_judge` in `--reward-functions`) asks a served model (`--sglang-config`,
named by `--judge-model`, default `judge`) to grade each sample; `slime.rollout.rewards.llm_judge`
is the reward. The template file is YAML:

    system: You are a strict grader.                 # optional system message
    prompt: |                                        # required: the user message
      Question: {prompt}
      Reference answer: {label}
      Answer to grade: {response}
      Reply with "Score: N", N from 0 to 10.
    pattern: '(?i)score\\s*[:=]\\s*(-?\\d+(?:\\.\\d+)?)'  # optional: one capture group, a number
    max_score: 10                                    # optional: the score is divided by it
    max_new_tokens: 256                              # optional
    temperature: 0.0                                 # optional

`{prompt}`, `{response}` and `{label}` are the only placeholders (Python `str.format` fields; a
literal brace is written twice, `{{` and `}}`), in `system` too. The last match of `pattern` in
the judge's answer is the score.

`validate_judge(args)` runs at parse time and gives one line for each bad input, naming the flag,
or the file and its field.
"""

from __future__ import annotations

import difflib
import math
import re
import string
from dataclasses import dataclass
from pathlib import Path

import yaml

from slime.utils.errors import SlimeConfigError
from slime.utils.reward_names import RM_TYPES, UNAVAILABLE_RM_TYPES
from slime.utils.yaml_fields import yaml_problem

JUDGE_RM_TYPE = "llm_judge"
DEFAULT_JUDGE_MODEL = "judge"
DEFAULT_PATTERN = r"(?i)score\s*[:=]\s*(-?\d+(?:\.\d+)?)"
DEFAULT_MAX_NEW_TOKENS = 256
DEFAULT_TEMPERATURE = 0.0
PLACEHOLDERS = ("prompt", "response", "label")
TEMPLATE_KEYS = ("prompt", "system", "pattern", "max_score", "max_new_tokens", "temperature")


def add_reward_flags(g) -> None:
    """The reward flags of the rollout group (the parser's, `slime.arguments`): which reward, its
    service or model, its limits, several rewards and their weights."""
    g.add_argument("--rm-type", choices=RM_TYPES + tuple(UNAVAILABLE_RM_TYPES), default=None,
                   help="math (default): math-verify equivalence of the final answer; exact: stripped string "
                        "equality; reasoning_gym: the task's own verifier (metadata from "
                        "slime.data.reasoning_gym); remote_rm: POST to --rm-url (the default when it is given); "
                        "reward_model: the logit of the --rm-path reward model; llm_judge: a served model grades "
                        "the sample (--judge-model, --judge-template); "
                        "slime's names deepscaler, dapo, f1, gpqa, random and boxed_* (docs/coming_from_slime.md)")
    g.add_argument("--rm-url", default=None, help="a remote reward service: POST {prompt, response, label, "
                   "metadata} -> a number or a dict (docs/custom_rollout.md)")
    g.add_argument("--rm-path", default=None, metavar="DIR", help="--rm-type reward_model: a Hugging Face "
                   "sequence-classification reward model (num_labels 1) run in the rollout process")
    g.add_argument("--rm-timeout", type=float, default=60.0,
                   help="seconds one reward call may take; past it the sample counts as a reward failure")
    g.add_argument("--rm-max-retries", type=int, default=3,
                   help="retries of a remote reward call after a timeout, connection error or HTTP 5xx")
    g.add_argument("--reward-key", default=None,
                   help="the entry of a dict reward that is the scalar reward (each entry is logged as "
                        "rollout/reward/<key>)")
    g.add_argument("--reward-functions", nargs="+", default=None, metavar="REWARD",
                   help="several rewards, each an --rm-type name or a function path (as --custom-rm-path); each "
                        "is logged as rollout/reward/<name>, the reward is their --reward-weights sum "
                        "(docs/custom_rollout.md)")
    g.add_argument("--reward-weights", nargs="+", type=float, default=None, metavar="W",
                   help="one weight per --reward-functions entry (default: 1 each)")
    g.add_argument("--reward-aggregation", choices=("sum", "gdpo"), default="sum",
                   help="with --reward-functions: sum: train on the weighted sum (normalized per the estimator); "
                        "gdpo: normalize each reward within its group, then the weighted sum over the batch (GDPO)")


def add_judge_flags(p) -> None:
    g = p.add_argument_group("LLM judge reward (--rm-type llm_judge; docs/custom_rollout.md)")
    g.add_argument("--judge-model", default=DEFAULT_JUDGE_MODEL, metavar="NAME",
                   help="the served model (--sglang-config) that grades each sample for --rm-type llm_judge")
    g.add_argument("--judge-template", default=None, metavar="PATH",
                   help="YAML file of the judge's request: prompt (with {prompt}, {response}, {label}), system, "
                        "pattern (one capture group: the score), max_score, max_new_tokens, temperature")


@dataclass(frozen=True)
class JudgeTemplate:
    """A checked judge template (module docstring): `messages` renders the chat, `parse` the score."""

    path: str
    prompt: str
    system: str | None = None
    pattern: re.Pattern = re.compile(DEFAULT_PATTERN)
    max_score: float | None = None
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = DEFAULT_TEMPERATURE

    def messages(self, prompt: str, response: str, label: str) -> list[dict]:
        """The judge's chat: the optional system message and the user message, placeholders filled."""
        values = {"prompt": prompt, "response": response, "label": label}
        out = [{"role": "system", "content": self.system.format(**values)}] if self.system is not None else []
        return out + [{"role": "user", "content": self.prompt.format(**values)}]

    def sampling_params(self) -> dict:
        return {"temperature": self.temperature, "max_new_tokens": self.max_new_tokens}

    def parse(self, answer: str) -> float:
        """The score in the judge's `answer`: the number captured by the last match of the pattern,
        divided by `max_score` when given. No match, or a capture that is not a finite number, raises
        ValueError quoting the answer's tail."""
        matches = list(self.pattern.finditer(answer))
        if not matches:
            raise ValueError(f"judge answer does not match pattern {self.pattern.pattern!r} "
                             f"(--judge-template {self.path}): ...{_tail(answer)!r}")
        captured = matches[-1].group(1)
        try:
            value = float(captured)
        except (TypeError, ValueError):
            value = math.nan
        if not math.isfinite(value):
            raise ValueError(f"judge score {captured!r} is not a finite number (pattern {self.pattern.pattern!r}, "
                             f"--judge-template {self.path}): ...{_tail(answer)!r}")
        return value / self.max_score if self.max_score is not None else value


def _tail(text: str, n: int = 200) -> str:
    return text[-n:]


class _Where:
    def __init__(self, path: str):
        self.path = path

    def fail(self, field: str, message: str):
        raise SlimeConfigError(f"--judge-template {self.path}: {field}: {message}")


def _check_placeholders(where: _Where, field: str, text) -> str:
    if not isinstance(text, str) or not text.strip():
        where.fail(field, f"must be a non-empty string, got {text!r}")
    try:
        names = [f for _, f, _, _ in string.Formatter().parse(text) if f is not None]
    except ValueError as e:
        where.fail(field, f"{e} (a literal brace is written twice: {{{{ or }}}})")
    unknown = sorted({n for n in names if n not in PLACEHOLDERS})
    if unknown:
        where.fail(field, f"unknown placeholder(s) {', '.join('{' + n + '}' for n in unknown)}; the placeholders "
                          f"are {{prompt}}, {{response}} and {{label}} (a literal brace is written twice)")
    return text


def _number(where: _Where, field: str, value, *, integer: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        where.fail(field, f"must be {'an integer' if integer else 'a number'}, got {value!r}")
    if not math.isfinite(value):
        where.fail(field, f"must be finite, got {value!r}")
    return value


def load_judge_template(path: str) -> JudgeTemplate:
    """Read and check a judge template file (module docstring); SlimeConfigError naming the file and
    field for anything wrong."""
    where = _Where(path)
    file = Path(path)
    if not file.is_file():
        raise SlimeConfigError(f"--judge-template {path}: file does not exist")
    try:
        raw = yaml.safe_load(file.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise SlimeConfigError(f"--judge-template {path}: cannot read it ({e})") from None
    except yaml.YAMLError as e:
        line, why = yaml_problem(e)
        at = f" (line {line})" if line is not None else ""
        raise SlimeConfigError(f"--judge-template {path}: not valid YAML{at}: {why}") from None
    if not isinstance(raw, dict):
        raise SlimeConfigError(f"--judge-template {path}: must be a mapping with a `prompt:` field, got "
                               f"{type(raw).__name__}")
    for key in raw:
        if key not in TEMPLATE_KEYS:
            close = difflib.get_close_matches(str(key), TEMPLATE_KEYS, n=1)
            where.fail(str(key), "unknown field" + (f" (did you mean {close[0]}?)" if close else "")
                       + f"; the fields are {', '.join(TEMPLATE_KEYS)}")
    if "prompt" not in raw:
        where.fail("prompt", "required (the user message, with {prompt}, {response}, {label})")
    fields: dict = {"prompt": _check_placeholders(where, "prompt", raw["prompt"])}
    if raw.get("system") is not None:
        fields["system"] = _check_placeholders(where, "system", raw["system"])
    if raw.get("pattern") is not None:
        if not isinstance(raw["pattern"], str):
            where.fail("pattern", f"must be a regular expression string, got {raw['pattern']!r}")
        try:
            pattern = re.compile(raw["pattern"])
        except re.error as e:
            where.fail("pattern", f"not a valid regular expression ({e})")
        if pattern.groups != 1:
            where.fail("pattern", f"must have exactly one capture group (the score), {raw['pattern']!r} has "
                                  f"{pattern.groups}; write other groups as (?:...)")
        fields["pattern"] = pattern
    if raw.get("max_score") is not None:
        fields["max_score"] = float(_number(where, "max_score", raw["max_score"]))
        if fields["max_score"] <= 0:
            where.fail("max_score", f"must be > 0 (the score is divided by it), got {raw['max_score']!r}")
    if raw.get("max_new_tokens") is not None:
        fields["max_new_tokens"] = int(_number(where, "max_new_tokens", raw["max_new_tokens"], integer=True))
        if fields["max_new_tokens"] < 1:
            where.fail("max_new_tokens", f"must be >= 1, got {raw['max_new_tokens']!r}")
    if raw.get("temperature") is not None:
        fields["temperature"] = float(_number(where, "temperature", raw["temperature"]))
        if fields["temperature"] < 0:
            where.fail("temperature", f"must be >= 0, got {raw['temperature']!r}")
    return JudgeTemplate(path=str(path), **fields)


def judge_used(args) -> str | None:
    """How the run asks for the judge (`--rm-type llm_judge` or `--reward-functions llm_judge`), or None."""
    if JUDGE_RM_TYPE in (args.reward_functions or ()):
        return f"--reward-functions {JUDGE_RM_TYPE}"
    if args.rm_type == JUDGE_RM_TYPE:
        return f"--rm-type {JUDGE_RM_TYPE}"
    return None


def judge_model_path(args, name: str) -> str | None:
    """The Hugging Face directory of served model `name` (a frozen model of --sglang-config, or the
    policy under its own name), or None when the run serves no model of that name."""
    for m in args.served_models:
        if m.name == name:
            return m.model_path
    return args.hf_checkpoint if name == args.policy_model_name else None


def validate_judge(args) -> None:
    """The judge flags (module docstring): the served model exists, the template file parses."""
    flag = judge_used(args)
    if flag is None:
        given = [f for f, v in (("--judge-model", args.judge_model != DEFAULT_JUDGE_MODEL),
                                ("--judge-template", args.judge_template is not None)) if v]
        if given:
            raise SlimeConfigError(f"{given[0]} is an LLM-judge flag: it needs --rm-type {JUDGE_RM_TYPE} "
                                   f"(or {JUDGE_RM_TYPE} in --reward-functions)")
        return
    if judge_model_path(args, args.judge_model) is None:
        served = ", ".join(m.name for m in args.served_models) or "no other model"
        where = (f"--sglang-config {args.sglang_config} serves {served} beside the policy "
                 f"({args.policy_model_name})" if args.sglang_config is not None
                 else f"this run serves only the policy ({args.policy_model_name}): no --sglang-config")
        raise SlimeConfigError(f"--judge-model {args.judge_model}: {flag} needs a served model of that name; "
                               f"{where}; add the judge to --sglang-config (docs/served_models.md) or pass "
                               "--judge-model NAME")
    if args.judge_template is None:
        raise SlimeConfigError(f"{flag} needs --judge-template PATH (a YAML file with the judge's prompt; "
                               "docs/custom_rollout.md#llm-judge)")
    load_judge_template(args.judge_template)
