"""Helpers of the end-to-end tests: run a driver (train.py, train_async.py, an example) as a
subprocess from the repository root, and read the metrics it wrote."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def driver_env(**env_vars) -> dict[str, str]:
    """The environment of a driver run from the repository root: slime importable, its own local
    Ray cluster (RAY_ADDRESS dropped), and `env_vars` on top."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", **env_vars)
    env.pop("RAY_ADDRESS", None)
    return env


def run(cmd, timeout=600, **env_vars):
    """Run `cmd` from the repository root in `driver_env(**env_vars)`, e.g. OMP_NUM_THREADS="1"
    to pin the threads of a run whose memory is measured."""
    return subprocess.run(cmd, cwd=ROOT, env=driver_env(**env_vars), capture_output=True, text=True,
                          timeout=timeout)


def records(out_dir):
    """The run's metrics.jsonl, one dict per line."""
    return [json.loads(line) for line in open(Path(out_dir) / "metrics.jsonl")]
