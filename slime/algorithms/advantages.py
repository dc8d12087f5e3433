"""Advantage estimators and reward post-processing: pure tensor functions, looked up by name.

Every estimator in `ADVANTAGE_ESTIMATORS` has the signature

    estimator(rewards: Tensor[N], response_lengths: list[int], *, loss_masks: list[Tensor[L_i]],
              kl: list[Tensor[L_i]] | None, values: list[Tensor[L_i]] | None,
              kl_coef: float, gamma: float, lambd: float) -> list[Tensor[L_i]]

where `rewards[i]` is sample i's scalar training reward (already post-processed by
`post_process_rewards`: group-normalized for GRPO-style estimators), `kl[i]` the
per-token KL(old policy || reference) used for KL-in-reward (`--kl-coef`), `values[i]`
the critic's per-token values (PPO only), and the result holds one per-token
advantage tensor of length `L_i = response_lengths[i]` per sample. Estimators accept
and ignore the keyword arguments they do not use, so the trainer calls all of them
the same way. Returns (the critic's regression targets) are `advantages + values`.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor


def group_normalize(
    rewards: Tensor,
    group_ids: Tensor | Sequence[int],
    std_normalize: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """Normalize rewards within groups of samples that share a group id.

    rewards:   Tensor[N] (float)
    group_ids: Tensor[N] or list of N ints; samples with equal ids form a group,
               wherever they sit in the batch (never grouped by position).
    returns:   Tensor[N] float32: `r - mean(group)`, divided by `std(group) + eps`
               when `std_normalize`. The std is torch's default (unbiased, N-1), as in
               the original slime; a group of one sample has std 0 (not NaN).
    """
    r = torch.as_tensor(rewards, dtype=torch.float32).flatten()
    ids = torch.as_tensor(list(group_ids) if not isinstance(group_ids, Tensor) else group_ids).flatten()
    if ids.numel() != r.numel():
        raise ValueError(f"group_normalize: {r.numel()} rewards but {ids.numel()} group ids")
    if r.numel() == 0:
        return r.clone()
    _, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
    g = counts.numel()
    sums = torch.zeros(g, dtype=torch.float32).index_add_(0, inverse, r)
    mean = sums / counts
    centered = r - mean[inverse]
    if not std_normalize:
        return centered
    sq = torch.zeros(g, dtype=torch.float32).index_add_(0, inverse, centered * centered)
    denom = (counts - 1).clamp(min=1).to(torch.float32)
    std = torch.where(counts > 1, (sq / denom).sqrt(), torch.zeros_like(sq))
    return centered / (std[inverse] + eps)


def leave_one_out(rewards: Tensor, group_ids: Tensor | Sequence[int]) -> Tensor:
    """RLOO (arXiv 2402.14740): each reward minus the mean of the *other* rewards of its group.

    rewards: Tensor[N]; group_ids: N ids (groups by id, never by position)
    returns Tensor[N] float32: r_i - (sum_group - r_i) / (n_group - 1) = n/(n-1) * (r_i - mean_group);
    0 for a group of one sample (no baseline, no signal).
    """
    r = torch.as_tensor(rewards, dtype=torch.float32).flatten()
    ids = torch.as_tensor(list(group_ids) if not isinstance(group_ids, Tensor) else group_ids).flatten()
    if ids.numel() != r.numel():
        raise ValueError(f"leave_one_out: {r.numel()} rewards but {ids.numel()} group ids")
    if r.numel() == 0:
        return r.clone()
    _, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
    sums = torch.zeros(counts.numel(), dtype=torch.float32).index_add_(0, inverse, r)
    n = counts[inverse].to(torch.float32)
    baseline = (sums[inverse] - r) / (n - 1).clamp(min=1.0)
    return torch.where(n > 1, r - baseline, torch.zeros_like(r))


def grpo(rewards: Tensor, response_lengths: Sequence[int], **_: object) -> list[Tensor]:
    """GRPO (also GSPO, CISPO and RLOO): each response token's advantage is its sample's reward.

    rewards:          Tensor[N] (group-normalized upstream)
    response_lengths: N ints
    returns:          list of N Tensor[L_i] (float32), advantages[i][t] = rewards[i]
    """
    r = _rewards(rewards, response_lengths, "grpo")
    return [torch.full((int(n),), float(r[i]), dtype=torch.float32) for i, n in enumerate(response_lengths)]


def _rewards(rewards, response_lengths, name: str) -> Tensor:
    r = torch.as_tensor(rewards, dtype=torch.float32).flatten()
    if r.numel() != len(response_lengths):
        raise ValueError(f"{name}: {r.numel()} rewards but {len(response_lengths)} responses")
    return r


def _kl_or_zeros(kl, response_lengths) -> list[Tensor]:
    if kl is None:
        return [torch.zeros(int(n), dtype=torch.float32) for n in response_lengths]
    return [torch.as_tensor(k, dtype=torch.float32) for k in kl]


def discounted_returns(token_rewards: Sequence[Tensor], gamma: float) -> list[Tensor]:
    """G_t = r_t + gamma * G_{t+1} per sequence.

    token_rewards: list of N Tensor[L_i]  ->  list of N Tensor[L_i] (float32)
    """
    out = []
    for r in token_rewards:
        r = torch.as_tensor(r, dtype=torch.float32)
        g = torch.zeros_like(r)
        acc = torch.zeros((), dtype=torch.float32)
        for t in range(r.numel() - 1, -1, -1):
            acc = r[t] + gamma * acc
            g[t] = acc
        out.append(g)
    return out


def reinforce_plus_plus(
    rewards: Tensor, response_lengths: Sequence[int], *, loss_masks: Sequence[Tensor] | None = None,
    kl: Sequence[Tensor] | None = None, kl_coef: float = 0.0, gamma: float = 1.0, **_: object,
) -> list[Tensor]:
    """REINFORCE++ (arXiv 2501.03262): discounted return of KL-shaped token rewards.

    Token reward r_t = -kl_coef * kl_t * mask_t, plus the scalar reward on the last
    loss-mask token (the last token when the mask is empty); advantage_t = sum_{s>=t}
    gamma^(s-t) r_s. Shapes as in the module docstring. Whitening across the batch is
    `--normalize-advantages` (recommended with this estimator).
    """
    r = _rewards(rewards, response_lengths, "reinforce_plus_plus")
    kls = _kl_or_zeros(kl, response_lengths)
    token_rewards = []
    for i, n in enumerate(response_lengths):
        n = int(n)
        mask = torch.ones(n) if loss_masks is None else torch.as_tensor(loss_masks[i], dtype=torch.float32)
        tr = -kl_coef * kls[i] * mask
        if n:
            nz = mask.nonzero()
            last = int(nz[-1]) if nz.numel() else n - 1
            tr[last] += r[i]
        token_rewards.append(tr)
    return discounted_returns(token_rewards, gamma)


def reinforce_plus_plus_baseline(
    rewards: Tensor, response_lengths: Sequence[int], *, kl: Sequence[Tensor] | None = None,
    kl_coef: float = 0.0, **_: object,
) -> list[Tensor]:
    """REINFORCE++-baseline: advantage_t = (r - group mean) - kl_coef * kl_t.

    `rewards` arrive with the group mean already subtracted (`post_process_rewards`).
    """
    r = _rewards(rewards, response_lengths, "reinforce_plus_plus_baseline")
    kls = _kl_or_zeros(kl, response_lengths)
    return [float(r[i]) - kl_coef * kls[i] for i in range(len(response_lengths))]


def gae(
    token_rewards: Sequence[Tensor], values: Sequence[Tensor], gamma: float, lambd: float
) -> tuple[list[Tensor], list[Tensor]]:
    """Generalized advantage estimation per sequence (the value after the last token is 0).

    token_rewards, values: list of N Tensor[L_i]
    returns (advantages, returns), each a list of N Tensor[L_i] float32:
        delta_t = r_t + gamma * V_{t+1} - V_t;  A_t = delta_t + gamma * lambd * A_{t+1};  R_t = A_t + V_t
    """
    advs, rets = [], []
    for r, v in zip(token_rewards, values):
        r = torch.as_tensor(r, dtype=torch.float32)
        v = torch.as_tensor(v, dtype=torch.float32)
        if r.shape != v.shape:
            raise ValueError(f"gae: rewards {tuple(r.shape)} vs values {tuple(v.shape)}")
        a = torch.zeros_like(r)
        last = torch.zeros((), dtype=torch.float32)
        for t in range(r.numel() - 1, -1, -1):
            next_v = v[t + 1] if t + 1 < r.numel() else 0.0
            delta = r[t] + gamma * next_v - v[t]
            last = delta + gamma * lambd * last
            a[t] = last
        advs.append(a)
        rets.append(a + v)
    return advs, rets


def ppo(
    rewards: Tensor, response_lengths: Sequence[int], *, values: Sequence[Tensor] | None = None,
    kl: Sequence[Tensor] | None = None, kl_coef: float = 0.0, gamma: float = 1.0, lambd: float = 1.0,
    **_: object,
) -> list[Tensor]:
    """PPO: GAE over token rewards -kl_coef * kl_t, with the scalar reward added on the last token.

    values: the critic's per-token values (required). Returns the advantages; the critic's
    targets are `advantages + values`.
    """
    if values is None:
        raise ValueError("ppo: the advantage estimator needs critic values")
    r = _rewards(rewards, response_lengths, "ppo")
    kls = _kl_or_zeros(kl, response_lengths)
    token_rewards = []
    for i, n in enumerate(response_lengths):
        tr = -kl_coef * kls[i]
        if int(n):
            tr[-1] += r[i]
        token_rewards.append(tr)
    return gae(token_rewards, values, gamma, lambd)[0]


ADVANTAGE_ESTIMATORS: dict[str, Callable[..., list[Tensor]]] = {
    "grpo": grpo,
    "gspo": grpo,
    "cispo": grpo,
    "reinforce_plus_plus": reinforce_plus_plus,
    "reinforce_plus_plus_baseline": reinforce_plus_plus_baseline,
    "rloo": grpo,
    "ppo": ppo,
}

# How `post_process_rewards` prepares each estimator's rewards (original slime's rule):
# "mean_std": subtract the group mean, divide by the group std; "mean": subtract the mean only;
# "leave_one_out": subtract the mean of the group's other rewards (RLOO); None: raw.
REWARD_NORMALIZATION: dict[str, str | None] = {
    "grpo": "mean_std",
    "gspo": "mean_std",
    "cispo": "mean_std",
    "rloo": "leave_one_out",
    "reinforce_plus_plus_baseline": "mean",
    "reinforce_plus_plus": None,
    "ppo": None,
}


# ---------------------------------------------------------------- reward post-processing


def post_process_rewards(
    rewards: Tensor | Sequence[float],
    group_ids: Sequence[int],
    estimator: str,
    rewards_normalization: bool = True,
    std_normalization: bool = True,
) -> Tensor:
    """Training rewards from scores, per estimator (`REWARD_NORMALIZATION`).

    rewards: Tensor[N]; group_ids: N ints. `rewards_normalization=False`
    (`--disable-rewards-normalization`) returns them unchanged; `std_normalization=False`
    (`--disable-grpo-std-normalization`, Dr. GRPO) only centers GRPO-style groups.
    returns Tensor[N] float32.
    """
    r = torch.as_tensor(rewards, dtype=torch.float32).flatten()
    mode = REWARD_NORMALIZATION.get(estimator, "mean_std")
    if not rewards_normalization or mode is None:
        return r.clone()
    if mode == "leave_one_out":
        return leave_one_out(r, group_ids)
    return group_normalize(r, group_ids, std_normalize=(mode == "mean_std" and std_normalization))


def overlong_penalty(
    response_lengths: Sequence[int], max_response_len: int, buffer_len: int, penalty_factor: float
) -> Tensor:
    """DAPO's soft overlong punishment, added to the reward.

    0 while L <= max_response_len - buffer_len, then falling linearly to -penalty_factor at
    L = max_response_len: penalty = min(0, (max_response_len - buffer_len - L) / buffer_len) * factor.
    response_lengths: N ints -> Tensor[N] float32 (<= 0)
    """
    lengths = torch.as_tensor(list(response_lengths), dtype=torch.float32)
    if buffer_len <= 0:
        return torch.zeros_like(lengths)
    expected = max_response_len - buffer_len
    return ((expected - lengths) / buffer_len).clamp(max=0.0) * penalty_factor


# ---------------------------------------------------------------- whitening


def whiten_stats(advantages: Sequence[Tensor], masks: Sequence[Tensor]) -> Tensor:
    """[sum(A*m), sum(A^2*m), sum(m)] over the given samples (float64): sum these across ranks,
    then call `whiten` with the totals, so whitening is independent of the data-parallel layout."""
    if not advantages:
        return torch.zeros(3, dtype=torch.float64)
    a = torch.cat([torch.as_tensor(x, dtype=torch.float64) for x in advantages])
    m = torch.cat([torch.as_tensor(x, dtype=torch.float64) for x in masks])
    return torch.stack([(a * m).sum(), (a * a * m).sum(), m.sum()])


def whiten(advantages: Sequence[Tensor], stats: Tensor, eps: float = 1e-8) -> list[Tensor]:
    """(A - mean) / sqrt(var + eps) with masked batch statistics `stats` from `whiten_stats`
    (summed over every rank). The variance is unbiased (n - 1), as in verl's masked_whiten.

    advantages: list of N Tensor[L_i] -> list of N Tensor[L_i] float32
    """
    s, sq, n = (float(x) for x in stats)
    if n <= 0:
        return [torch.as_tensor(a, dtype=torch.float32).clone() for a in advantages]
    mean = s / n
    var = max(sq / n - mean * mean, 0.0)
    if n > 1:
        var = var * n / (n - 1)
    scale = 1.0 / (var + eps) ** 0.5
    return [(torch.as_tensor(a, dtype=torch.float32) - mean) * scale for a in advantages]
