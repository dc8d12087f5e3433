"""The toy task of `quickstart.py --tiny`: the parity of a two-digit number.

Prompt (a chat message): `parity of 4 7` (digits as separate words of the tiny
model's word-level vocabulary); label: `1` for odd, `0` for even, scored by
`--rm-type math`. A random model answers with a digit now and then, so GRPO has
signal from the first rollout; the reward rises as it learns to answer 0/1 and
then to read the last digit.
"""

from __future__ import annotations

import json
import random
from pathlib import Path


def make_tiny_task(out_dir: str | Path, seed: int = 0, n_eval: int = 20) -> tuple[Path, Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    numbers = list(range(10, 100))
    random.Random(seed).shuffle(numbers)
    splits = {"train.jsonl": numbers[n_eval:], "eval.jsonl": numbers[:n_eval]}
    for name, values in splits.items():
        with open(out_dir / name, "w") as f:
            for n in values:
                row = {"prompt": [{"role": "user", "content": f"parity of {n // 10} {n % 10}"}], "label": str(n % 2)}
                f.write(json.dumps(row) + "\n")
    return out_dir / "train.jsonl", out_dir / "eval.jsonl"
