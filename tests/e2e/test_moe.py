"""End-to-end: GRPO on a tiny random Qwen3-MoE with rollout routing replay and the load-balancing
loss (examples/quickstart.py --tiny --moe): the reward rises, the trainer's log-probs equal the
engine's (the engine's experts are replayed), and expert usage is logged per layer."""

from __future__ import annotations

import statistics
import sys

import pytest

from tests.helpers.e2e import records, run

pytestmark = pytest.mark.e2e


def test_tiny_moe_learns_with_rollout_routing_replay(tmp_path):
    out = tmp_path / "moe"
    proc = run([sys.executable, "examples/quickstart.py", "--tiny", "--moe", "--output-dir", str(out), "--",
                "--num-rollout", "10", "--eval-interval", "10"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    train = [r for r in records(out) if "rollout/raw_reward" in r]
    rewards = [r["rollout/raw_reward"] for r in train]
    first, last = statistics.fmean(rewards[:3]), statistics.fmean(rewards[-3:])
    assert last >= 2 * first and last > first + 0.15, rewards
    # R3: the trainer's forward routes every token to the engine's experts, so (fp32 on both sides)
    # its log-probs of the sampled tokens are the engine's
    assert all(r["train/train_rollout_logprob_abs_diff"] < 1e-5 for r in train)
    for r in train:
        for layer in range(2):
            assert 1.0 <= r[f"train/moe/layer_{layer}/max_load"] <= 4.0
    evals = [r for r in records(out) if "trained_rollouts" in r]
    assert evals[-1]["eval/parity"] > evals[0]["eval/parity"]
