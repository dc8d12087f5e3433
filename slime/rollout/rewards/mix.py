"""Several rewards (`--reward-functions A B ... --reward-weights wA wB ...`).

Every listed reward scores each sample (concurrently); `sample.reward_dict` holds each one's raw
value under its name (logged as `rollout/reward/<name>`) and `sample.reward` is their weighted sum.
Any component that raises, times out, or gives something that is not a finite number marks the
sample FAILED, as one failing reward does.

`--reward-aggregation gdpo` trains on GDPO's decoupled normalization instead (Liu et al., 2026,
"GDPO: Group reward-Decoupled Normalization Policy Optimization for Multi-reward RL
Optimization", arXiv:2601.05242; as in NVlabs/GDPO's TRL trainer): within each group every reward
is normalized on its own, A_k = (r_k - mean_group(r_k)) / (std_group(r_k) + eps); the weighted sum
A = sum_k w_k A_k is then normalized over the batch, (A - mean_batch(A)) / (std_batch(A) + eps).
This replaces the estimator's group normalization of the summed reward, which would collapse
distinct reward combinations to the same advantage. std is unbiased (N-1, torch's and the
reference's default; a group of one has std 0), eps = 1e-4 as in the reference; a reward that is
constant within a group contributes 0 there.

This module imports nothing from `slime.rollout.rewards` (that package imports it), so the
components are given to `RewardMix` already built.
"""

from __future__ import annotations

import asyncio
import math
import statistics
from typing import Sequence

from slime.types import Sample, SampleStatus
from slime.utils.errors import SlimeConfigError

GDPO_EPS = 1e-4


def _component_value(name: str, out, reward_key: str | None):
    """The scalar of one component's output and its other dict entries (`name/entry`)."""
    if not isinstance(out, dict):
        return out, {}
    if reward_key is None:
        raise SlimeConfigError(f"--reward-functions: {name} returned a dict (keys {sorted(out)}); "
                               "pass --reward-key KEY to say which entry is its reward")
    if reward_key not in out:
        raise SlimeConfigError(f"--reward-key {reward_key!r}: --reward-functions {name} returned a dict "
                               f"without it (keys {sorted(out)})")
    return out[reward_key], {f"{name}/{k}": v for k, v in out.items() if k != reward_key}


class RewardMix:
    """Several rewards called as one: `await mix(args, sample)` -> {name: what it returned};
    `resolve` turns that into (weighted sum, reward_dict). Called like `RewardFunction`
    (per sample; `group` is False)."""

    group = False

    def __init__(self, components: Sequence[tuple[str, object]], weights: Sequence[float] | None = None):
        self.names = [n for n, _ in components]
        self.components = [fn for _, fn in components]
        self.weights = [float(w) for w in weights] if weights else [1.0] * len(self.names)
        if len(set(self.names)) != len(self.names) or len(self.weights) != len(self.names):
            raise ValueError(f"RewardMix: names {self.names} must be distinct, one weight each")
        self.name = "+".join(self.names)

    def time_limit(self, rm_timeout: float) -> float:
        """The components run concurrently: the bound of the slowest."""
        return max(c.time_limit(rm_timeout) for c in self.components)

    async def __call__(self, args, sample: Sample) -> dict:
        outs = await asyncio.gather(*(c(args, sample) for c in self.components))
        return dict(zip(self.names, outs))

    def resolve(self, outs: dict, reward_key: str | None):
        """(the weighted sum, {name: raw value, name/entry: other dict entries}). A dict without
        `--reward-key` raises SlimeConfigError; a component that is not a finite number makes the
        sum NaN (or unconvertible), which fails the sample, and is left out of the dict."""
        reward_dict, total = {}, 0.0
        for name, w in zip(self.names, self.weights):
            value, extra = _component_value(name, outs[name], reward_key)
            reward_dict.update(extra)
            try:
                value = float(value)
            except (TypeError, ValueError):
                return value, reward_dict  # float() of it fails again in _set_reward: FAILED
            if not math.isfinite(value):
                total = math.nan
                continue
            reward_dict[name] = value
            total += w * value
        return total, reward_dict


def _group_normalized(values: list[float], ids: list[int]) -> list[float]:
    """(r - mean_group) / (std_group + eps) of one reward; 0 where the group's values are all equal."""
    groups: dict[int, list[int]] = {}
    for j, g in enumerate(ids):
        groups.setdefault(g, []).append(j)
    out = [0.0] * len(values)
    for members in groups.values():
        r = [values[j] for j in members]
        if max(r) == min(r):  # a constant reward (or a group of one) carries no signal here
            continue
        mean, std = statistics.fmean(r), statistics.stdev(r)
        for j, v in zip(members, r):
            out[j] = (v - mean) / (std + GDPO_EPS)
    return out


def gdpo_rewards(samples: list[Sample], names: Sequence[str], weights: Sequence[float]) -> list[float]:
    """GDPO training rewards of a rollout (module docstring): per-reward group normalization
    (groups by `group_index`), weighted sum, batch normalization, over the samples that did not
    fail; a failed sample gets 0."""
    valid = [i for i, s in enumerate(samples) if s.status != SampleStatus.FAILED]
    rewards = [0.0] * len(samples)
    if not valid:
        return rewards
    ids = [samples[i].group_index for i in valid]
    missing = next(((samples[i].index, n) for i in valid for n in names if n not in (samples[i].reward_dict or {})),
                   None)
    if missing:
        raise ValueError(f"--reward-aggregation gdpo: sample {missing[0]} has no reward {missing[1]!r} in its "
                         "reward_dict (was it scored by --reward-functions?)")
    total = [0.0] * len(valid)
    for name, w in zip(names, weights):
        normalized = _group_normalized([float(samples[i].reward_dict[name]) for i in valid], ids)
        total = [t + w * a for t, a in zip(total, normalized)]
    mean = statistics.fmean(total)
    std = statistics.stdev(total) if len(total) > 1 else 0.0
    for i, a in zip(valid, total):
        rewards[i] = (a - mean) / (std + GDPO_EPS)
    return rewards
