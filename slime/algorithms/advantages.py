"""Advantage estimators: pure tensor functions, looked up by name.

Every estimator in `ADVANTAGE_ESTIMATORS` has the signature

    estimator(rewards: Tensor[N], response_lengths: list[int], **kwargs) -> list[Tensor[L_i]]

where `rewards[i]` is sample i's scalar reward (for GRPO-style estimators already
normalized within its group by `group_normalize`) and the result holds one
per-token advantage tensor of length `L_i = response_lengths[i]` per sample.
Unused keyword arguments (loss masks, values, ...) are accepted and ignored, so the
trainer calls every estimator the same way.
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


def grpo(rewards: Tensor, response_lengths: Sequence[int], **_: object) -> list[Tensor]:
    """GRPO: each response token's advantage is its sample's (group-normalized) reward.

    rewards:          Tensor[N]
    response_lengths: N ints
    returns:          list of N Tensor[L_i] (float32), advantages[i][t] = rewards[i]
    """
    r = torch.as_tensor(rewards, dtype=torch.float32).flatten()
    if r.numel() != len(response_lengths):
        raise ValueError(f"grpo: {r.numel()} rewards but {len(response_lengths)} responses")
    return [torch.full((int(n),), float(r[i]), dtype=torch.float32) for i, n in enumerate(response_lengths)]


ADVANTAGE_ESTIMATORS: dict[str, Callable[..., list[Tensor]]] = {
    "grpo": grpo,
}
