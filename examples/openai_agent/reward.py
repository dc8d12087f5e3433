"""Reward of the OpenAI-agent example: is the first number of the agent's final reply the label?

The final reply is what the agent returned (`metadata["agent_result"]`, the same in every Sample of
an episode). Returns a dict for `--reward-key score`: `score` = `correct`, plus `calls` (model calls in
this Sample) and `segments` (Samples the episode became; 1 when every prompt extended the last),
logged as `rollout/reward/<key>`.
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def reward(args, sample) -> dict:
    m = _NUMBER.search(str(sample.metadata.get("agent_result") or ""))
    try:
        correct = float(m is not None and abs(float(m.group(0)) - float(sample.label)) < 1e-6)
    except (TypeError, ValueError):
        correct = 0.0
    return {"score": correct, "correct": correct, "calls": float(sample.metadata.get("calls", 0)),
            "segments": float(sample.metadata.get("segments", 1))}
