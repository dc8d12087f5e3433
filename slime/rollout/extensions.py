"""The rollout side's extension points, loaded once per run (signatures: docs/custom_rollout.md and
docs/algorithms.md; checked by tests/contracts/)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

from slime.types import Sample
from slime.utils.hooks import load_function


@dataclass(frozen=True)
class Extensions:
    rollout: Callable | None = None  # --rollout-function-path: the whole rollout
    generate: Callable | None = None  # --custom-generate-function-path: one sample's generation
    dynamic_filter: Callable | None = None  # --dynamic-sampling-filter-path: keep a group?
    sample_filter: Callable | None = None  # --rollout-sample-filter-path: mark samples out of the loss
    reward_post_process: Callable | None = None  # --custom-reward-post-process-path: training rewards
    evaluate: Callable | None = None  # --eval-function-path: the whole evaluation

    FLAGS = {"rollout": "rollout_function_path", "generate": "custom_generate_function_path",
             "dynamic_filter": "dynamic_sampling_filter_path", "sample_filter": "rollout_sample_filter_path",
             "reward_post_process": "custom_reward_post_process_path", "evaluate": "eval_function_path"}

    @classmethod
    def load(cls, args) -> "Extensions":
        return cls(**{name: load_function(getattr(args, flag), "--" + flag.replace("_", "-"))
                      for name, flag in cls.FLAGS.items() if getattr(args, flag)})


def call_user(fn: Callable, run: Callable, *args, **kwargs):
    """Call a user function that may be sync or async; an awaitable result runs through `run`
    (the rollout loop's runner), so sync user code can still call `context().run(...)`."""
    out = fn(*args, **kwargs)
    return run(out) if inspect.isawaitable(out) else out


def check_groups(groups, flag: str) -> list[list[Sample]]:
    """A user function's list of groups (each a non-empty list of Samples), or a TypeError naming the flag."""
    if not isinstance(groups, (list, tuple)) or not all(
            isinstance(g, (list, tuple)) and g and all(isinstance(s, Sample) for s in g) for g in groups):
        raise TypeError(f"{flag} must return a list of groups, each a non-empty list of Samples")
    return [list(g) for g in groups]
