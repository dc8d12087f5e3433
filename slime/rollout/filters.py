"""Dynamic sampling filters (DAPO): keep or drop the samples of one prompt.

A filter is any function `filter(args, samples: list[Sample]) -> bool | DynamicFilterOutput`
given by `--dynamic-sampling-filter-path`; `samples` are the `n_samples_per_prompt`
scored samples of one prompt. The rollout manager launches `--over-sampling-batch-size`
prompts per round and keeps launching rounds until `--rollout-batch-size` groups are
kept (at most `--dynamic-sampling-max-rounds` rounds; then rejected groups fill the
rest, counted in `rollout/dynamic_filter/fallback_groups`).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from slime.types import Sample, SampleStatus


@dataclass
class DynamicFilterOutput:
    keep: bool
    reason: str | None = None  # counted as rollout/dynamic_filter/drop_<reason> when dropped


def as_filter_output(value) -> DynamicFilterOutput:
    """A filter's return value (bool or DynamicFilterOutput) as a DynamicFilterOutput."""
    if isinstance(value, DynamicFilterOutput):
        return value
    return DynamicFilterOutput(keep=bool(value))


def check_reward_nonzero_std(args, samples: list[Sample], **_) -> DynamicFilterOutput:
    """Keep a group unless all its rewards are equal (all right or all wrong: no GRPO signal).
    Samples whose reward failed do not count."""
    rewards = [float(s.reward) for s in samples if s.reward is not None and s.status != SampleStatus.FAILED]
    keep = len(rewards) > 1 and statistics.pstdev(rewards) > 1e-6
    return DynamicFilterOutput(keep=keep, reason=None if keep else "zero_std")
