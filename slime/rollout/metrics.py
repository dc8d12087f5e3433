"""What a rollout and an evaluation report: rewards, lengths, staleness, pass@k."""

from __future__ import annotations

import math
import statistics

from slime.rollout.train_data import overlong
from slime.types import Sample, SampleStatus


def rollout_metrics(args, samples: list[Sample], generated: list[Sample], elapsed: float,
                    sample_filter: bool) -> dict[str, float]:
    """The batch's rewards, lengths (`length_metrics`), pass@k over its groups (`pass_at_k_metrics`) and
    filters; tokens/s over everything generated in `elapsed` s."""
    scored = [s.reward for s in samples if s.reward is not None]
    groups: dict[int, list[float]] = {}
    for s in samples:
        if s.reward is not None:
            groups.setdefault(s.group_index, []).append(s.reward)
    metrics = {
        "rollout/raw_reward": statistics.fmean(scored) if scored else 0.0,
        **length_metrics("rollout/response_len", samples),
        **pass_at_k_metrics("rollout", by_group(samples)),
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


def length_metrics(prefix: str, samples: list[Sample]) -> dict[str, float]:
    """Response lengths in tokens: `<prefix>/mean`, `/max`, `/min`, `/std`, `/p50`, `/p90`, and the mean
    length of the samples that passed (reward > 0) and of those that did not (`/pass_mean`, `/fail_mean`;
    a key is left out when no sample is in it)."""
    lengths = sorted(s.response_length for s in samples)
    out = {f"{prefix}/mean": statistics.fmean(lengths), f"{prefix}/max": float(lengths[-1]),
           f"{prefix}/min": float(lengths[0]), f"{prefix}/std": statistics.pstdev(lengths),
           f"{prefix}/p50": _quantile(lengths, 0.5), f"{prefix}/p90": _quantile(lengths, 0.9)}
    passed = [s.response_length for s in samples if s.reward is not None and s.reward > 0]
    failed = [s.response_length for s in samples if not (s.reward is not None and s.reward > 0)]
    if passed:
        out[f"{prefix}/pass_mean"] = statistics.fmean(passed)
    if failed:
        out[f"{prefix}/fail_mean"] = statistics.fmean(failed)
    return out


def _quantile(ordered: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks of an ascending list."""
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return float(ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo))


def by_group(samples: list[Sample]) -> list[list[Sample]]:
    groups: dict[int, list[Sample]] = {}
    for s in samples:
        groups.setdefault(s.group_index, []).append(s)
    return list(groups.values())


def pass_at_k_metrics(prefix: str, groups: list[list[Sample]], max_k: int | None = None) -> dict[str, float]:
    """`<prefix>/pass@k` for k = 1, 2, 4, ... up to the smallest group's size (and `max_k`): the unbiased estimate
    (`pass_at_k`) averaged over the groups (the samples of one prompt); a sample passes when its
    reward is > 0."""
    if not groups:
        return {}
    n = min(min(len(g) for g in groups), max_k or 1 << 30)
    out, k = {}, 1
    while k <= n:
        out[f"{prefix}/pass@{k}"] = statistics.fmean(
            pass_at_k(len(g), sum(s.reward is not None and s.reward > 0 for s in g), k) for g in groups)
        k *= 2
    return out


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
    metrics.update(pass_at_k_metrics(f"eval/{name}", [g for g in groups if g], max_k=n))
    metrics.update(length_metrics(f"eval/{name}/response_len", samples))
    metrics[f"eval/{name}/truncated_ratio"] = statistics.fmean(s.status == SampleStatus.TRUNCATED for s in samples)
    metrics[f"eval/{name}/reward_failures"] = float(sum(s.reward is None for s in samples))
    return metrics
