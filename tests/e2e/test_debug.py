"""Debug modes: rollout-only runs, saved rollouts replayed without engines, weight-sync checks."""

from pathlib import Path

import pytest

from tests.helpers.e2e import REFERENCE_SHAPE, records, run, shape_cmd

pytestmark = pytest.mark.e2e


def test_replayed_rollouts_train_exactly_like_the_live_run(task, reference_run, tmp_path):
    """The reference run saved its scored rollouts (--save-debug-rollout-data) and checked every
    weight push (--check-weight-update-equal); trained on those rollouts without engines, the
    trainer gives exactly the same training metrics."""
    saved, live, replay = reference_run["rollouts"], reference_run["out"], tmp_path / "replay"
    assert sorted(p.name for p in Path(saved).parent.iterdir()) == [f"rollout_{i}.json" for i in range(4)]

    proc = run(shape_cmd(task, replay, *REFERENCE_SHAPE, "--load-debug-rollout-data", saved))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "0 engine(s)" in proc.stdout
    for a, b in zip(records(live), records(replay), strict=True):
        same = {k: v for k, v in a.items() if k.startswith("train/")}
        assert same and same == {k: b[k] for k in same}
        assert a["rollout/raw_reward"] == b["rollout/raw_reward"]


def test_rollout_only_generates_and_scores_without_training(task, tmp_path):
    out = tmp_path / "out"
    proc = run(shape_cmd(task, out, "--num-rollout", "2", "--debug-rollout-only"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = records(out)
    assert [r["rollout_id"] for r in recs] == [0, 1]
    assert all("rollout/raw_reward" in r and not any(k.startswith("train/") for k in r) for r in recs)
