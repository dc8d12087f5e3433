"""A train.py / train_async.py run with two engines behind sglang-router and --use-fault-tolerance,
where one engine is killed (SIGKILL) or frozen (SIGSTOP) in the middle of a rollout: what the
fault-tolerance tests (tests/e2e/test_fault_tolerance.py, test_lora.py) observe of it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from slime.engines.control import EngineControl, EngineError
from tests.helpers.e2e import ROOT, driver_env, records

NUM_ROLLOUT = 4


def train_cmd(task, out_dir, driver="train.py", extra=()):
    return [
        sys.executable, driver, "--rollout-num-gpus", "2", "--actor-num-gpus-per-node", "1",
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "16",
        "--num-rollout", str(NUM_ROLLOUT), "--prompt-data", task["train"], "--input-key", "prompt",
        "--label-key", "label", "--apply-chat-template", "--hf-checkpoint", task["model"],
        "--rollout-max-response-len", "48", "--lr", "1e-3", "--micro-batch-size", "4",
        "--use-fault-tolerance", "--rollout-health-check-interval", "0.5", "--rollout-health-check-timeout", "3",
        "--stage-timeout", "600", "--output-dir", str(out_dir), *extra,
    ]


def engine_pid(url: str) -> int | None:
    """The pid of the native engine serving `url`: the live process listening on its port; None while
    there is none (a killed engine being reaped, its successor not yet bound). Another kind of
    process on the port is an error."""
    port = int(url.rsplit(":", 1)[1])
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status != psutil.CONN_LISTEN or not conn.laddr or conn.laddr.port != port or not conn.pid:
            continue
        try:
            cmd = psutil.Process(conn.pid).cmdline()
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            return None
        if "slime.engines.native" not in cmd:
            raise AssertionError(f"{url} is served by pid {conn.pid}, not a native engine: {cmd}")
        return conn.pid
    return None


def info(url: str) -> dict | None:
    try:
        return EngineControl(url, timeout=2).server_info()
    except EngineError:
        return None


def checksums_equal(a: str, b: str) -> bool | None:
    """Whether the two engines serve identical weights (None: cannot tell right now, e.g. a push is
    in progress between the reads)."""
    try:
        va = EngineControl(a, timeout=5).weight_version()
        vb = EngineControl(b, timeout=5).weight_version()
        if va != vb:
            return None
        ca = EngineControl(a, timeout=30).weights_checksum()
        cb = EngineControl(b, timeout=30).weights_checksum()
        if EngineControl(a, timeout=5).weight_version() != va or \
                EngineControl(b, timeout=5).weight_version() != vb:
            return None
        return ca == cb
    except EngineError:
        return None


def run_with_fault(task, out_dir: Path, sig: int, driver: str = "train.py", extra=()) -> dict:
    """Run train.py; once the engines serve trained weights (version >= 1) and engine 1 has
    requests running, send `sig` to engine 1. Watch the restarted engine until it serves the same
    weights as engine 0. Returns what was observed."""
    env = driver_env(PYTHONUNBUFFERED="1")
    log = open(out_dir.parent / f"{out_dir.name}.out", "w+")
    proc = subprocess.Popen(train_cmd(task, out_dir, driver, extra), cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT, text=True)
    seen = {"killed_pid": None, "restarted_pid": None, "served_before_weights": [], "same_weights": None}
    deadline = time.monotonic() + 900
    try:
        urls = None
        while urls is None:  # train.py prints "slime: 2 engine(s) at URL, URL; ..."
            assert proc.poll() is None, f"train.py exited early:\n{Path(log.name).read_text()[-3000:]}"
            assert time.monotonic() < deadline
            m = re.search(r"engine\(s\) at (\S+), (\S+);", Path(log.name).read_text())
            urls = [m.group(1), m.group(2)] if m else None
            time.sleep(0.2)
        victim, other = urls[1], urls[0]
        while seen["killed_pid"] is None:
            assert proc.poll() is None, "the run ended before engine 1 was caught in the middle of a rollout"
            i = info(victim)
            pid = engine_pid(victim) if i and i["weight_version"] not in ("0", None) \
                and i["num_running_requests"] > 0 else None
            if pid is not None:
                seen["killed_pid"] = pid
                os.kill(pid, sig)
                seen["killed_at_version"] = i["weight_version"]
            time.sleep(0.01)
        while proc.poll() is None and seen["same_weights"] is not True:
            assert time.monotonic() < deadline
            i = info(victim)
            if i is not None:
                pid = engine_pid(victim)
                if pid is not None and pid != seen["killed_pid"]:
                    seen["restarted_pid"] = pid
                    if i["weight_updates"] == 0 and i["total_requests"] > 0:
                        seen["served_before_weights"].append(i)
                    if i["weight_updates"] > 0:
                        seen["same_weights"] = checksums_equal(victim, other)
            time.sleep(0.05)
        proc.wait(timeout=max(1, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if seen["killed_pid"] is not None and sig == signal.SIGSTOP:
            try:  # never leave a stopped process behind
                os.kill(seen["killed_pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
    seen["returncode"] = proc.returncode
    seen["output"] = Path(log.name).read_text()
    seen["records"] = records(out_dir) if (out_dir / "metrics.jsonl").exists() else []
    return seen
