"""Compare two runs' metrics.jsonl value by value, timings aside: a fixed-seed run must give the
same numbers before and after a change that is not meant to change them.

    python tools/compare_metrics.py A/metrics.jsonl B/metrics.jsonl

Left out: `perf/*`, `memory/*` and every key that names a time or a throughput. Prints each
value that differs (record index, key, A, B) and a summary line; exits 1 when the records or
their keys do not line up, 0 otherwise (differing values are for the reader to judge: the
engine's `train/train_rollout_logprob_abs_diff` changes between two runs of the same code).
"""

from __future__ import annotations

import json
import sys


def _timing(key: str) -> bool:
    return key.startswith(("perf/", "memory/")) or "time" in key or "tokens_per_s" in key


def load(path: str) -> list[dict]:
    with open(path) as f:
        return [{k: v for k, v in json.loads(line).items() if not _timing(k)} for line in f if line.strip()]


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    a, b = load(argv[0]), load(argv[1])
    if len(a) != len(b):
        print(f"{argv[0]} has {len(a)} records, {argv[1]} has {len(b)}")
        return 1
    differ, misaligned = 0, False
    for i, (x, y) in enumerate(zip(a, b)):
        if set(x) != set(y):
            print(f"record {i}: keys only on one side: {sorted(set(x) ^ set(y))}")
            misaligned = True
        for k in sorted(set(x) & set(y)):
            if x[k] != y[k]:
                print(f"{i} {k} {x[k]} {y[k]}")
                differ += 1
    print(f"{len(a)} records, {sum(len(r) for r in a)} values compared, {differ} differ")
    return 1 if misaligned else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
