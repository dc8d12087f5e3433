"""A verifiers environment written here: answer a sum, then check it (single- or multi-turn).

    --custom-generate-function-path slime.rollout.environments.verifiers_env.generate
    --env-id examples/verifiers_env/check_env.py --env-args '{"turns": 2}'

It is an ordinary verifiers environment (the classic API every environment package implements): a
`load_environment(**kwargs)` that returns a `vf.SingleTurnEnv` (`turns: 1`) or a `vf.MultiTurnEnv`
whose environment turn asks the model to check its answer (`turns` >= 2), a dataset of
`question`/`answer` rows, and a `vf.Rubric` whose one reward function is 1.0 when the last reply's
first number equals the answer. Installed as a package (its module on the path), the same file
runs as `--env-id check_env`.
"""

from __future__ import annotations

import random
import re

import verifiers as vf
from datasets import Dataset

CHECK = "check your answer . what is the answer ?"
_NUMBER = re.compile(r"-?\d+")


def _role(message) -> str:
    return message.get("role") if isinstance(message, dict) else getattr(message, "role", "")


def _content(message) -> str:
    content = message.get("content") if isinstance(message, dict) else getattr(message, "content", "")
    return content if isinstance(content, str) else str(content or "")


def correct(completion, answer, **kwargs) -> float:
    """1.0 when the first number of the last assistant reply is the answer."""
    replies = [m for m in completion if _role(m) == "assistant"]
    m = _NUMBER.search(_content(replies[-1])) if replies else None
    return float(m is not None and m.group(0) == str(answer))


class CheckAgainEnv(vf.MultiTurnEnv):
    """After each reply the environment asks the model to check its answer, up to `max_turns` replies."""

    def __init__(self, check: str = CHECK, **kwargs):
        super().__init__(**kwargs)
        self.check = check

    async def env_response(self, messages, state, **kwargs):
        return [{"role": "user", "content": self.check}]


def load_environment(turns: int = 2, num_examples: int = 64, seed: int = 0, check: str = CHECK,
                     system_prompt: str | None = None, max_value: int = 9,
                     max_tokens: int | None = None) -> vf.Environment:
    """`turns` model replies per episode (1: single-turn), `num_examples` sums of numbers up to `max_value`,
    `max_tokens` per reply (verifiers' sampling_args; the run's response budget caps the episode)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_examples):
        a, b = rng.randint(0, max_value), rng.randint(0, max_value)
        rows.append({"question": f"what is {a} plus {b} ?", "answer": str(a + b)})
    dataset = Dataset.from_list(rows)
    rubric = vf.Rubric(funcs=[correct], weights=[1.0])
    common = dict(dataset=dataset, rubric=rubric, system_prompt=system_prompt,
                  sampling_args=None if max_tokens is None else {"max_tokens": max_tokens})
    if turns == 1:
        return vf.SingleTurnEnv(**common)
    return CheckAgainEnv(check=check, max_turns=turns, **common)
