"""Math answers checked by the `math-verify` library (`--rm-type math`)."""

from __future__ import annotations

import logging


class _NoTimeoutWarning(logging.Filter):
    # math-verify warns on every call when its signal-based timeouts are off; slime
    # runs rewards off the main thread (where signals cannot be used) and bounds them
    # with its own timeout (slime.rollout.generate), so the warning is noise.
    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_NoTimeoutWarning())


def _parse(text: str):
    from math_verify import parse  # here: it imports sympy, which the driver (importing this module) never needs

    return parse(text, parsing_timeout=None)


def math_reward(response: str, label) -> float:
    """1.0 when the last answer in `response` is mathematically equal to `label`, else 0.0.

    The label is parsed as a bare expression (wrapped in `$...$` so plain numbers and
    LaTeX both parse); the response is parsed the way math-verify parses model output
    (boxed answers first, then the last number or expression).
    """
    gold = _parse(f"${label}$")
    if not gold:
        gold = _parse(str(label))
    if not gold:
        raise ValueError(f"label {label!r} is not a parseable math answer")
    answer = _parse(response)
    if not answer:
        return 0.0
    from math_verify import verify  # see _parse

    return 1.0 if verify(gold, answer, timeout_seconds=None) else 0.0
