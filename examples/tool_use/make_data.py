"""Prompts for the tool-use example: arithmetic questions whose label is the integer answer.

    python examples/tool_use/make_data.py OUT_DIR --call-format plain     # the tiny test model
    python examples/tool_use/make_data.py OUT_DIR --call-format hermes    # real models

`plain`: `what is 3 plus 4 ?` with one-digit operands and a result in 0..max_result (words of the
tiny model's vocabulary; the tests use max_result 2, so that a model that reads the calculator's
result gets rewarded often enough to learn it in a few minutes). `hermes`: two-digit products and sums such as `What is 37 * 48?`, with a system
message that describes the calculator tool and the `<tool_call>` format. Rows are
`{"prompt": [messages], "label": "<answer>"}`; train and eval questions do not overlap.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SYSTEM_HERMES = (
    "You can use a calculator. To call it, write exactly\n"
    '<tool_call>{"name": "calculator", "arguments": {"expression": "<arithmetic expression>"}}</tool_call>\n'
    "and stop; the result comes back in a tool message. When you know the answer, reply with only the "
    "final number."
)
TOOL_SCHEMAS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression (+, -, *, /, parentheses).",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}]


def plain_questions(max_result: int = 9) -> list[tuple[str, str]]:
    out = []
    for a in range(10):
        for b in range(10):
            for word, value in (("plus", a + b), ("minus", a - b), ("times", a * b)):
                if 0 <= value <= max_result:
                    out.append((f"what is {a} {word} {b} ?", str(value)))
    return out


def hermes_questions(rng: random.Random, n: int) -> list[tuple[str, str]]:
    seen, out = set(), []
    while len(out) < n:
        a, b = rng.randint(11, 99), rng.randint(11, 99)
        op = rng.choice("*+")
        if (a, op, b) in seen:
            continue
        seen.add((a, op, b))
        out.append((f"What is {a} {op} {b}?", str(a * b if op == "*" else a + b)))
    return out


def make_data(out_dir: str | Path, call_format: str = "plain", n_train: int = 256, n_eval: int = 16,
              seed: int = 0, max_result: int = 9) -> tuple[Path, Path]:
    rng = random.Random(seed)
    if call_format == "plain":
        questions = plain_questions(max_result)
        rng.shuffle(questions)
        evals, pool = questions[:n_eval], questions[n_eval:]
        train = [pool[i % len(pool)] for i in range(n_train)]
        rows = lambda qs: [{"prompt": [{"role": "user", "content": q}], "label": a} for q, a in qs]  # noqa: E731
    elif call_format == "hermes":
        questions = hermes_questions(rng, n_train + n_eval)
        evals, train = questions[:n_eval], questions[n_eval:]
        rows = lambda qs: [{"prompt": [{"role": "system", "content": SYSTEM_HERMES},  # noqa: E731
                                       {"role": "user", "content": q}], "label": a, "tools": TOOL_SCHEMAS}
                           for q, a in qs]
    else:
        raise ValueError(f"call_format must be plain or hermes, got {call_format!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = out / "train.jsonl", out / "eval.jsonl"
    for path, qs in zip(paths, (train, evals)):
        with open(path, "w") as f:
            for row in rows(qs):
                f.write(json.dumps(row) + "\n")
    return paths


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--call-format", choices=["plain", "hermes"], default="plain")
    p.add_argument("--n-train", type=int, default=256)
    p.add_argument("--n-eval", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-result", type=int, default=9, help="plain: largest answer (0..9)")
    a = p.parse_args()
    for path in make_data(a.out_dir, a.call_format, a.n_train, a.n_eval, a.seed, a.max_result):
        print(path)
