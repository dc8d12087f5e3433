"""Prompt sets for the quickstart.

`make_quickstart_task` writes the GRPO task the quickstart trains SmolLM2-135M-Instruct
on: single-digit addition and subtraction, asked in reasoning-gym's `chain_sum`
wording ("State the final answer to the following arithmetic problem: 7 - 4 =").
The label is the integer result, scored by `--rm-type math`
(`slime.rollout.rewards.math.math_reward`: the last number in the response must equal
the label), so no custom verifier is needed.

Why this task: on 128 problems the base model is right 40% of the time greedily and
24% when sampling at temperature 1.0 (max 64 new tokens). It usually answers in one
short sentence ("The answer to this arithmetic problem is 6."), but at temperature 1.0
it often rambles instead, and it never gets negative results right. Rewards within a
group of samples therefore differ (GRPO has signal), answers are short (about 11
tokens greedy), and the quickest gain, answering tersely and correctly instead of
rambling, shows within a few steps. Two-digit sums (5% greedy), three single-digit
terms (12%) and the "Answer: N" format (about 0%) were too hard to learn in a few steps.

There are only 200 distinct problems (a, b in 0..9, + or -). The eval rows are
distinct problems; training rows are drawn from the other problems, cycling through
them (reshuffled each pass) when more training rows are asked for than exist.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

# Rollout settings the quickstart uses with this task.
MAX_RESPONSE_LEN = 48  # new tokens; right answers take ~8-15, longer ones are rambles
TEMPERATURE = 1.0

PROMPT_TEMPLATE = "State the final answer to the following arithmetic problem: {a} {op} {b} ="
OPERATORS = ("+", "-")
DIGITS = range(10)


def quickstart_problems() -> list[tuple[str, str]]:
    """All (question, answer) pairs of the quickstart task, in a fixed order."""
    out = []
    for op in OPERATORS:
        for a in DIGITS:
            for b in DIGITS:
                value = a + b if op == "+" else a - b
                out.append((PROMPT_TEMPLATE.format(a=a, op=op, b=b), str(value)))
    return out


def _row(question: str, answer: str) -> dict:
    return {"prompt": [{"role": "user", "content": question}], "label": answer}


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    tmp.replace(path)


def make_quickstart_task(out_dir: str | Path, n_train: int, n_eval: int, seed: int = 0) -> tuple[Path, Path]:
    """Write `train.jsonl` and `eval.jsonl` (rows `{"prompt": [messages], "label": str}`).

    Deterministic given `seed`; no eval problem appears in the training rows.
    Returns (train_path, eval_path).
    """
    problems = quickstart_problems()
    max_eval = len(problems) // 2
    if n_train < 0 or not 0 <= n_eval <= max_eval:
        raise ValueError(f"need n_train >= 0 and 0 <= n_eval <= {max_eval} (the task has {len(problems)} problems)")
    rng = random.Random(seed)
    order = problems[:]
    rng.shuffle(order)
    eval_problems, train_pool = order[:n_eval], order[n_eval:]
    train_problems: list[tuple[str, str]] = []
    while len(train_problems) < n_train:
        epoch = train_pool[:]
        rng.shuffle(epoch)
        train_problems.extend(epoch[: n_train - len(train_problems)])

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train_path, eval_path = out / "train.jsonl", out / "eval.jsonl"
    _write_jsonl(train_path, [_row(q, a) for q, a in train_problems])
    _write_jsonl(eval_path, [_row(q, a) for q, a in eval_problems])
    return train_path, eval_path


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Write the quickstart GRPO task.")
    parser.add_argument("out_dir")
    parser.add_argument("--n-train", type=int, default=512)
    parser.add_argument("--n-eval", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for p in make_quickstart_task(args.out_dir, args.n_train, args.n_eval, args.seed):
        print(p)
