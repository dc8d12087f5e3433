"""End-to-end asynchronous training on the tiny model with a long-tail response-length workload
(benchmarks/long_tail.py): train_async.py, fully async rollout, partial rollout with over-sampling,
and resuming with the staleness counters and the partial-rollout buffer."""

import json
import shutil
import sys
from pathlib import Path

import pytest

from tests.helpers.e2e import records, run

pytestmark = pytest.mark.e2e


def cmd(task, out, script="train_async.py", *extra):  # noqa: F811
    return [sys.executable, script, "--hf-checkpoint", task["model"], "--prompt-data", task["train"],
            "--input-key", "prompt", "--label-key", "label", "--apply-chat-template",
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--global-batch-size", "8",
            "--micro-batch-size", "8", "--num-rollout", "4", "--rollout-max-response-len", "24",
            "--custom-generate-function-path", "benchmarks/long_tail.py:generate", "--lr", "1e-3", "--use-tis",
            "--output-dir", str(out), *map(str, extra)]


def _prompts(template: str, rollout_ids) -> list[str]:
    """The prompts a run trained on in each rollout (one per group), from --save-debug-rollout-data."""
    out = []
    for i in rollout_ids:
        samples = json.loads(Path(template.format(rollout_id=i)).read_text())["samples"]
        out += [json.dumps(s["prompt"]) for s in samples if s["index"] % 2 == 0]
    return out


def test_train_async_is_one_version_stale_and_resumes_without_skipping_prompts(task, tmp_path):  # noqa: F811
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    rollouts = str(tmp_path / "rollouts" / "r{rollout_id}.json")
    r = run(cmd(task, out, "train_async.py", "--save", ckpt, "--save-interval", 1, "--save-debug-rollout-data",
                rollouts))
    assert r.returncode == 0, r.stderr[-3000:]
    recs = records(out)
    assert [rec["rollout_id"] for rec in recs] == [0, 1, 2, 3]
    # rollout 1's checkpoint was written while rollout 2 was already generating (with its prompts
    # drawn); a run killed right then resumes from it: the state that checkpoint holds is the one
    # from before rollout 2 drew, so the resumed run trains on rollout 2's and 3's prompts, none skipped
    killed = tmp_path / "killed"
    shutil.copytree(ckpt / "rollout_000001", killed / "rollout_000001")
    (killed / "latest").write_text("rollout_000001\n")
    resumed_rollouts = str(tmp_path / "resumed" / "r{rollout_id}.json")
    r = run(cmd(task, tmp_path / "resumed_out", "train_async.py", "--load", killed, "--save", killed,
                "--save-interval", 1, "--save-debug-rollout-data", resumed_rollouts))
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {killed / 'rollout_000001'}" in r.stdout
    uninterrupted, lineage = _prompts(rollouts, range(4)), _prompts(rollouts, range(2)) + _prompts(resumed_rollouts,
                                                                                                 (2, 3))
    assert lineage == uninterrupted and len(set(lineage)) == 16  # every prompt once, in the data's order
    # rollout 0 generates with the initial weights before any training; every later rollout was
    # generated while the previous one trained, so with the weights one version behind
    assert recs[0]["rollout/staleness/max"] == 0.0
    for rec in recs[1:]:
        assert rec["rollout/staleness/mean"] == 1.0 and rec["rollout/staleness/count_1"] == 8.0
        assert 0.0 <= rec["perf/wait_time_ratio"] < 1.0
        assert rec["train/train_rollout_logprob_abs_diff"] > 0  # the trainer is ahead of the rollout policy


def test_fully_async_respects_max_staleness(task, tmp_path):  # noqa: F811
    out = tmp_path / "out"
    r = run(cmd(task, out, "train_async.py", "--fully-async", "--async-groups-in-flight", 6, "--max-staleness", 1))
    assert r.returncode == 0, r.stderr[-3000:]
    recs = records(out)
    assert len(recs) == 4
    assert all(rec["rollout/staleness/max"] <= 1.0 for rec in recs)
    assert all(rec["rollout/reward_failures"] == 0.0 for rec in recs)


# slow first requests take the whole budget (480 tokens of the tiny model's 512) and are aborted
SLOW_OR_FAST = ["--custom-generate-function-path", "tests/helpers/slow_or_fast.py:generate",
                "--custom-rm-path", "tests/helpers/slow_or_fast.py:reward", "--rollout-max-response-len", 480]


def test_partial_rollout_aborts_and_resumes_then_survives_a_resume(task, tmp_path):  # noqa: F811
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    flags = ["--over-sampling-batch-size", 8, "--partial-rollout", "--mask-offpolicy-in-partial-rollout",
             "--save", ckpt, "--save-interval", 1, *SLOW_OR_FAST]
    r = run(cmd(task, out, "train.py", *flags, "--num-rollout", 2))  # argparse keeps the last --num-rollout
    assert r.returncode == 0, r.stderr[-3000:]
    recs = records(out)
    # 8 groups launched for 4 needed: the slow ones are aborted and wait in the buffer
    assert recs[0]["rollout/aborted_groups"] >= 1
    assert recs[1]["rollout/staleness/count_1"] >= 1  # groups carried over from rollout 0
    from slime.checkpoint import checkpoint_dir

    state = json.loads((checkpoint_dir(ckpt, 1) / "rollout_state.json").read_text())
    buffer = state["data_source"]["buffer"]
    assert buffer and all(s["weight_versions"] for g in buffer for s in g if s["response_length"])
    assert "staleness" in state

    r = run(cmd(task, out, "train.py", *flags, "--load", ckpt))
    assert r.returncode == 0, r.stderr[-3000:]
    recs = records(out)
    assert [rec["rollout_id"] for rec in recs] == [0, 1, 2, 3]
    assert recs[2]["rollout/staleness/max"] >= 1.0  # the restored buffer's groups are used
