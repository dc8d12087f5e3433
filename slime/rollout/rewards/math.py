"""Math answers checked by the `math-verify` library (`--rm-type math`)."""

from __future__ import annotations


def _parse(text: str):
    from math_verify import parse

    return parse(text, parsing_timeout=None)


def math_reward(response: str, label) -> float:
    """1.0 when the last answer in `response` is mathematically equal to `label`, else 0.0.

    The label is parsed as a bare expression (wrapped in `$...$` so plain numbers and
    LaTeX both parse); the response is parsed the way math-verify parses model output
    (boxed answers first, then the last number or expression).
    """
    from math_verify import verify

    gold = _parse(f"${label}$")
    if not gold:
        gold = _parse(str(label))
    if not gold:
        raise ValueError(f"label {label!r} is not a parseable math answer")
    answer = _parse(response)
    if not answer:
        return 0.0
    return 1.0 if verify(gold, answer, timeout_seconds=None) else 0.0
