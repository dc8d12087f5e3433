"""Default generation: one sample -> one `/generate` call -> reward.

Token ids go in and out (never re-tokenized), so the response tokens, their
rollout log-probs and the loss mask line up with what the engine produced.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging

from slime.engines.router import EnginePool
from slime.types import Sample, SampleStatus
from slime.utils.errors import SlimeConfigError

logger = logging.getLogger(__name__)

REWARD_TIMEOUT_S = 60.0


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


async def generate(engines: EnginePool, sample: Sample, params: dict) -> Sample:
    """Continue `sample.tokens` (the prompt) with one engine call and fill in the response."""
    out = await engines.generate({"input_ids": sample.tokens, "sampling_params": params, "return_logprob": True})
    meta = out["meta_info"]
    output_ids = list(out["output_ids"])
    sample.tokens = sample.tokens + output_ids
    sample.response = out["text"]
    sample.response_length = len(output_ids)
    sample.loss_mask = [1] * len(output_ids)
    sample.rollout_log_probs = [float(lp[0]) for lp in meta.get("output_token_logprobs", [])]
    if len(sample.rollout_log_probs) != len(output_ids):
        raise RuntimeError(
            f"engine returned {len(sample.rollout_log_probs)} log-probs for {len(output_ids)} tokens"
        )
    finish = meta["finish_reason"]["type"]
    sample.status = {"length": SampleStatus.TRUNCATED, "abort": SampleStatus.ABORTED}.get(
        finish, SampleStatus.COMPLETED
    )
    version = meta.get("weight_version")
    sample.weight_version = int(version) if version is not None and str(version).isdigit() else None
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


async def score(reward_fn, sample: Sample, reward_key: str | None = None) -> Sample:
    """Reward the sample; a reward function that raises, times out or returns NaN marks it FAILED.
    A dict reward is kept in `sample.reward_dict` and its `reward_key` entry becomes `sample.reward`."""
    try:
        reward = await asyncio.wait_for(
            asyncio.to_thread(reward_fn, sample.response, sample.label), timeout=REWARD_TIMEOUT_S
        )
    except Exception as e:  # counted in rollout/reward_failures and excluded from the loss
        return _failed(sample, e)
    reward, sample.reward_dict = scalar_reward(reward, reward_key)
    try:
        reward = float(reward)
        if reward != reward:
            raise ValueError("reward is NaN")
        sample.reward = reward
    except Exception as e:
        return _failed(sample, e)
    return sample


def _failed(sample: Sample, e: Exception) -> Sample:
    logger.warning("reward failed for sample %d (label %r): %r", sample.index, sample.label, e)
    sample.reward = None
    sample.status = SampleStatus.FAILED
    return sample


async def generate_and_rm(engines: EnginePool, sample: Sample, params: dict, reward_fn,
                          reward_key: str | None = None) -> Sample:
    sample = await generate(engines, sample, params)
    return await score(reward_fn, sample, reward_key)
