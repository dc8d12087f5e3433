"""Tasks of the MCP tools example: arithmetic the model should hand to the calculator server.

    python examples/mcp_tools/make_data.py OUT_DIR [--n-train 256] [--n-eval 16]

Rows are `{"prompt": [{"role": "user", "content": "What is 37 * 48?"}], "label": "1776"}`: the tools
are not in the rows; `slime.rollout.environments.mcp_tools` offers the servers' tools through the
chat template. Train and eval questions do not overlap. `tasks.jsonl` next to this file holds 16.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def questions(rng: random.Random, n: int) -> list[tuple[str, str]]:
    seen, out = set(), []
    while len(out) < n:
        a, b, op = rng.randint(11, 99), rng.randint(11, 99), rng.choice("*+-")
        if (a, op, b) in seen:
            continue
        seen.add((a, op, b))
        out.append((f"What is {a} {op} {b}? Use the calculator, then reply with only the number.",
                    str({"*": a * b, "+": a + b, "-": a - b}[op])))
    return out


def write(path: Path, qs) -> None:
    with open(path, "w") as f:
        for q, a in qs:
            f.write(json.dumps({"prompt": [{"role": "user", "content": q}], "label": a}) + "\n")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--n-train", type=int, default=256)
    p.add_argument("--n-eval", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    qs = questions(random.Random(a.seed), a.n_train + a.n_eval)
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write(out / "train.jsonl", qs[a.n_eval:])
    write(out / "eval.jsonl", qs[:a.n_eval])
    print(out / "train.jsonl", out / "eval.jsonl")
