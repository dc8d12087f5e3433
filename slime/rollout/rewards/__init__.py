"""Reward functions: built-ins selected by `--rm-type`, a remote service (`--rm-url`), a
sequence-classification reward model (`--rm-type reward_model --rm-path DIR`), a served LLM judge
(`--rm-type llm_judge --judge-template PATH`, `slime.rollout.rewards.llm_judge`), or the
user's `--custom-rm-path` (per sample, or per group with `--group-rm`); or several of these, weighted,
with `--reward-functions` (`slime.rollout.rewards.mix`).

Every reward is called the same way, through `RewardFunction`:
- per sample: `[async] fn(args, sample) -> float | dict`
- per group (`--group-rm`): `[async] fn(args, samples) -> list[float | dict]`
A sync function runs in a worker thread. The rule-based built-ins `fn(response, label) -> float`
(`REWARD_FUNCTIONS`; gpqa also takes the sample's metadata) are wrapped to that signature; a
`boxed_` prefix on their names grades only the response's last `\\boxed{}` content. The accepted
and refused names are in `slime.rollout.rewards.names`. Failures (raise, timeout, NaN, ±inf) are handled
by `slime.rollout.generate.score`: the sample is marked FAILED, counted and kept out of the loss.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import random
from typing import Callable

from slime.rollout.rewards.dapo import dapo_reward
from slime.rollout.rewards.deepscaler import deepscaler_reward, last_boxed
from slime.rollout.rewards.f1 import f1_reward
from slime.rollout.rewards.gpqa import gpqa_reward
from slime.rollout.rewards.llm_judge import LLMJudgeReward
from slime.rollout.rewards.math import math_reward
from slime.rollout.rewards.mix import RewardMix
from slime.rollout.rewards.names import BOXED_PREFIX, UNAVAILABLE_RM_TYPES, unavailable_message
from slime.rollout.rewards.reasoning_gym import reasoning_gym_reward
from slime.rollout.rewards.remote import RemoteReward
from slime.rollout.rewards.reward_model import RewardModelReward
from slime.utils.errors import SlimeConfigError
from slime.utils.hooks import load_function
from slime.utils.reward_names import is_builtin, reward_name


def exact_reward(response: str, label) -> float:
    """1.0 when the stripped response equals the stripped label."""
    return 1.0 if response.strip() == str(label).strip() else 0.0


def random_reward(response: str, label) -> float:
    """1.0 or 0.0 at random, whatever the response (original slime's `random`: a pipeline check)."""
    return float(random.randint(0, 1))


def no_reward(response: str, label) -> float:
    """0.0 for every sample (`--rm-type none`: no task reward, e.g. pure on-policy distillation)."""
    return 0.0


# rm-type -> fn(response, label[, metadata]) -> float | dict (dapo: {"score", "acc", "pred"})
REWARD_FUNCTIONS: dict[str, Callable] = {
    "math": math_reward,
    "exact": exact_reward,
    "deepscaler": deepscaler_reward,
    "dapo": dapo_reward,
    "f1": f1_reward,
    "gpqa": gpqa_reward,
    "random": random_reward,
    "none": no_reward,
}


def _on_boxed(fn: Callable) -> Callable:
    @functools.wraps(fn)  # keeps fn's signature (does it take metadata?)
    def reward(response: str, label, *rest, **kw):
        return fn(last_boxed(response or "") or "", label, *rest, **kw)

    reward.__name__ = f"boxed_{fn.__name__}"
    return reward


def get_reward_function(rm_type: str) -> Callable:
    """A built-in `fn(response, label[, metadata])` by `--rm-type` name (`boxed_NAME`: NAME on the
    response's last boxed answer, "" when there is none). A refused name raises SlimeConfigError."""
    if rm_type in UNAVAILABLE_RM_TYPES:
        raise SlimeConfigError(unavailable_message(rm_type))
    if rm_type in REWARD_FUNCTIONS:
        return REWARD_FUNCTIONS[rm_type]
    if rm_type.startswith(BOXED_PREFIX) and rm_type[len(BOXED_PREFIX):] in REWARD_FUNCTIONS:
        return _on_boxed(REWARD_FUNCTIONS[rm_type[len(BOXED_PREFIX):]])
    raise ValueError(f"unknown --rm-type {rm_type!r}; choose from {sorted(REWARD_FUNCTIONS)} "
                     f"(each also as {BOXED_PREFIX}NAME)")


class RewardFunction:
    """One way to call any reward: `await reward(args, sample_or_samples)`; `group` says which."""

    def __init__(self, fn: Callable, group: bool = False, name: str = ""):
        self.fn = fn
        self.group = group
        self.name = name or getattr(fn, "__name__", "reward")

    def time_limit(self, rm_timeout: float) -> float:
        """The bound of one whole scoring call: `--rm-timeout`, or for a function that times its own
        attempts (the remote RM: `--rm-timeout` each) the bound of all its attempts and waits."""
        total = getattr(self.fn, "total_timeout", None)
        return total if total is not None else rm_timeout

    async def __call__(self, args, arg):
        if inspect.iscoroutinefunction(self.fn):
            return await self.fn(args, arg)
        out = await asyncio.to_thread(self.fn, args, arg)
        if inspect.isawaitable(out):  # e.g. a functools.partial of a coroutine function
            out = await out
        return out


def _on_response(fn: Callable) -> Callable:
    if "metadata" in inspect.signature(fn).parameters:
        def reward(args, sample):
            return fn(sample.response, sample.label, metadata=sample.metadata)
    else:
        def reward(args, sample):
            return fn(sample.response, sample.label)

    reward.__name__ = fn.__name__
    return reward


def build_reward(args) -> RewardFunction | RewardMix:
    """The run's reward: --reward-functions (several, weighted), else --custom-rm-path, else
    --rm-type (remote_rm uses --rm-url, reward_model --rm-path, llm_judge --judge-model and --judge-template)."""
    entries = getattr(args, "reward_functions", None)
    if entries:
        return RewardMix([(reward_name(e), _builtin_reward(args, e) if is_builtin(e)
                           else RewardFunction(load_function(e, "--reward-functions"))) for e in entries],
                         getattr(args, "reward_weights", None))
    if args.custom_rm_path:
        return RewardFunction(load_function(args.custom_rm_path, "--custom-rm-path"), group=args.group_rm)
    return _builtin_reward(args, args.rm_type)


def _builtin_reward(args, rm_type: str) -> RewardFunction:
    if rm_type == "remote_rm":
        return RewardFunction(RemoteReward(args.rm_url, args.rm_timeout, args.rm_max_retries), name="remote_rm")
    if rm_type == "reasoning_gym":
        return RewardFunction(reasoning_gym_reward)
    if rm_type == "reward_model":
        return RewardFunction(RewardModelReward(args.rm_path, args.rm_timeout), name="reward_model")
    if rm_type == "llm_judge":
        return RewardFunction(LLMJudgeReward(args), name="llm_judge")
    return RewardFunction(_on_response(get_reward_function(rm_type)))
