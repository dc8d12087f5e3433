"""`--rm-type deepscaler` (original slime's rule for DeepScaleR-style reasoning data), and the last
`\\boxed{...}` of a text (also what the `boxed_` prefix of any rule-based name grades).

deepscaler: the model's solution is the text after the last `</think>` (or, for responses without
one, the text between the first and second `###Response` marker); a response with neither scores 0.
Its last boxed answer is graded against the label (itself unboxed when it holds a `\\boxed{}`) with
this project's math equivalence (math-verify, `--rm-type math`), or equal after light string
normalisation. 1.0 right, 0.0 wrong or no boxed answer; an empty label scores 0.0; a label that is
not a string or a number is an error (the sample counts as a reward failure).
"""

from __future__ import annotations

import re

from slime.rollout.rewards.math import math_reward

_BOXED = "\\boxed"


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` in `text` (braces balanced), or None when the last
    `\\boxed` is not followed directly by a closed `{...}`."""
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    i = start + len(_BOXED)
    if text[i:i + 1] != "{":
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
    return None


def solution_part(response: str) -> str | None:
    """What deepscaler grades: after the last `</think>`, else between the first two `###Response`."""
    if "</think>" in response:
        return response.rsplit("</think>", 1)[1]
    if "###Response" in response:
        return response.split("###Response")[1]
    return None


def _plain(answer: str) -> str:
    """Light normalisation for string equality: no `\\text{}` wrapper, spaces, `\\left`/`\\right`,
    `\\!`, dollar signs or degree marks; `tfrac`/`dfrac` as `frac`."""
    s = answer.strip()
    wrapped = re.fullmatch(r"\\text\{(.+?)\}", s)
    if wrapped:
        s = wrapped.group(1)
    for old, new in (("\n", ""), ("\\!", ""), ("\\left", ""), ("\\right", ""), ("tfrac", "frac"),
                     ("dfrac", "frac"), ("^{\\circ}", ""), ("^\\circ", ""), ("\\$", ""), ("$", ""), (" ", "")):
        s = s.replace(old, new)
    return s


def answers_match(answer: str, truth: str) -> bool:
    """Equal after `_plain`, or mathematically equal (math-verify). An answer math-verify cannot
    parse only matches as a string."""
    if _plain(answer) == _plain(truth):
        return True
    try:
        return math_reward(f"{_BOXED}{{{answer}}}", truth) == 1.0
    except ValueError:  # the truth is no parseable math answer: the string comparison decided
        return False


def deepscaler_reward(response: str, label) -> float:
    solution = solution_part(response)
    if solution is None:
        return 0.0
    answer = last_boxed(solution)
    if answer is None:
        return 0.0
    if not isinstance(label, (str, int, float)):
        raise TypeError(f"--rm-type deepscaler needs a string or number label, got {type(label).__name__}")
    if label == "":
        return 0.0
    truth = str(label)
    if _BOXED in truth:
        truth = last_boxed(truth)
        if truth is None:
            return 0.0
    return 1.0 if answers_match(answer, truth) else 0.0
