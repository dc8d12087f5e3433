"""What a rollout and an evaluation report: rewards, lengths, staleness, pass@k."""

from __future__ import annotations

import math
import statistics

from slime.rollout.train_data import overlong
from slime.types import Sample, SampleStatus


def rollout_metrics(args, samples: list[Sample], generated: list[Sample], elapsed: float,
                    sample_filter: bool) -> dict[str, float]:
    """The batch's rewards, lengths and filters; tokens/s over everything generated in `elapsed` s."""
    scored = [s.reward for s in samples if s.reward is not None]
    lengths = [s.response_length for s in samples]
    groups: dict[int, list[float]] = {}
    for s in samples:
        if s.reward is not None:
            groups.setdefault(s.group_index, []).append(s.reward)
    metrics = {
        "rollout/raw_reward": statistics.fmean(scored) if scored else 0.0,
        "rollout/response_len/mean": statistics.fmean(lengths),
        "rollout/response_len/max": float(max(lengths)),
        "rollout/response_len/min": float(min(lengths)),
        "rollout/truncated_ratio": sum(s.status == SampleStatus.TRUNCATED for s in samples) / len(samples),
        "rollout/zero_std_group_ratio": sum(len(set(g)) == 1 for g in groups.values()) / max(len(groups), 1),
        "rollout/reward_failures": float(len(samples) - len(scored)),
    }
    entries: dict[str, list[float]] = {}  # dict rewards (--reward-key): every numeric entry's mean
    for s in samples:
        for k, v in (s.reward_dict or {}).items():
            if isinstance(v, (int, float)):
                entries.setdefault(k, []).append(float(v))
    metrics.update({f"rollout/reward/{k}": statistics.fmean(v) for k, v in entries.items()})
    if args.overlong_buffer_len > 0:
        metrics["rollout/overlong_penalty"] = statistics.fmean(overlong(args, samples).tolist())
    if args.mask_truncated_samples:
        metrics["rollout/overlong_filtered"] = float(sum(s.status == SampleStatus.TRUNCATED for s in samples))
    if sample_filter:
        metrics["rollout/removed_samples"] = float(sum(s.remove_sample for s in samples))
    metrics["perf/rollout_time"] = elapsed
    metrics["perf/rollout_tokens_per_s"] = sum(s.response_length for s in generated) / max(elapsed, 1e-9)
    return metrics


def staleness_metrics(samples: list[Sample], rollout_id: int, counts: dict[str, int]) -> dict[str, float]:
    """How many policy versions each sample's oldest token lags the policy that trains on it
    (policy version = rollouts trained = rollout_id): mean, max, and the count per value; and the
    run's totals of `--max-staleness` regenerations and drops."""
    lags = [s.staleness(rollout_id) for s in samples]
    metrics = {"rollout/staleness/mean": statistics.fmean(lags), "rollout/staleness/max": float(max(lags))}
    for lag in sorted(set(lags)):
        metrics[f"rollout/staleness/count_{lag}"] = float(lags.count(lag))
    metrics["rollout/stale_regenerated_samples_total"] = float(counts["regenerated_samples"])
    metrics["rollout/stale_dropped_groups_total"] = float(counts["dropped_groups"])
    return metrics


def sft_metrics(samples: list[Sample]) -> dict[str, float]:
    return {
        "rollout/sequence_len/mean": statistics.fmean(len(s.tokens) for s in samples),
        "rollout/response_len/mean": statistics.fmean(s.response_length for s in samples),
        "rollout/loss_tokens/mean": statistics.fmean(sum(s.loss_mask) for s in samples),
    }


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with c passing samples out of n (Chen et al., 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def eval_metrics(name: str, groups: list[list[Sample]], n: int) -> dict[str, float]:
    """One eval set: `eval/<name>` (mean reward), `eval/<name>/pass@k` for k = 1, 2, 4, ... up to
    `n` samples per prompt (a sample passes when its reward is > 0), response length, truncation
    ratio and reward failures."""
    samples = [s for g in groups for s in g]
    metrics = {f"eval/{name}": statistics.fmean(s.reward if s.reward is not None else 0.0 for s in samples)}
    k = 1
    while k <= n:
        metrics[f"eval/{name}/pass@{k}"] = statistics.fmean(
            pass_at_k(len(g), sum(s.reward is not None and s.reward > 0 for s in g), k) for g in groups)
        k *= 2
    metrics[f"eval/{name}/response_len/mean"] = statistics.fmean(s.response_length for s in samples)
    metrics[f"eval/{name}/truncated_ratio"] = statistics.fmean(s.status == SampleStatus.TRUNCATED for s in samples)
    metrics[f"eval/{name}/reward_failures"] = float(sum(s.reward is None for s in samples))
    return metrics
