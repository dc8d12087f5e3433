"""GRPO through train.py on the synthetic visual task of examples/vlm_shapes.py (docs/vlm.md): the
driver, the RolloutManager, the native engine with `image_data` and the FSDP trainer with pixels,
on the tiny random Qwen2.5-VL."""

from __future__ import annotations

import statistics
import sys

import pytest
from vlm_shapes import make_vlm_task

from tests.helpers.e2e import LP, records, run

pytestmark = pytest.mark.e2e


def test_grpo_on_the_shapes_task_reward_rises(tiny_vl_model_dir, tmp_path):
    train, _ = make_vlm_task(tmp_path / "task", colours=2, size=56)
    out = tmp_path / "out"
    proc = run([
        sys.executable, "train.py", "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1",
        "--rollout-num-gpus", "1", "--hf-checkpoint", tiny_vl_model_dir, "--prompt-data", str(train),
        "--input-key", "prompt", "--label-key", "label", "--apply-chat-template",
        "--multimodal-keys", '{"image": "images"}', "--rm-type", "math", "--advantage-estimator", "grpo",
        "--rollout-batch-size", "8", "--n-samples-per-prompt", "8", "--global-batch-size", "64",
        "--micro-batch-size", "64", "--num-rollout", "8", "--rollout-max-response-len", "1",
        "--rollout-temperature", "1.0", "--lr", "1e-2", "--output-dir", str(out),
    ])
    assert proc.returncode == 0, proc.stderr[-3000:]
    train_recs = [r for r in records(out) if "rollout/raw_reward" in r]
    rewards = [r["rollout/raw_reward"] for r in train_recs]
    assert len(rewards) == 8
    first, last = statistics.fmean(rewards[:3]), statistics.fmean(rewards[-3:])
    assert last > first + 0.25, rewards
    # engine and trainer score the same tokens with the same pixels (without them they differ by > 1e-3)
    assert all(r[LP] < 1e-5 for r in train_recs), [r[LP] for r in train_recs]
