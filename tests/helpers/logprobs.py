"""Reference log-probs of a Hugging Face model for the engine-vs-model tests."""

from __future__ import annotations

import torch


def teacher_forced(model, prompt: list[int], output: list[int]) -> list[float]:
    """The fp32 log-probs `model` gives each token of `output` after `prompt` (teacher forcing)."""
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([prompt + output])).logits[0].float(), -1)
    return [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(output)]


def max_diff(a, b) -> float:
    """The largest |a_i - b_i| of two equally long sequences."""
    return max(abs(x - y) for x, y in zip(a, b, strict=True))
