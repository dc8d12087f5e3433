"""Reward of the MCP tools example: is the first number of the model's final answer the label?

The final answer is the last model turn, when it calls no tool. Returns a dict (`--reward-key score`):
`correct` (0/1), `tool_calls` (calls the calculator answered without error, from
`metadata["mcp_calls"]`), `turns`, and `score` = correct + `tool_bonus` (a --custom-config-path key,
default 0) when at least one call succeeded: a format reward for models that do not call tools yet.
"""

from __future__ import annotations

import re

from slime.rollout.multiturn import parse_tool_calls

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def reward(args, sample) -> dict:
    last = sample.metadata.get("last_turn", "")
    answered = not parse_tool_calls(last)
    m = _NUMBER.search(last or "") if answered else None
    try:
        correct = float(m is not None and abs(float(m.group(0)) - float(sample.label)) < 1e-6)
    except (TypeError, ValueError):
        correct = 0.0
    ok = sum(1 for c in sample.metadata.get("mcp_calls", []) if not c["error"])
    bonus = float(getattr(args, "tool_bonus", 0.0)) if ok else 0.0
    return {"score": correct + bonus, "correct": correct, "tool_calls": float(ok),
            "turns": float(sample.metadata.get("turns", 0))}
