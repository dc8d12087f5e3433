"""LoRA end to end (docs/lora.md) on the tiny model: a GRPO run whose reward rises while the engine
serves the base plus the pushed adapter; both modes with colocated ranks and engines;
train_async.py pushing bf16 adapters from two ranks to two bf16 engines behind the router; and an engine killed
and restarted under --use-fault-tolerance, which gets the base plus the current adapter. In the
synchronous runs the engine's log-probs of the sampled tokens equal the trainer's after every push
(`train/train_rollout_logprob_abs_diff`, fp32), which fails when an engine serves anything but the
trainer's policy."""

from __future__ import annotations

import signal
import statistics
import sys

import pytest

from tests.helpers.e2e import records, run, shape_cmd
from tests.helpers.fault import NUM_ROLLOUT, run_with_fault

pytestmark = pytest.mark.e2e

LP = "train/train_rollout_logprob_abs_diff"


def _train(out):
    return [r for r in records(out) if "rollout/raw_reward" in r]


def test_quickstart_tiny_lora_learns_with_the_adapter_pushed_each_rollout(tmp_path):
    out = tmp_path / "qs"
    proc = run([sys.executable, "examples/quickstart.py", "--tiny", "--lora", "--output-dir", str(out), "--",
                "--check-weight-update-equal"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "weights by a LoRA adapter (peft directory)" in proc.stdout
    train = _train(out)
    rewards = [r["rollout/raw_reward"] for r in train]
    assert statistics.fmean(rewards[-6:]) > statistics.fmean(rewards[:3]) + 0.05, rewards
    assert all(r[LP] < 1e-5 for r in train), [r[LP] for r in train]
    # every push is the adapter alone: rank 16 on the 14 linear layers of the tiny model, fp32
    pushed = {r["weights/bytes"] for r in train}
    assert pushed == {4 * 16 * 2 * (2 * (128 + 128) + 2 * (128 + 64) + 3 * (128 + 256))}, pushed


@pytest.mark.parametrize("sync", ["adapter", "merged"])
def test_lora_colocated_on_two_ranks(task, tmp_path, sync):
    out = tmp_path / sync
    proc = run(shape_cmd(task, out, "--lora-rank", "8", "--lora-sync", sync, "--colocate",
                         "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2", "--check-weight-update-equal"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "colocated" in proc.stdout
    assert ("weights by a LoRA adapter" if sync == "adapter" else "weights by disk") in proc.stdout
    train = _train(out)
    assert [r["rollout_id"] for r in train] == [0, 1, 2]
    assert all(r[LP] < 1e-5 for r in train), [r[LP] for r in train]
    assert train[-1]["train/grad_norm"] > 0


def test_async_bf16_lora_on_two_ranks_and_two_engines(task, tmp_path):
    out = tmp_path / "async"
    cmd = shape_cmd(task, out, "--lora-rank", "8", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2",
                    "--bf16")
    cmd[1] = "train_async.py"
    proc = run(cmd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 engine(s)" in proc.stdout and "2 train rank(s)" in proc.stdout
    train = _train(out)
    assert [r["rollout_id"] for r in train] == [0, 1, 2]
    assert [r["rollout/staleness/mean"] for r in train] == [0.0, 1.0, 1.0]
    # the adapter in the bf16 engines' dtype: 2 bytes per element
    assert {r["weights/bytes"] for r in train} == {2 * 8 * 2 * (2 * (128 + 128) + 2 * (128 + 64) + 3 * (128 + 256))}
    assert train[0][LP] < 5e-3  # generated and trained with the same (initial) policy, bf16 on both sides


def test_lora_adapter_reaches_a_restarted_engine(task, tmp_path):
    seen = run_with_fault(task, tmp_path / "kill", signal.SIGKILL, "train.py", extra=["--lora-rank", "8"])
    assert seen["returncode"] == 0, seen["output"][-4000:]
    assert "weights by a LoRA adapter" in seen["output"]
    train = [r for r in seen["records"] if "rollout/raw_reward" in r]
    assert [r["rollout_id"] for r in train] == list(range(NUM_ROLLOUT))
    assert sum(r["rollout/engine_restarts"] for r in train) >= 1
    assert seen["restarted_pid"] not in (None, seen["killed_pid"])
    # both engines, the restarted one too, served exactly the trainer's policy (base + current adapter)
    assert all(r[LP] < 1e-5 for r in train), [r[LP] for r in train]
