"""Synchronous vs asynchronous vs fully asynchronous training on a long-tail workload.

    python benchmarks/async_vs_sync.py --json async.json [--num-rollout 24] [--max-response-len 256]

The same tiny model, prompts (the parity task of examples/tiny_task.py), seed and number of
rollouts run three times as whole `train.py` / `train_async.py` processes:
- sync:        train.py (generate, then train, then push weights)
- async:       train_async.py (rollout k+1 generates while rollout k trains; one version stale)
- fully_async: train_async.py --fully-async (a background loop keeps groups in flight)
Response lengths follow a heavy-tailed distribution (`benchmarks/long_tail.py`: most responses
short, a few up to --max-response-len, EOS ignored), so a synchronous rollout waits for its
slowest group. Each record: wall time of the whole process and of its training loop (the sum of
`perf/step_time`: start-up, the same for every mode, left out), generated tokens/s over the loop
(`tokens_per_s`) and over the whole process (`tokens_per_s_wall`), the mean
`perf/wait_time_ratio` (share of each step the trainer waits for data, rollouts after the
first), and the mean reward of the first and last three rollouts. With --rounds N the three
modes run in turn N times (sync, async, fully async, sync, ...): a shared machine's speed drifts
over minutes, so each round's ratios compare runs minutes apart, and each mode's record holds the
round with its median loop time plus every round's loop time and ratio to that round's sync run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

MODES = {
    "sync": ("train.py", []),
    "async": ("train_async.py", []),
    "fully_async": ("train_async.py", ["--fully-async"]),
}


def run_mode(mode: str, model: Path, data: Path, out: Path, a) -> dict:
    script, extra = MODES[mode]
    cmd = [sys.executable, script, "--hf-checkpoint", str(model), "--prompt-data", str(data),
           "--input-key", "prompt", "--label-key", "label", "--apply-chat-template",
           "--rollout-batch-size", str(a.rollout_batch_size), "--n-samples-per-prompt", "4",
           "--global-batch-size", str(4 * a.rollout_batch_size), "--micro-batch-size", "8",
           "--num-rollout", str(a.num_rollout), "--rollout-max-response-len", str(a.max_response_len),
           "--custom-generate-function-path", "benchmarks/long_tail.py:generate",
           "--lr", "1e-3", "--use-tis", "--seed", "1", "--output-dir", str(out), *extra]
    env = dict(os.environ, PYTHONPATH=str(ROOT), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    start = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if r.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{r.stderr[-3000:]}")
    recs = [json.loads(line) for line in open(out / "metrics.jsonl") if '"rollout/raw_reward"' in line]
    tokens = sum(rec["rollout/response_len/mean"] * 4 * a.rollout_batch_size for rec in recs)
    loop = sum(rec["perf/step_time"] for rec in recs)  # the training loop, without start-up
    rewards = [rec["rollout/raw_reward"] for rec in recs]
    return {
        "mode": mode, "wall_s": round(wall, 1), "loop_s": round(loop, 1), "tokens_per_s": round(tokens / loop, 1),
        "tokens_per_s_wall": round(tokens / wall, 1),
        "wait_time_ratio": round(statistics.fmean(rec["perf/wait_time_ratio"] for rec in recs[1:]), 3),
        "reward_first3": round(statistics.fmean(rewards[:3]), 3),
        "reward_last3": round(statistics.fmean(rewards[-3:]), 3),
        "staleness_max": max(rec.get("rollout/staleness/max", 0.0) for rec in recs),
        "num_rollout": len(recs),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None, help="write the records here")
    p.add_argument("--num-rollout", type=int, default=24)
    p.add_argument("--rollout-batch-size", type=int, default=8)
    p.add_argument("--max-response-len", type=int, default=256)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--rounds", type=int, default=1, help="run the modes in turn this many times")
    a = p.parse_args()

    from tiny_task import make_tiny_task

    from slime.utils.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = build_tiny_model(tmp / "model", seed=0)
        data, _ = make_tiny_task(tmp / "data", seed=0)
        rounds = [{mode: run_mode(mode, model, data, tmp / f"{mode}_{i}", a) for mode in a.modes}
                  for i in range(a.rounds)]
    records = []
    for mode in a.modes:
        runs = sorted((r[mode] for r in rounds), key=lambda rec: rec["loop_s"])
        rec = dict(runs[(len(runs) - 1) // 2])  # the median round (the faster one of two middles)
        rec["loop_s_rounds"] = [r[mode]["loop_s"] for r in rounds]
        if "sync" in a.modes:
            rec["vs_sync_rounds"] = [round(r[mode]["tokens_per_s"] / r["sync"]["tokens_per_s"], 2) for r in rounds]
        records.append(rec)
    base = next((r for r in records if r["mode"] == "sync"), None)
    print(f"{'mode':<12} {'wall s':>7} {'loop s':>7} {'tok/s':>7} {'vs sync':>7} {'wait':>6} "
          f"{'reward first3->last3':>21} {'stale':>5}")
    for r in records:
        ratio = r["tokens_per_s"] / base["tokens_per_s"] if base else float("nan")
        r["throughput_vs_sync"] = round(ratio, 2)
        print(f"{r['mode']:<12} {r['wall_s']:>7} {r['loop_s']:>7} {r['tokens_per_s']:>7} {ratio:>6.2f}x "
              f"{r['wait_time_ratio']:>6} "
              f"{r['reward_first3']:>10} -> {r['reward_last3']:<8} {r['staleness_max']:>5}"
              + (f"  rounds: loop s {r['loop_s_rounds']}, vs sync {r.get('vs_sync_rounds')}" if a.rounds > 1 else ""))
    if a.json:
        Path(a.json).write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
