"""`ray start --head` + `ray job submit -- python train.py ...` on loopback: the working directory and
the environment are shipped by Ray, train.py attaches to the running cluster (RAY_ADDRESS, set by the
job) instead of starting its own, and the job succeeds with its metrics written."""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tests.helpers.ray_cluster import HeadNode, ray_env

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.e2e

EXCLUDES = [".venv", ".git", "outputs", "*.egg-info", "__pycache__", ".pytest_cache"]


def test_ray_job_submit_train(task, tmp_path):
    out = tmp_path / "out"
    head = HeadNode(num_cpus=2)
    try:
        head.start()
        job_id = f"slime-test-{uuid.uuid4().hex[:8]}"
        runtime_env = {"env_vars": {"OMP_NUM_THREADS": "1", "SLIME_JOB_MARKER": job_id}, "excludes": EXCLUDES}
        cmd = ["ray", "job", "submit", "--address", head.dashboard, "--submission-id", job_id,
               "--working-dir", str(ROOT), "--runtime-env-json", json.dumps(runtime_env), "--",
               "python", "train.py", "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1",
               "--rollout-num-gpus", "1", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
               "--global-batch-size", "16", "--num-rollout", "2", "--prompt-data", task["train"],
               "--input-key", "prompt", "--label-key", "label", "--apply-chat-template",
               "--hf-checkpoint", task["model"], "--rollout-max-response-len", "4", "--lr", "1e-3",
               "--micro-batch-size", "4", "--output-dir", str(out), "--seed", "7"]
        deadline = time.monotonic() + 120
        while True:  # right after `ray start` the head's job agent may not have registered yet
            proc = subprocess.run(cmd, env=ray_env(), capture_output=True, text=True, timeout=600, cwd=tmp_path)
            log = proc.stdout + proc.stderr
            if proc.returncode == 0 or "No available agent to submit job" not in log or time.monotonic() > deadline:
                break
            time.sleep(3)
        assert proc.returncode == 0, log[-4000:]
        assert f"Job '{job_id}' succeeded" in log

        from ray.job_submission import JobStatus, JobSubmissionClient

        client = JobSubmissionClient(head.dashboard)
        assert client.get_job_status(job_id) == JobStatus.SUCCEEDED
        info = client.get_job_info(job_id)
        assert info.runtime_env["env_vars"]["SLIME_JOB_MARKER"] == job_id  # the job's env, as shipped

        # train.py attached to this cluster (no private local Ray) and trained two rollouts
        assert "Started a local Ray instance" not in log
        assert "Connected to Ray cluster" in log or "Connecting to existing Ray cluster" in log, log[-4000:]
        records = [json.loads(line) for line in open(out / "metrics.jsonl")]
        assert [r["rollout_id"] for r in records] == [0, 1]
        assert all("train/loss" in r and r["train/train_rollout_logprob_abs_diff"] < 1e-3 for r in records)

        # what Ray shipped: the repository without the excluded directories
        shipped = list(Path(head.temp_dir).glob("session_*/runtime_resources/working_dir_files/_ray_pkg_*"))
        pkg = next(p for p in shipped if p.is_dir())
        assert (pkg / "train.py").is_file() and (pkg / "slime" / "driver.py").is_file()
        assert not any((pkg / d).exists() for d in (".venv", ".git", "outputs"))
        size = sum(f.stat().st_size for f in pkg.rglob("*") if f.is_file())
        assert size < 50 << 20, size
    finally:
        head.stop()
    assert head.processes() == []
