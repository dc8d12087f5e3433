"""The cost of `--deterministic-mode` in the native engine: tokens/s with and without
batch-invariant numerics (`--enable-deterministic-inference`), same model, prompts and seeds.

    OMP_NUM_THREADS=1 python benchmarks/deterministic_mode.py               # 32 prompts x 32 tokens, tiny model
    OMP_NUM_THREADS=1 python benchmarks/deterministic_mode.py --prompts 8 --repeats 3

Every prompt is distinct, sampled at temperature 1 with its own seed, EOS ignored (so both
modes generate exactly prompts x tokens tokens). `tokens_per_s` is generated tokens / wall time
of one batch (all prompts submitted together; the engine load and one warm-up batch excluded),
the median of `--repeats` batches. Both modes run in this process, one after the other, on the
same threads. Prints a table and, as a check, whether the two modes sampled the same tokens
(they may differ in a token where the batched numerics round differently).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from slime.engines.native.engine import NativeEngine
from slime.utils.tiny_model import build_tiny_model

WORDS = ["the", "answer", "is", "what", "of", "plus", "minus", "times", "and", "a", "to", "in", "repeat", "digit",
         "number", "question", "solve", "compute", "sum", "copy", "say", "output", "reply", "with", "only", "final",
         "result", "equals", "parity", "odd", "even", "yes", "no", "hello", "world", "test"]


def run_batch(eng: NativeEngine, prompts: list[list[int]], tokens: int) -> tuple[float, list]:
    """(seconds, results) of one batch: every prompt submitted at once."""
    out = [None] * len(prompts)

    def one(i):
        out[i] = eng.generate(prompts[i], {"max_new_tokens": tokens, "temperature": 1.0,
                                            "ignore_eos": True, "seed": i},
                              rid=f"r{i}", timeout=3600)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF model directory (default: build the tests' tiny model)")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: $OMP_NUM_THREADS or all)")
    a = p.parse_args()
    model = a.model or str(build_tiny_model(Path(tempfile.mkdtemp()) / "tiny", seed=0))
    rows, outputs = [], {}
    for deterministic in (False, True):
        eng = NativeEngine(model, num_threads=a.threads, random_seed=0, deterministic=deterministic).start()
        try:
            prompts = [eng.tokenizer.encode(" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(4 + i % 13)))
                       for i in range(a.prompts)]
            run_batch(eng, prompts, a.tokens)  # warm-up
            times = []
            for _ in range(a.repeats):
                dt, res = run_batch(eng, prompts, a.tokens)
                times.append(dt)
            outputs[deterministic] = [r.output_ids for r in res]
            rows.append((deterministic, statistics.median(times), a.prompts * a.tokens / statistics.median(times)))
        finally:
            eng.shutdown()
    base = rows[0][2]
    print(f"native engine, {a.prompts} prompts x {a.tokens} tokens, median of {a.repeats}, "
          f"torch threads {a.threads or os.environ.get('OMP_NUM_THREADS', 'all')}")
    print(f"{'mode':<16}{'seconds':>10}{'tokens/s':>12}{'vs batched':>12}")
    for det, sec, tps in rows:
        print(f"{'deterministic' if det else 'batched':<16}{sec:>10.3f}{tps:>12.1f}{tps / base:>11.2f}x")
    print(f"same tokens in both modes: {outputs[False] == outputs[True]}")


if __name__ == "__main__":
    main()
