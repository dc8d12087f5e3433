"""Micro-batches under a token budget (`--use-dynamic-batch-size --max-tokens-per-gpu`)."""

from __future__ import annotations


def token_budget_micro_batches(lengths: list[int], budget: int, min_groups: int = 0) -> list[list[int]]:
    """Group item positions so that each group's token sum is <= `budget` (an item longer than
    the budget forms a group alone), in as few groups as first-fit decreasing finds; then, while
    there are fewer than `min_groups` groups, the group with the most tokens (and >= 2 items) is
    halved by tokens. Groups hold ascending positions and are ordered by their first position.
    Deterministic, so every call with the same lengths gives the same micro-batches."""
    if budget < 1:
        raise ValueError(f"token budget must be >= 1, got {budget}")
    if min_groups > len(lengths):
        raise ValueError(f"cannot make {min_groups} non-empty micro-batches of {len(lengths)} samples")
    groups: list[list[int]] = []
    sums: list[int] = []
    for j in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        k = next((k for k in range(len(groups)) if sums[k] + lengths[j] <= budget), None)
        if k is None:
            groups.append([])
            sums.append(0)
            k = len(groups) - 1
        groups[k].append(j)
        sums[k] += lengths[j]
    while len(groups) < min_groups:
        k = max((k for k in range(len(groups)) if len(groups[k]) > 1), key=lambda k: (sums[k], -k))
        halves: list[list[int]] = [[], []]
        loads = [0, 0]
        for j in groups[k]:  # already longest first
            h = 1 if halves[0] and not halves[1] else (0 if loads[0] <= loads[1] else 1)
            halves[h].append(j)
            loads[h] += lengths[j]
        groups[k:k + 1] = halves
        sums[k:k + 1] = loads
    return sorted((sorted(g) for g in groups), key=lambda g: g[0])
