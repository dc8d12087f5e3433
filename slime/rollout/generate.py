"""Default generation: one sample -> one `/generate` call -> reward.

Token ids go in and out (never re-tokenized), so the response tokens, their
rollout log-probs and the loss mask line up with what the engine produced.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time

from slime.observability.spans import add_span, sample_span
from slime.rollout.api import continue_sample
from slime.rollout.rewards import RewardFunction, RewardMix
from slime.types import Sample, SampleStatus
from slime.utils.errors import SlimeConfigError

logger = logging.getLogger(__name__)


def sampling_params(args, evaluation: bool = False) -> dict:
    prefix = "eval" if evaluation else "rollout"
    params = {
        "temperature": getattr(args, f"{prefix}_temperature"),
        "top_p": getattr(args, f"{prefix}_top_p"),
        "top_k": getattr(args, f"{prefix}_top_k"),
        "max_new_tokens": getattr(args, f"{prefix}_max_response_len"),
        "skip_special_tokens": True,
    }
    if args.rollout_stop:
        params["stop"] = list(args.rollout_stop)
    if args.rollout_stop_token_ids:
        params["stop_token_ids"] = list(args.rollout_stop_token_ids)
    return params


def sample_seed(seed: int, rollout_id: int, index: int, evaluation: bool = False) -> int:
    """A per-request sampling seed that depends only on the run seed and the sample's place."""
    key = f"{seed}/{'eval' if evaluation else 'train'}/{rollout_id}/{index}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "little")


async def generate(engines, sample: Sample, params: dict) -> Sample:
    """Continue `sample.tokens` (the prompt, and the partial response of a sample resumed after an
    abort) with one engine call and extend the response."""
    out = await continue_sample(sample, params, engines)
    sample.response += out.text
    return sample


def scalar_reward(reward, reward_key: str | None):
    """(scalar reward, the dict or None) from what a reward function returned.

    A dict reward needs `--reward-key` to name its scalar entry; without it, or when the key is
    missing, that is a configuration error (raised, not a failed sample).
    """
    if not isinstance(reward, dict):
        return reward, None
    if reward_key is None:
        raise SlimeConfigError(f"the reward function returned a dict (keys {sorted(reward)}); "
                               "pass --reward-key KEY to say which entry is the reward")
    if reward_key not in reward:
        raise SlimeConfigError(f"--reward-key {reward_key!r}: the reward function returned a dict without it "
                               f"(keys {sorted(reward)})")
    return reward[reward_key], reward


async def score(reward: RewardFunction | RewardMix, args, sample: Sample) -> Sample:
    """Reward one sample; a reward function that raises, times out (`--rm-timeout`) or returns a
    value that is not finite (NaN, inf, -inf) marks it FAILED. A dict reward is kept in
    `sample.reward_dict` and its `--reward-key` entry becomes `sample.reward`. Several rewards
    (`RewardMix`, `--reward-functions`): each one's value is in `sample.reward_dict` under its
    name, their weighted sum is `sample.reward`, and any one failing fails the sample."""
    try:
        with sample_span(sample, "reward"):
            value = await asyncio.wait_for(reward(args, sample), timeout=reward.time_limit(args.rm_timeout))
    except Exception as e:  # counted in rollout/reward_failures and excluded from the loss
        return _failed(sample, e)
    return _set_reward(sample, value, args.reward_key, reward)


async def score_group(reward: RewardFunction, args, samples: list[Sample]) -> list[Sample]:
    """Reward a whole group with one call (`--group-rm`); it must return one value per sample. A
    call that fails marks every sample of the group FAILED; a value that is not finite marks its own
    sample only."""
    start = time.time()
    try:
        values = await asyncio.wait_for(reward(args, samples), timeout=reward.time_limit(args.rm_timeout))
        values = list(values)
        if len(values) != len(samples):
            raise ValueError(f"the group reward returned {len(values)} values for {len(samples)} samples")
    except SlimeConfigError:
        raise
    except Exception as e:
        return [_failed(s, e) for s in _group_reward_spans(samples, start)]
    return [_set_reward(s, v, args.reward_key) for s, v in zip(_group_reward_spans(samples, start), values)]


def _group_reward_spans(samples: list[Sample], start: float) -> list[Sample]:
    end = time.time()
    for s in samples:
        add_span(s, "reward", start, end, name="group")
    return samples


def _set_reward(sample: Sample, value, reward_key: str | None, reward=None) -> Sample:
    if isinstance(reward, RewardMix):
        value, sample.reward_dict = reward.resolve(value, reward_key)
    else:
        value, sample.reward_dict = scalar_reward(value, reward_key)
    try:
        value = float(value)
        if not math.isfinite(value):  # NaN, or +-inf: one would turn its group's advantages into NaN
            raise ValueError(f"reward is {value}")
    except Exception as e:
        return _failed(sample, e)
    sample.reward = value
    return sample


def _failed(sample: Sample, e: Exception) -> Sample:
    logger.warning("reward failed for sample %d (label %r): %r", sample.index, sample.label, e)
    sample.reward = None
    sample.status = SampleStatus.FAILED
    return sample
