"""Reward of the Search-R1 example: exact match (or token F1) of the answer against the label(s).

The answer is the last `<answer> ... </answer>` of the response (`call_format: tags`) or the text of
the model's last turn (`plain`). Answers and labels are normalized as in SQuAD (lower case, no
punctuation or articles). Returns a dict for `--reward-key score`: `score` (the `reward_metric`
config key, `em` by default, or `f1`), `em`, `f1` and `searches` (retriever calls in the episode);
each is logged as `rollout/reward/<key>`.
"""

from __future__ import annotations

import re
import string
from collections import Counter

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def normalize(text: str) -> str:
    text = "".join(c for c in str(text).lower() if c not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def f1(prediction: str, truth: str) -> float:
    p, t = normalize(prediction).split(), normalize(truth).split()
    common = sum((Counter(p) & Counter(t)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(p), common / len(t)
    return 2 * precision * recall / (precision + recall)


def extract_answer(sample, fmt: str) -> str | None:
    if fmt == "tags":
        found = _ANSWER.findall(sample.response or "")
        return found[-1].strip() if found else None
    return sample.metadata.get("last_turn", "")


def reward(args, sample) -> dict:
    labels = sample.label if isinstance(sample.label, list) else [sample.label]
    answer = extract_answer(sample, getattr(args, "call_format", "tags"))
    em = float(answer is not None and any(normalize(answer) == normalize(lab) for lab in labels))
    f = max((f1(answer, lab) for lab in labels), default=0.0) if answer is not None else 0.0
    metric = getattr(args, "reward_metric", "em")
    return {"score": em if metric == "em" else f, "em": em, "f1": f,
            "searches": float(sample.metadata.get("searches", 0))}
