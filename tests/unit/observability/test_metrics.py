import json

import pytest

from slime.observability.metrics import MetricsLogger, console_line


def test_jsonl_and_tensorboard(tmp_path):
    logger = MetricsLogger(tmp_path)
    logger.log(0, {"rollout_id": 0, "rollout/raw_reward": 0.25, "note": "x"})
    logger.log(1, {"rollout_id": 1, "rollout/raw_reward": 0.5})
    logger.close()
    lines = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
    assert [l["rollout/raw_reward"] for l in lines] == [0.25, 0.5]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("rollout/raw_reward")] == [(0, 0.25), (1, 0.5)]


def test_wandb_offline_needs_no_network(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = MetricsLogger(tmp_path, tensorboard=False,
                           wandb_config={"project": "slime-test", "name": "t", "mode": "offline", "config": {"lr": 1}})
    logger.log(0, {"rollout_id": 0, "rollout/raw_reward": 0.25})
    logger.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    assert any(f.suffix == ".wandb" and f.stat().st_size > 0 for f in runs[0].iterdir())


def test_console_line():
    line = console_line(3, {"rollout/raw_reward": 0.5, "train/pg_loss": -0.01, "perf/rollout_time": 2.0})
    assert line == "rollout 3 | reward=0.500 | pg_loss=-0.0100 | rollout_s=2.0"


def test_resume_sets_aside_records_that_rerun(tmp_path):
    from slime.observability.metrics import set_aside_rerun_records

    path = tmp_path / "metrics.jsonl"
    recs = [{"rollout_id": 0, "trained_rollouts": 0, "eval/x": 0.1}]
    recs += [{"rollout_id": i, "rollout/raw_reward": i} for i in range(4)]
    recs.insert(3, {"rollout_id": 2, "trained_rollouts": 2, "eval/x": 0.2})  # eval after 2 rollouts
    path.write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"rollout_id": 4, "rollo')
    # checkpoint after rollout 1 -> resume at 2: rollouts 2 and 3 run again (moved aside); the eval
    # after 2 rollouts measured the checkpointed policy and is kept
    side = set_aside_rerun_records(path, start_rollout_id=2)
    kept = [json.loads(l) for l in open(path)]
    assert [(r["rollout_id"], "trained_rollouts" in r) for r in kept] == [(0, True), (0, False), (1, False), (2, True)]
    moved = side.read_text().splitlines()
    assert [json.loads(l)["rollout_id"] for l in moved[:2]] == [2, 3] and moved[2].startswith('{"rollout_id": 4')
    assert side.name == "metrics.rerun-1.jsonl"
    assert set_aside_rerun_records(path, start_rollout_id=2) is None  # idempotent


def test_wandb_key_team_and_host_reach_wandb_and_the_key_stays_out_of_the_config(tiny_model_dir, tmp_path,
                                                                                 monkeypatch):
    import sys
    import types

    from tests.helpers.args import make_args

    calls = {}
    fake = types.SimpleNamespace(login=lambda **kw: calls.setdefault("login", kw),
                                 init=lambda **kw: calls.setdefault("init", kw) and types.SimpleNamespace(
                                     log=lambda *a, **k: None, finish=lambda: None))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    args = make_args(tiny_model_dir, tmp_path, "--use-wandb", "--wandb-key", "secret-key-123",
                     "--wandb-team", "rl-team", "--wandb-host", "http://127.0.0.1:9", "--no-use-tensorboard")
    MetricsLogger.from_args(args).close()
    assert calls["login"] == {"key": "secret-key-123", "host": "http://127.0.0.1:9", "relogin": True}
    assert calls["init"]["entity"] == "rl-team"
    assert "wandb_key" not in calls["init"]["config"] and "secret-key-123" not in str(calls["init"]["config"])


def test_every_line_is_json_non_finite_values_and_a_line_cut_by_a_crash(tmp_path):
    path = tmp_path / "metrics.jsonl"
    first = MetricsLogger(tmp_path, tensorboard=False)
    first.log(0, {"rollout_id": 0, "train/loss": float("nan"), "train/grad_norm": float("inf"),
                  "nested": [1.0, float("-inf")]})
    first.close()
    with open(path, "a") as f:  # a crash in the middle of the next write
        f.write('{"rollout_id": 1, "train/lo')
    second = MetricsLogger(tmp_path, tensorboard=False)
    second.log(1, {"rollout_id": 1, "train/loss": 0.5})
    second.close()
    lines = path.read_text().splitlines()
    recs = [json.loads(line, parse_constant=lambda c: pytest.fail(f"bare {c} in {line}")) for line in lines]
    assert recs == [{"rollout_id": 0, "train/loss": "NaN", "train/grad_norm": "Infinity",
                     "nested": [1.0, "-Infinity"]},
                    {"rollout_id": 1, "train/loss": 0.5}]
    # nothing written is lost: the cut line is kept beside the file
    assert (tmp_path / "metrics.partial-1.jsonl").read_text() == '{"rollout_id": 1, "train/lo\n'
    assert MetricsLogger(tmp_path, tensorboard=False).close() is None and not (tmp_path / "metrics.partial-2.jsonl").exists()
