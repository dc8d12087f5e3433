"""Where the CPU of a small train.py run goes: start-up of each process against the training loop.

    python benchmarks/startup_cpu.py [--runs 3] [--json startup.json]

Runs the end-to-end tests' run shape (tests/helpers/e2e.py `shape_cmd`: the tiny model, 3 rollouts
of 4 prompts x 4 samples, 4-token responses) as a whole `train.py` process, `--runs` times, and
samples the CPU time (user + system) of every process of the run every 0.1 s: the driver, the Ray
processes of its private local cluster, the RolloutManager, the engine server actor, the engine, the
router and the train rank. It prints one table: each role's CPU seconds (median over the runs), the
run's wall time, the seconds until the first rollout's line (start-up, plus that rollout) and the
training loop (the sum of `perf/step_time`).

Under `pytest -n 2` two such runs share two cores, so the CPU seconds, not a run's wall time, are what
a test costs the CI. The Ray cluster's own processes are a separate row: the e2e tests share one
cluster per worker and do not pay it per run. A process that lives less than one sampling interval is
missed; the figures are a lower bound by a fraction of a second per process.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]

# (role, what its command line contains), first match wins; Ray names actor workers "ray::Class.method"
ROLES = [
    ("driver (train.py)", "train.py"),
    ("RolloutManager", "ray::RolloutManager"),
    ("train rank", "ray::TrainActor"),
    ("engine server actor", "ray::EngineServer"),
    ("engine (native)", "slime.engines.native"),
    ("router", "sglang"),
    ("idle Ray workers", "ray::IDLE"),
    ("idle Ray workers", "default_worker.py"),
    ("Ray runtime-env setup", "setup_worker.py"),
    ("Ray cluster", "ray/"),
    ("Ray cluster", "ray::"),
]
GENERIC = {"other", "idle Ray workers", "Ray runtime-env setup", "Ray cluster"}  # names a Ray worker has before its actor's
ORDER = ["driver (train.py)", "RolloutManager", "train rank", "engine (native)", "engine server actor", "router",
         "idle Ray workers", "Ray runtime-env setup", "other", "Ray cluster"]


def role_of(cmdline: str) -> str:
    for role, marker in ROLES:
        if marker in cmdline:
            return role
    return "other"


def cpu_by_role(samples: dict[int, tuple[str, float]]) -> dict[str, float]:
    """{role: CPU seconds} from {pid: (the newest command line seen, its newest CPU seconds)}."""
    out: dict[str, float] = {}
    for cmdline, cpu in samples.values():
        role = role_of(cmdline)
        out[role] = out.get(role, 0.0) + cpu
    return out


def run_once(cmd: list[str], env: dict[str, str], interval: float = 0.1, log: Path | None = None) -> dict:
    """Run `cmd`, sampling its process tree every `interval` s; `log`: where its output is written."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    driver = psutil.Process(proc.pid)
    samples: dict[int, tuple[str, float]] = {}
    first_rollout: list[float] = []
    lines: list[str] = []

    def reader():  # the driver's output: when the first rollout's line appears
        for line in proc.stdout:
            lines.append(line)
            if not first_rollout and re.search(r"rollout 0 \|", line):
                first_rollout.append(time.perf_counter() - start)

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    while proc.poll() is None:
        try:
            procs = [driver, *driver.children(recursive=True)]
        except psutil.NoSuchProcess:
            break
        for p in procs:
            try:
                with p.oneshot():
                    c = p.cpu_times()
                    cmdline = " ".join(p.cmdline())
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            old = samples.get(p.pid)
            # a Ray worker renames itself (ray::IDLE -> ray::TrainActor.train): keep the most specific name
            if old and role_of(old[0]) not in GENERIC and role_of(cmdline) in GENERIC:
                cmdline = old[0]
            samples[p.pid] = (cmdline, c.user + c.system)
        time.sleep(interval)
    proc.wait()
    t.join(timeout=5)
    if log is not None:
        log.write_text("".join(lines))
    wall = time.perf_counter() - start
    return {"returncode": proc.returncode, "wall_s": wall, "cpu_s": cpu_by_role(samples),
            "first_rollout_s": first_rollout[0] if first_rollout else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", help="also write the records here")
    parser.add_argument("--work-dir", help="where the tiny model, data and run outputs go (default: a temp dir)")
    a = parser.parse_args(argv)

    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "examples"))
    from slime.utils.tiny_model import build_tiny_model
    from tests.helpers.e2e import make_task, shape_cmd

    work = Path(a.work_dir or tempfile.mkdtemp(prefix="startup_cpu_"))
    model = build_tiny_model(work / "model", seed=0)
    task = make_task(model, work / "task")
    env = dict(os.environ, PYTHONPATH=str(ROOT), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false")
    env.pop("RAY_ADDRESS", None)  # a private local cluster: its processes are children of the driver
    records = []
    for i in range(a.runs):
        out = work / f"run{i}"
        rec = run_once(shape_cmd(task, out), env, log=work / f"run{i}.log")
        if rec["returncode"] != 0:
            raise SystemExit(f"train.py failed (exit {rec['returncode']}); see {work}/run{i}.log")
        steps = [json.loads(line).get("perf/step_time", 0.0) for line in (out / "metrics.jsonl").read_text().splitlines()]
        rec["loop_s"] = sum(steps)
        records.append(rec)

    def median(key):
        return statistics.median(r[key] for r in records)

    roles = [r for r in ORDER if any(rec["cpu_s"].get(r, 0.0) > 0.05 for rec in records)]
    cpu = {r: statistics.median(rec["cpu_s"].get(r, 0.0) for rec in records) for r in roles}
    per_run = sum(v for r, v in cpu.items() if r != "Ray cluster")
    summary = {"runs": records, "cpu_s_median": cpu, "cpu_s_per_run_without_cluster": per_run,
               "wall_s_median": median("wall_s"), "loop_s_median": median("loop_s"),
               "first_rollout_s_median": statistics.median(r["first_rollout_s"] or 0.0 for r in records),
               "cores": os.cpu_count()}
    print(f"train.py, the e2e shape, {a.runs} runs on {os.cpu_count()} cores (medians):")
    print("| process | CPU s |\n|---|---|")
    for r in roles:
        print(f"| {r} | {cpu[r]:.1f} |")
    print(f"| **all but the Ray cluster** | **{per_run:.1f}** |")
    print(f"wall {summary['wall_s_median']:.1f} s: first rollout at {summary['first_rollout_s_median']:.1f} s, "
          f"training loop (the sum of perf/step_time) {summary['loop_s_median']:.1f} s")
    if a.json:
        Path(a.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
