"""`--rm-type gpqa`: multiple-choice grading as original slime does it for GPQA. 1.0 or 0.0.

Inputs: the response, the label, and the sample's metadata, which may hold `choices` (a list, or a
dict whose values are the options in order), `valid_letters`, `correct_letter`, `correct_answer`,
`answer_text`.

- The letters in play: `valid_letters`, else one per choice (A, B, ...), else A-J.
- The correct letter: `metadata["correct_letter"]`; a one-letter label (when there is no
  `correct_letter`); an integer label as an index into the letters (this wins over
  `correct_letter`); or the letter of the choice whose text equals the label (normalised).
- The chosen letter is read from the response after its last `</think>`, trying in turn (each time
  the first match only; case-insensitive, so as in original slime "the answer is clearly B" reads
  C, from "clearly"): a letter after answer/option/choice (optionally "is" or ":"); a letter
  followed by "is (the) correct"; a letter after "final answer/option". Failing those, the last
  standalone capital letter that is in play.
- Both letters known: 1.0 when they agree. Otherwise 1.0 when the text of the correct choice, the
  metadata's `correct_answer`/`answer_text`, or the label appears (normalised) in the response
  (anywhere: as in original slime, a label "B" then matches "it must be ..."); or, with no correct
  letter, when the chosen letter equals the stripped, upper-cased label.
"""

from __future__ import annotations

import re
import string

DEFAULT_LETTERS = tuple(string.ascii_uppercase[:10])
_LETTER_PATTERNS = (
    re.compile(r"(?:answer|option|choice)\s*(?:is|:)?\s*([A-Z])", re.IGNORECASE),
    re.compile(r"([A-Z])\s*(?:is\s*(?:the)?\s*correct)", re.IGNORECASE),
    re.compile(r"final\s*(?:answer|option)\s*(?:is|:)?\s*([A-Z])", re.IGNORECASE),
)
_STANDALONE = re.compile(r"\b([A-Z])\b")


def after_thinking(text: str) -> str:
    return text.rsplit("</think>", 1)[-1] if text else ""


def _norm(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", " ", str(text).lower()).strip()


def chosen_letter(response: str, letters) -> str | None:
    """The option letter the response picks (see the module docstring), or None."""
    text = after_thinking(response)
    if not text:
        return None
    letters = {str(x).upper() for x in letters}
    for pattern in _LETTER_PATTERNS:
        found = pattern.search(text)
        if found and found.group(1).upper() in letters:
            return found.group(1).upper()
    for letter in reversed(_STANDALONE.findall(text)):
        if letter in letters:
            return letter
    return None


def _choices(metadata: dict) -> list | None:
    choices = metadata.get("choices")
    if isinstance(choices, dict):
        return list(choices.values())
    return list(choices) if choices is not None else None


def gpqa_reward(response: str, label, metadata: dict | None = None) -> float:
    if response is None:
        return 0.0
    metadata = metadata or {}
    choices = _choices(metadata)
    if metadata.get("valid_letters"):
        letters = [str(x).upper() for x in metadata["valid_letters"]]
    elif choices:
        letters = list(string.ascii_uppercase[:len(choices)])
    else:
        letters = list(DEFAULT_LETTERS)

    correct = metadata.get("correct_letter")
    correct = correct.strip().upper() if isinstance(correct, str) else None
    label_text = None
    if isinstance(label, str):
        label_text = label.strip()
        if not correct and len(label_text) == 1 and label_text.upper() in letters:
            correct = label_text.upper()
    elif isinstance(label, (int, float)) and 0 <= int(label) < len(letters):
        correct = letters[int(label)]
    if not correct and choices and label_text:
        matching = [i for i, c in enumerate(choices) if _norm(c) == _norm(label_text)]
        if matching:
            correct = letters[matching[0]]

    chosen = chosen_letter(response, letters)
    if chosen and correct:
        return 1.0 if chosen == correct else 0.0

    targets = []
    if correct and choices and correct in letters and letters.index(correct) < len(choices):
        targets.append(str(choices[letters.index(correct)]))
    targets += [str(metadata[k]) for k in ("correct_answer", "answer_text") if metadata.get(k)]
    if label_text:
        targets.append(label_text)
    said = _norm(after_thinking(response))
    if any(t and t in said for t in {_norm(x) for x in targets}):
        return 1.0
    if chosen and not correct and label_text:
        return 1.0 if chosen == label_text.upper() else 0.0
    return 0.0
