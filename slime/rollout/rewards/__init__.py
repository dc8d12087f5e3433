"""Reward functions: built-ins selected by `--rm-type`, a remote service (`--rm-url`), or the
user's `--custom-rm-path` (per sample, or per group with `--group-rm`).

Every reward is called the same way, through `RewardFunction`:
- per sample: `[async] fn(args, sample) -> float | dict`
- per group (`--group-rm`): `[async] fn(args, samples) -> list[float | dict]`
A sync function runs in a worker thread. The built-ins `fn(response, label) -> float` (math,
exact) are wrapped to that signature. Failures (raise, timeout, NaN) are handled by
`slime.rollout.generate.score`: the sample is marked FAILED, counted and kept out of the loss.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Callable

from slime.rollout.rewards.math import math_reward
from slime.rollout.rewards.reasoning_gym import reasoning_gym_reward
from slime.rollout.rewards.remote import RemoteReward
from slime.utils.hooks import load_function


def exact_reward(response: str, label) -> float:
    """1.0 when the stripped response equals the stripped label."""
    return 1.0 if response.strip() == str(label).strip() else 0.0


# rm-type -> fn(response, label) -> float
REWARD_FUNCTIONS: dict[str, Callable[[str, object], float]] = {
    "math": math_reward,
    "exact": exact_reward,
}


def get_reward_function(rm_type: str) -> Callable[[str, object], float]:
    """A built-in `fn(response, label) -> float` by `--rm-type` name."""
    try:
        return REWARD_FUNCTIONS[rm_type]
    except KeyError:
        raise ValueError(f"unknown --rm-type {rm_type!r}; choose from {sorted(REWARD_FUNCTIONS)}") from None


class RewardFunction:
    """One way to call any reward: `await reward(args, sample_or_samples)`; `group` says which."""

    def __init__(self, fn: Callable, group: bool = False, name: str = ""):
        self.fn = fn
        self.group = group
        self.name = name or getattr(fn, "__name__", "reward")

    async def __call__(self, args, arg):
        if inspect.iscoroutinefunction(self.fn):
            return await self.fn(args, arg)
        out = await asyncio.to_thread(self.fn, args, arg)
        if inspect.isawaitable(out):  # e.g. a functools.partial of a coroutine function
            out = await out
        return out


def _on_response(fn: Callable[[str, object], float]) -> Callable:
    def reward(args, sample):
        return fn(sample.response, sample.label)

    reward.__name__ = fn.__name__
    return reward


def build_reward(args) -> RewardFunction:
    """The run's reward: --custom-rm-path, else --rm-type (remote_rm uses --rm-url)."""
    if args.custom_rm_path:
        return RewardFunction(load_function(args.custom_rm_path, "--custom-rm-path"), group=args.group_rm)
    if args.rm_type == "remote_rm":
        return RewardFunction(RemoteReward(args.rm_url, args.rm_timeout, args.rm_max_retries), name="remote_rm")
    if args.rm_type == "reasoning_gym":
        return RewardFunction(reasoning_gym_reward)
    return RewardFunction(_on_response(get_reward_function(args.rm_type)))
