"""Reward of the tool-use example: is the first number of the model's last turn the label?

The last turn counts as an answer only when it calls no tool (`metadata["answered"]`, set by generate.py).

Returns a dict (`--reward-key score`): `correct` (0/1), `tool_calls` (tool calls that returned a value)
and `score` = correct + `tool_bonus` (a --custom-config-path key, default 0) when at least one call
succeeded. The bonus is a format reward for models that do
not call tools yet (the tiny test model);
every numeric entry is logged as `rollout/reward/<key>`.
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def first_number(text: str) -> str | None:
    m = _NUMBER.search(text or "")
    return m.group(0) if m else None


def same_number(a: str | None, b) -> bool:
    try:
        return a is not None and abs(float(a) - float(b)) < 1e-6
    except (TypeError, ValueError):
        return False


def reward(args, sample) -> dict:
    answer = first_number(sample.metadata.get("last_turn", ""))
    # the episode may end on a tool call (--max-turns): that turn is no answer
    correct = float(bool(sample.metadata.get("answered")) and same_number(answer, sample.label))
    ok = int(sample.metadata.get("tool_ok", 0))
    bonus = float(getattr(args, "tool_bonus", 0.0)) if ok > 0 else 0.0
    return {"score": correct + bonus, "correct": correct, "tool_calls": float(ok),
            "turns": float(sample.metadata.get("turns", 0))}
