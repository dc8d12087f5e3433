"""train.py with `--train-backend megatron` on CPU (gloo): the tiny quickstart with two pipeline
stages (one decoder layer each), and PPO with the critic on the megatron backend too. Skipped
without megatron-core."""

import statistics
import sys

import pytest

from tests.helpers.e2e import records, run

pytest.importorskip("megatron.core")


def test_quickstart_tiny_learns_with_megatron_pipeline_parallel(tmp_path):
    out = tmp_path / "out"
    proc = run([sys.executable, "examples/quickstart.py", "--tiny", "--output-dir", str(out), "--",
                "--train-backend", "megatron", "--pipeline-model-parallel-size", "2",
                "--actor-num-gpus-per-node", "2", "--num-rollout", "8", "--eval-interval", "8"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rs = [r for r in records(out) if "train/loss" in r]
    assert [r["rollout_id"] for r in rs] == list(range(8))
    rewards = [r["rollout/raw_reward"] for r in rs]
    first, last = statistics.fmean(rewards[:3]), statistics.fmean(rewards[-3:])
    assert last >= 1.5 * first and last > first + 0.1, rewards
    for r in rs:
        # the engine's log-probs (native engine, HF weights gathered from both stages and pushed by the
        # megatron trainer) vs the trainer's pipeline forward
        assert r["train/train_rollout_logprob_abs_diff"] < 1e-4, r
    # from rollout 1 on the KL term alone gives every step a gradient (rollout 0 may have none: the
    # policy is the reference and groups of equal rewards have no advantage)
    assert all(r["train/grad_norm"] > 0 for r in rs[1:]), [r["train/grad_norm"] for r in rs]
    # later rollouts were generated with pushed weights: the policy has moved from the reference
    assert rs[-1]["train/kl_loss"] != 0
    assert rs[-1]["train/lr"] == pytest.approx(3e-3)


def test_quickstart_tiny_ppo_with_the_megatron_critic(tmp_path):
    """--advantage-estimator ppo: policy and critic (value head) both megatron models on one rank."""
    out = tmp_path / "out"
    proc = run([sys.executable, "examples/quickstart.py", "--tiny", "--output-dir", str(out), "--",
                "--train-backend", "megatron", "--advantage-estimator", "ppo", "--gamma", "1.0", "--lambd", "0.95",
                "--value-clip", "0.2", "--num-rollout", "8", "--eval-interval", "8"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rs = [r for r in records(out) if "train/loss" in r]
    assert [r["rollout_id"] for r in rs] == list(range(8))
    # the critic learns the returns: its value loss falls by more than half (1.25 -> 0.17 on 2026-11-27)
    values = [r["critic/value_loss"] for r in rs]
    assert values[-1] < values[0] / 2, values
    rewards = [r["rollout/raw_reward"] for r in rs]
    assert statistics.fmean(rewards[-3:]) > statistics.fmean(rewards[:3]), rewards  # 0.036 -> 0.156
    assert all(r["train/train_rollout_logprob_abs_diff"] < 1e-4 for r in rs), rs
