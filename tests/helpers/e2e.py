"""Helpers of the end-to-end tests: run a driver (train.py, train_async.py, an example) as a
subprocess from the repository root, the tiny task every e2e test trains on, and the metrics a
run wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.ray_cluster import LOOPBACK_ENV

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
if str(EXAMPLES) not in sys.path:  # tiny_task, quickstart, tasks: the examples' own modules
    sys.path.insert(0, str(EXAMPLES))

# The reference run of the quick-start shape (the `reference_run` fixture) and the flags every run
# compared with it repeats: seed 7, 4 rollouts (and every weight push checked bit for bit, with engines).
REFERENCE_SHAPE = ("--seed", "7", "--num-rollout", "4")
REFERENCE_FLAGS = (*REFERENCE_SHAPE, "--check-weight-update-equal")

# Set by tests/e2e/conftest.py: the session's shared Ray cluster, which every driver joins.
SHARED_RAY_ADDRESS: str | None = None


def driver_env(**env_vars) -> dict[str, str]:
    """The environment of a driver run from the repository root: slime importable, the session's
    shared Ray cluster when there is one (else the driver starts its own local one), and
    `env_vars` on top (`RAY_ADDRESS=None` drops it: a private cluster)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    env.pop("RAY_ADDRESS", None)
    if SHARED_RAY_ADDRESS:
        env.update(LOOPBACK_ENV, RAY_ADDRESS=SHARED_RAY_ADDRESS)
    for k, v in env_vars.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


def run(cmd, timeout=600, **env_vars):
    """Run `cmd` from the repository root in `driver_env(**env_vars)`, e.g. OMP_NUM_THREADS="1"
    to pin the threads of a run whose memory is measured. A run past `timeout` fails the test with the
    end of what it had written to stderr (where it was when it stopped)."""
    try:
        return subprocess.run(cmd, cwd=ROOT, env=driver_env(**env_vars), capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        raise AssertionError(f"{' '.join(map(str, cmd))[:300]}\nran past its {timeout} s; the end of its "
                             f"stderr:\n{err[-4000:]}") from None


def records(out_dir):
    """The run's metrics.jsonl, one dict per line."""
    return [json.loads(line) for line in open(Path(out_dir) / "metrics.jsonl")]


LP = "train/train_rollout_logprob_abs_diff"  # depends on which requests share an engine batch


def comparable(recs):
    """Training records keyed by rollout id, without timings and the engine's batch-dependent bits."""
    return {r["rollout_id"]: {k: v for k, v in r.items() if not k.startswith("perf/") and k != LP}
            for r in recs if "trained_rollouts" not in r}


def make_task(model_dir, work: Path) -> dict:
    """The tiny task (parity of a two-digit number) next to the tiny model: {model, train, eval, work}."""
    from tiny_task import make_tiny_task

    train, evaluation = make_tiny_task(Path(work) / "data", seed=0)
    return {"model": str(model_dir), "train": str(train), "eval": str(evaluation), "work": Path(work)}


def shape_cmd(task, out_dir, *extra):
    """The quick-start shape with small numbers: 3 rollouts of 4 prompts x 4 samples, 4-token responses."""
    return [
        sys.executable, "train.py", "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1",
        "--rollout-num-gpus", "1", "--advantage-estimator", "grpo", "--use-kl-loss", "--kl-loss-coef", "0.001",
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "16",
        "--num-rollout", "3", "--prompt-data", task["train"], "--input-key", "prompt", "--label-key", "label",
        "--apply-chat-template", "--hf-checkpoint", task["model"], "--rollout-max-response-len", "4",
        "--lr", "1e-3", "--micro-batch-size", "4", "--output-dir", str(out_dir), *extra,
    ]
