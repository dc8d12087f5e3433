"""`--rm-type f1`: token-level F1 between the response and the label (SQuAD-style), as original
slime scores short-answer QA.

Both texts are lower-cased, stripped of ASCII punctuation and of the articles a/an/the, and split on
whitespace. F1 = 2PR / (P + R) over the tokens they share (counted with multiplicity). When either
side normalises to "yes", "no" or "noanswer", anything but the same word on the other side scores 0.
The whole response is compared: use `boxed_f1` to compare only the last `\\boxed{}` answer.
"""

from __future__ import annotations

import re
import string
from collections import Counter

_PUNCT = str.maketrans("", "", string.punctuation)
_ARTICLES = re.compile(r"\b(?:a|an|the)\b")
_CLOSED = ("yes", "no", "noanswer")


def normalize_text(text: str) -> str:
    text = str(text).lower().translate(_PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def f1_score(prediction: str | None, truth) -> tuple[float, float, float]:
    """(f1, precision, recall); all 0.0 for no prediction or no shared token."""
    if prediction is None:
        return 0.0, 0.0, 0.0
    pred, gold = normalize_text(prediction), normalize_text(truth)
    if pred != gold and (pred in _CLOSED or gold in _CLOSED):
        return 0.0, 0.0, 0.0
    pred_tokens, gold_tokens = pred.split(), gold.split()
    shared = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if shared == 0:
        return 0.0, 0.0, 0.0
    precision, recall = shared / len(pred_tokens), shared / len(gold_tokens)
    return 2 * precision * recall / (precision + recall), precision, recall


def f1_reward(response: str, label) -> float:
    return f1_score(response, label)[0]
