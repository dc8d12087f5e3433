"""A local BM25 retriever over the example's corpus (no network, no index files).

`BM25(passages).search(query, k)` ranks passages by Okapi BM25 (k1 = 1.5, b = 0.75) over lower-cased
word tokens of title + text; `format_passages` writes them the way Search-R1 shows documents.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from pathlib import Path

CORPUS = Path(__file__).resolve().parent / "corpus.jsonl"
_WORD = re.compile(r"[a-z0-9]+(?:'[a-z]+)?")
STOPWORDS = frozenset("a an the of in on at to is was which what who how many much does did do for by and its "
                      "it are from with as called".split())


def words(text: str) -> list[str]:
    return [w for w in _WORD.findall(text.lower()) if w not in STOPWORDS]


def load_corpus(path: str | Path = CORPUS) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class BM25:
    def __init__(self, passages: list[dict], k1: float = 1.5, b: float = 0.75):
        self.passages, self.k1, self.b = passages, k1, b
        self.docs = [Counter(words(p["title"] + " " + p["text"])) for p in passages]
        self.lengths = [sum(d.values()) for d in self.docs]
        self.avg_length = sum(self.lengths) / max(len(self.docs), 1)
        df = Counter(w for d in self.docs for w in d)
        n = len(self.docs)
        self.idf = {w: math.log(1 + (n - f + 0.5) / (f + 0.5)) for w, f in df.items()}

    def scores(self, query: str) -> list[float]:
        q = words(query)
        out = []
        for d, length in zip(self.docs, self.lengths):
            norm = self.k1 * (1 - self.b + self.b * length / self.avg_length)
            out.append(sum(self.idf.get(w, 0.0) * d[w] * (self.k1 + 1) / (d[w] + norm) for w in q if w in d))
        return out

    def search(self, query: str, k: int = 3) -> list[dict]:
        """The `k` best passages with a positive score, best first (ties: corpus order)."""
        scores = self.scores(query)
        order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
        return [self.passages[i] for i in order[:k] if scores[i] > 0]


def format_passages(passages: list[dict]) -> str:
    if not passages:
        return "No results."
    return "\n".join(f"Doc {i + 1}(Title: {p['title']}) {p['text']}" for i, p in enumerate(passages))
