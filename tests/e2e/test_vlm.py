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


def test_grpo_on_the_shapes_task_learns_the_colours_from_the_pixels(tiny_vl_model_dir, tmp_path):
    """Every row has the same prompt text and the labels are balanced, so a policy blind to the pixels
    scores 0.5: a reward far above that is the colour read from the image, through the engine's
    image_data, the trainer's pixel inputs and the vision tower's weight pushes."""
    train, evaluation = make_vlm_task(tmp_path / "task", colours=2, size=84)
    out = tmp_path / "out"
    proc = run([
        sys.executable, "train.py", "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1",
        "--rollout-num-gpus", "1", "--hf-checkpoint", tiny_vl_model_dir, "--prompt-data", str(train),
        "--input-key", "prompt", "--label-key", "label", "--apply-chat-template",
        "--multimodal-keys", '{"image": "images"}', "--rm-type", "math", "--advantage-estimator", "grpo",
        "--rollout-batch-size", "8", "--n-samples-per-prompt", "8", "--global-batch-size", "64",
        "--micro-batch-size", "64", "--num-rollout", "56", "--rollout-max-response-len", "1",
        "--rollout-temperature", "1.0", "--lr", "1e-3", "--seed", "1", "--output-dir", str(out),
        "--eval-prompt-data", "shapes", str(evaluation), "--n-samples-per-eval-prompt", "8", "--eval-interval", "56",
    ])
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = records(out)
    train_recs = [r for r in recs if "rollout/raw_reward" in r]
    rewards = [r["rollout/raw_reward"] for r in train_recs]
    assert len(rewards) == 56
    first, last = statistics.fmean(rewards[:8]), statistics.fmean(rewards[-8:])
    assert first < 0.2 and last > 0.9, rewards  # from hardly a digit at all to the colour, far above 0.5
    evals = {r["rollout_id"]: r["eval/shapes"] for r in recs if "eval/shapes" in r}
    assert sorted(evals) == [0, 56], evals
    assert evals[0] < 0.2 and evals[56] > 0.85, evals  # 128 answers on 16 held-out images, 8 of each colour
    # engine and trainer score the same tokens with the same pixels (without them they differ by > 1e-3)
    assert all(r[LP] < 1e-5 for r in train_recs), [r[LP] for r in train_recs]


def test_megatron_trains_on_image_prompts_through_train_py(tiny_vl_model_dir, tmp_path):
    """--train-backend megatron with --multimodal-keys: the rollouts' images reach the megatron trainer
    (engine and trainer log-probs agree in every rollout, which without the pixels they do not:
    tests/unit/training/test_megatron_vision.py) and its weights, the vision tower's under their HF
    names, reach the engine bit for bit after each step (--check-weight-update-equal)."""
    train, _ = make_vlm_task(tmp_path / "task", colours=2, size=84)
    out = tmp_path / "out"
    proc = run([
        sys.executable, "train.py", "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1",
        "--rollout-num-gpus", "1", "--hf-checkpoint", tiny_vl_model_dir, "--prompt-data", str(train),
        "--input-key", "prompt", "--label-key", "label", "--apply-chat-template", "--train-backend", "megatron",
        "--multimodal-keys", '{"image": "images"}', "--rm-type", "math", "--advantage-estimator", "grpo",
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "16",
        "--num-rollout", "3", "--rollout-max-response-len", "1", "--rollout-temperature", "1.0", "--lr", "1e-3",
        "--seed", "1", "--check-weight-update-equal", "--output-dir", str(out),
    ])
    assert proc.returncode == 0, proc.stderr[-3000:]
    train_recs = [r for r in records(out) if "rollout/raw_reward" in r]
    assert len(train_recs) == 3
    # the first step moved the weights (later groups may all score alike: GRPO's advantages are then 0), and
    # the next rollouts, sampled by the engine with the pushed weights, are scored alike by the trainer
    assert train_recs[0]["train/grad_norm"] > 0
    assert all(r[LP] < 1e-5 for r in train_recs), [r[LP] for r in train_recs]
