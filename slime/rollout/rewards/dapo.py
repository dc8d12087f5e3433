"""`--rm-type dapo`: the DAPO-Math rule as original slime applies it (a dict reward: pass
`--reward-key score`).

Only the last 300 characters of the response count. The answer is what follows the last
`Answer:` there (any case, spaces allowed before the colon, up to the end of the line), or
"[INVALID]" when there is none; it and the label are normalised the Minerva way (below), and the
label must then be an integer, as every DAPO-Math-17k answer is (anything else is an error: the
sample counts as a reward failure). Returns `{"score": 1.0 | -1.0, "acc": bool, "pred": str}`:
1.0 when the normalised answer equals the label's integer, else -1.0.
"""

from __future__ import annotations

import re

TAIL_CHARS = 300  # the longest MATH-500 answer is far shorter
_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")

# Minerva normalisation, applied in this order: replacements, then removals (units, filler words,
# TeX spacing and special tokens), then TeX unwrapping.
_REPLACE = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
            (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))
_REMOVE = ("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
           "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
           "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
           "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;",
           ",\\!", "{,}", '"', "\\dots", "<|im_end|>", "<|endoftext|>")
_UNWRAP = (re.compile(r"\\text\{(.*?)\}"), re.compile(r"\\textbf\{(.*?)\}"), re.compile(r"\\overline\{(.*?)\}"),
           re.compile(r"\\boxed\{(.*)\}"))


def normalize_answer(answer) -> str:
    """A final answer in the form DAPO compares: the part after the last `=`, no spaces, units,
    `$`, `\\text{}`/`\\boxed{}` wrappers or thousands separators; `\\fracab` as `\\frac{a}{b}`."""
    s = str(answer).split("=")[-1]
    for old, new in _REPLACE:
        s = s.replace(old, new)
    for word in _REMOVE:
        s = s.replace(word, "")
    s = re.sub(r"(.*?)\$(.*?)\$(.*)", r"$\2$", s)  # a line with $...$: only its first $...$ is kept
    for pattern in _UNWRAP:
        s = pattern.sub(r"\1", s)
    s = re.sub(r"frac([^{])(.)", r"frac{\1}{\2}", s)
    s = re.sub(r"sqrt([^{])", r"sqrt{\1}", s)
    s = s.replace("$", "")
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s.strip()


def integer_label(label) -> str:
    normalized = normalize_answer(label)
    try:
        return str(int(float(normalized)))
    except ValueError:
        raise ValueError(f"--rm-type dapo needs integer labels (DAPO-Math answers are integers), "
                         f"got {label!r}") from None


def dapo_reward(response: str, label) -> dict:
    found = _ANSWER.findall(response[-TAIL_CHARS:])
    pred = normalize_answer(found[-1] if found else "[INVALID]")
    correct = pred == integer_label(label)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
