"""Built-in reward functions, selected by `--rm-type`.

Each is `fn(response: str, label) -> float`.
"""

from __future__ import annotations

from typing import Callable

from slime.rollout.rewards.math import math_reward


def exact_reward(response: str, label) -> float:
    """1.0 when the stripped response equals the stripped label."""
    return 1.0 if response.strip() == str(label).strip() else 0.0


REWARD_FUNCTIONS: dict[str, Callable[[str, object], float]] = {
    "math": math_reward,
    "exact": exact_reward,
}


def get_reward_function(rm_type: str) -> Callable[[str, object], float]:
    try:
        return REWARD_FUNCTIONS[rm_type]
    except KeyError:
        raise ValueError(f"unknown --rm-type {rm_type!r}; choose from {sorted(REWARD_FUNCTIONS)}") from None
