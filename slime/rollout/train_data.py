"""A rollout's Samples -> the trainer's `RolloutBatch`.

Training rewards: the user's `--custom-reward-post-process-path`, or (reward + DAPO overlong
penalty) normalized per the estimator over the samples whose reward did not fail (failed ones get
0); with `--reward-aggregation gdpo`, GDPO's per-reward group normalization instead
(`slime.rollout.rewards.mix`). Loss masks: a sample whose reward failed trains on nothing; nor does one a
`--rollout-sample-filter-path` function removed, nor, with `--mask-truncated-samples`, one cut off
at the length limit. With a served OPD teacher (`--opd-type sglang`) the batch carries each sample's
`teacher_log_probs` (slime.rollout.teacher). SFT batches carry the conversations' masks and no rewards.
"""

from __future__ import annotations

from typing import Callable

import torch

from slime.algorithms.advantages import overlong_penalty, post_process_rewards
from slime.rollout.rewards.mix import gdpo_rewards
from slime.types import RolloutBatch, Sample, SampleStatus
from slime.utils.reward_names import reward_name
from slime.utils.vision import inline_source


def fit_batch(args, samples: list[Sample], metrics: dict[str, float]) -> list[Sample]:
    """The trainer takes exactly rollout_batch_size * n_samples_per_prompt samples. A custom
    generate function that returns several samples per call makes more: the extra ones at the
    end are dropped (counted in rollout/dropped_samples); fewer is an error."""
    want = args.rollout_batch_size * args.n_samples_per_prompt
    if len(samples) < want:
        raise ValueError(f"the rollout produced {len(samples)} samples, fewer than rollout_batch_size * "
                         f"n_samples_per_prompt = {want}")
    if len(samples) > want:
        metrics["rollout/dropped_samples"] = float(len(samples) - want)
    return samples[:want]


def overlong(args, samples: list[Sample]) -> torch.Tensor:
    """DAPO's soft overlong penalty of each sample (`--overlong-buffer-len`)."""
    return overlong_penalty([s.response_length for s in samples], args.rollout_max_response_len,
                            args.overlong_buffer_len, args.overlong_penalty_factor)


def train_rewards(args, samples: list[Sample], post_process: Callable | None) -> list[float]:
    if post_process is not None:
        rewards = [float(r) for r in post_process(args, samples)]
        if len(rewards) != len(samples):
            raise ValueError(f"--custom-reward-post-process-path returned {len(rewards)} rewards "
                             f"for {len(samples)} samples")
        return rewards
    if getattr(args, "reward_aggregation", "sum") == "gdpo":  # several rewards, each normalized in its group
        return gdpo_rewards(samples, [reward_name(e) for e in args.reward_functions], args.reward_weights)
    valid = [i for i, s in enumerate(samples) if s.status != SampleStatus.FAILED]
    rewards = [0.0] * len(samples)
    if valid:
        scores = torch.tensor([samples[i].reward for i in valid], dtype=torch.float32)
        if args.overlong_buffer_len > 0:
            scores = scores + overlong(args, [samples[i] for i in valid])
        normalized = post_process_rewards(
            scores, [samples[i].group_index for i in valid], args.advantage_estimator,
            args.rewards_normalization, args.grpo_std_normalization,
        )
        for i, r in zip(valid, normalized.tolist()):
            rewards[i] = r
    return rewards


def loss_mask(args, s: Sample) -> list[int]:
    if s.status == SampleStatus.FAILED or s.remove_sample or (
            args.mask_truncated_samples and s.status == SampleStatus.TRUNCATED):
        return [0] * s.response_length
    return s.loss_mask


def teacher_log_probs(samples: list[Sample], masks: list[list[int]]) -> list[list[float] | None]:
    """--opd-type sglang: every sample's served-teacher log-probs; a sample that trains on any token
    must have one per response token (a failed one trains on nothing and may have none)."""
    for i, (s, m) in enumerate(zip(samples, masks)):
        lps = s.teacher_log_probs
        if any(m) and (lps is None or len(lps) != s.response_length):
            raise ValueError(f"--opd-type sglang: sample {i} trains on its response but has "
                             f"{'no' if lps is None else len(lps)} teacher log-probs for {s.response_length} tokens; "
                             "a --rollout-function-path rollout scores them itself "
                             "(slime.rollout.teacher.score_teacher)")
    return [s.teacher_log_probs for s in samples]


def to_train_batch(args, samples: list[Sample], post_process: Callable | None) -> RolloutBatch:
    masks = [loss_mask(args, s) for s in samples]
    return RolloutBatch(
        tokens=[s.tokens for s in samples],
        response_lengths=[s.response_length for s in samples],
        loss_masks=masks,
        rewards=train_rewards(args, samples, post_process),
        raw_rewards=[s.reward if s.reward is not None else 0.0 for s in samples],
        rollout_log_probs=[s.rollout_log_probs for s in samples],
        group_indices=[s.group_index for s in samples],
        teacher_log_probs=teacher_log_probs(samples, masks) if args.opd_served else None,
        routed_experts=[s.rollout_routed_experts for s in samples] if args.use_rollout_routing_replay else None,
        # local files as their bytes: a train rank may run on another machine
        images=[[inline_source(x) for x in s.images] if s.images else s.images for s in samples]
        if any(s.images for s in samples) else None,
    )


def sft_batch(samples: list[Sample]) -> RolloutBatch:
    """`--loss-type sft_loss`: the conversations as they are, with no rewards."""
    n = len(samples)
    return RolloutBatch(
        tokens=[s.tokens for s in samples], response_lengths=[s.response_length for s in samples],
        loss_masks=[s.loss_mask for s in samples], rewards=[0.0] * n, raw_rewards=[0.0] * n,
        rollout_log_probs=[None] * n, group_indices=[s.group_index for s in samples],
    )
