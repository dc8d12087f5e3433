"""train.py with `--train-backend megatron` on the tiny task (megatron-core on CPU, gloo). Skipped
without megatron-core."""

import pytest

from tests.helpers.e2e import records, run, shape_cmd

pytest.importorskip("megatron.core")


def test_train_py_grpo_with_megatron(task, tmp_path):
    out = tmp_path / "out"
    # an entropy bonus gives every step a gradient, also one whose groups all earn the same reward
    cmd = shape_cmd(task, out, "--train-backend", "megatron", "--seed", "3", "--entropy-coef", "0.01")
    cmd[cmd.index("--num-rollout") + 1] = "2"
    proc = run(cmd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rs = [r for r in records(out) if "train/loss" in r]
    assert [r["rollout_id"] for r in rs] == [0, 1]
    for r in rs:
        # the engine's log-probs (native engine, HF weights pushed by the megatron trainer) vs the trainer's
        assert r["train/train_rollout_logprob_abs_diff"] < 1e-4, r  # observed ~2e-7
        assert r["train/grad_norm"] > 0
    # rollout 1 was generated with the weights the trainer pushed after its update: the policy has
    # moved from the reference (KL > 0) and the engine still scores like the trainer
    assert rs[1]["train/kl_loss"] > 0
    assert rs[1]["train/lr"] == pytest.approx(1e-3)
