"""Prompts for the Search-R1 example, from questions.jsonl (every answer is in corpus.jsonl and nowhere
else: the entities are made up, so a model must search).

    python examples/search_r1/make_data.py OUT_DIR --call-format tags    # real models
    python examples/search_r1/make_data.py OUT_DIR --call-format plain   # the tiny test model

Rows are `{"prompt": [messages], "label": [accepted answers]}`; the first `n_eval` questions (in a
seeded shuffle) are the eval set, the rest the training set.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

QUESTIONS = Path(__file__).resolve().parent / "questions.jsonl"

INSTRUCTIONS = (
    "Answer the question below. The facts you need are in a private encyclopedia, which you can search: "
    "write <search> your query </search> and the best passages come back between <information> and "
    "</information>. Think step by step, search as often as you need, and when you are sure, write the "
    "short answer between <answer> and </answer>, for example <answer> 1847 </answer>.\n\nQuestion: "
)


def prompt(question: str, call_format: str) -> list[dict]:
    if call_format == "tags":
        return [{"role": "user", "content": INSTRUCTIONS + question}]
    if call_format == "plain":
        return [{"role": "user", "content": "question : " + question}]
    raise ValueError(f"call_format must be tags or plain, got {call_format!r}")


def make_data(out_dir: str | Path, call_format: str = "tags", n_eval: int = 8, seed: int = 0) -> tuple[Path, Path]:
    with open(QUESTIONS) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    random.Random(seed).shuffle(rows)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = out / "train.jsonl", out / "eval.jsonl"
    for path, part in zip(paths, (rows[n_eval:], rows[:n_eval])):
        with open(path, "w") as f:
            for r in part:
                f.write(json.dumps({"prompt": prompt(r["question"], call_format), "label": r["answer"]}) + "\n")
    return paths


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--call-format", choices=["tags", "plain"], default="tags")
    p.add_argument("--n-eval", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    for path in make_data(a.out_dir, a.call_format, a.n_eval, a.seed):
        print(path)
