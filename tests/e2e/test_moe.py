"""End-to-end: GRPO on a tiny random Qwen3-MoE with rollout routing replay and the load-balancing
loss (examples/quickstart.py --tiny --moe): the reward rises, the trainer's log-probs equal the
engine's (the engine's experts are replayed), and expert usage is logged per layer."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

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


def test_rollout_routing_replay_under_async_training_partial_rollouts_and_two_ranks(tmp_path):
    """R3 with train_async.py (the trainer one version ahead of the engines), partial rollouts (slow
    groups aborted once enough fast ones are done and finished in a later rollout: see
    tests/helpers/slow_or_fast.py) and two data-parallel train ranks: every trained sample carries
    the engine's routing of its whole sequence, resumed ones included, and the trainer replays it on
    its rank (expert usage of every layer logged)."""
    from quickstart import tiny_setup
    from tiny_task import make_tiny_task

    model, _ = tiny_setup(tmp_path / "setup", moe=True)
    train, _ = make_tiny_task(tmp_path / "data", seed=0)
    out, dumps = tmp_path / "out", tmp_path / "rollouts" / "r{rollout_id}.json"
    proc = run([sys.executable, "train_async.py", "--hf-checkpoint", str(model), "--prompt-data", str(train),
                "--input-key", "prompt", "--label-key", "label", "--apply-chat-template",
                "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "1",
                "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--global-batch-size", "8",
                "--micro-batch-size", "4", "--num-rollout", "3", "--over-sampling-batch-size", "8", "--partial-rollout",
                "--custom-generate-function-path", "tests/helpers/slow_or_fast.py:generate",
                "--custom-rm-path", "tests/helpers/slow_or_fast.py:reward", "--rollout-max-response-len", "480",
                "--use-rollout-routing-replay", "--lr", "1e-3",
                "--save-debug-rollout-data", str(dumps), "--output-dir", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = records(out)
    assert [r["rollout_id"] for r in recs] == [0, 1, 2]
    assert recs[0]["rollout/aborted_groups"] >= 1  # slow groups aborted in the first rollout
    for r in recs:
        for layer in range(2):  # the tiny MoE: 2 layers, 4 experts, top-2
            assert 1.0 <= r[f"train/moe/layer_{layer}/max_load"] <= 4.0
    slow = 0
    for i in range(3):
        for s in json.loads(Path(str(dumps).format(rollout_id=i)).read_text())["samples"]:
            routed = s["rollout_routed_experts"]
            # one row per token the engine saw (all but the last), 2 layers x top-2 experts per row: a
            # slow sample aborted mid-response and finished in a later rollout has the rows of both parts
            assert routed["shape"] == [len(s["tokens"]) - 1, 4], (routed["shape"], len(s["tokens"]))
            slow += s["response_length"] > 2
    assert slow >= 2  # slow samples (aborted, then finished in a later rollout) were trained on
