"""A dead or stuck actor ends the run with an error that names the stage and the actor."""

import os
import time

import pytest
import ray

from slime.utils.ray_calls import get
from slime.utils.errors import RunFailure
from tests.helpers.args import make_args


@pytest.fixture(scope="module")
def ray_session():
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@ray.remote(num_cpus=0)
class Sleeper:
    def nap(self, seconds):
        time.sleep(seconds)
        return seconds

    def pid(self):
        return os.getpid()


def test_stage_timeout_names_stage_and_actor(ray_session):
    actor = Sleeper.remote()
    start = time.monotonic()
    with pytest.raises(RunFailure, match=r"^rollout 3: RolloutManager did not finish within 1 s \(--stage-timeout\)$"):
        get(actor.nap.remote(30), stage="rollout 3", actor="RolloutManager", timeout=1)
    assert time.monotonic() - start < 10
    ray.kill(actor)


def test_dead_actor_names_stage_and_actor(ray_session):
    actor = Sleeper.remote()
    ref = actor.nap.remote(30)
    time.sleep(1)
    ray.kill(actor)
    with pytest.raises(RunFailure, match=r"^eval: RolloutManager died \("):
        get(ref, stage="eval", actor="RolloutManager", timeout=30)


def test_killed_train_rank_is_a_clear_error_within_the_timeout(tiny_model_dir, tmp_path, ray_session):
    from slime.ray.actor_group import TrainGroup, TrainGroupError

    args = make_args(tiny_model_dir, tmp_path, "--rollout-batch-size", 2, "--actor-num-gpus-per-node", 2,
                     "--stage-timeout", 60)
    group = TrainGroup(args)
    try:
        group.init()
        ray.kill(group._actors[1])
        start = time.monotonic()
        with pytest.raises(TrainGroupError, match=r"^actor rank 1: died during save \("):
            group.save(str(tmp_path / "ckpt"))
        assert time.monotonic() - start < 60
    finally:
        group.shutdown()


@ray.remote(num_cpus=0, max_concurrency=2)
class Worker:
    def __init__(self):
        self.done, self.total, self.polls = 0, 0, 0

    def work(self, steps):
        self.total = steps
        for _ in range(steps):
            time.sleep(0.3)
            self.done += 1
        return "finished"

    def progress(self):
        self.polls += 1
        return self.done, self.total

    def poll_count(self):
        return self.polls


def test_progress_is_polled_while_waiting(ray_session, capsys):
    worker = Worker.remote()
    assert get(worker.work.remote(8), "rollout 0", "Worker", timeout=60, progress=worker.progress.remote) == "finished"
    assert ray.get(worker.poll_count.remote()) >= 2
    assert "rollout 0" in capsys.readouterr().err  # the bar is drawn on stderr


@ray.remote(num_cpus=0)
class Caller:
    def call_dead_engine(self):
        from tests.helpers.http import get_json

        return get_json("http://127.0.0.1:9", "/health", timeout=2)  # nothing listens on port 9


def test_engine_failure_inside_an_actor_names_stage_and_actor(ray_session):
    with pytest.raises(RunFailure, match=r"^rollout 2: RolloutManager: .*http://127\.0\.0\.1:9") as e:
        get(Caller.remote().call_dead_engine.remote(), "rollout 2", "RolloutManager", timeout=60)
    assert "\n" not in str(e.value)


@ray.remote(num_cpus=0)
class StuckManager:
    """A RolloutManager whose calls never return."""

    def state_dict(self, rollout_id=None):
        time.sleep(3600)

    def load_state_dict(self, state):
        time.sleep(3600)


class _NoTrain:
    def save(self, path):
        pass

    def load(self, path):
        pass


def test_save_and_resume_waits_are_bounded_and_named(ray_session, tmp_path):
    from types import SimpleNamespace

    from slime import checkpoint

    args = SimpleNamespace(save=str(tmp_path / "ckpt"), load=str(tmp_path / "ckpt"), stage_timeout=2)
    manager = StuckManager.remote()
    t0 = time.monotonic()
    with pytest.raises(RunFailure, match=r"^save: RolloutManager did not finish within 2 s \(--stage-timeout\)"):
        checkpoint.save(args, 0, _NoTrain(), manager)
    assert list((tmp_path / "ckpt").iterdir()) == []  # no latest, no temporary directory left
    ckpt = tmp_path / "ckpt" / "rollout_000000"
    (ckpt / "train_state").mkdir(parents=True)
    (ckpt / "meta.json").write_text('{"rollout_id": 0}')
    (ckpt / "rollout_state.json").write_text("{}")
    (tmp_path / "ckpt" / checkpoint.LATEST).write_text("rollout_000000\n")
    with pytest.raises(RunFailure, match=r"^resume: RolloutManager did not finish within 2 s"):
        checkpoint.load(args, _NoTrain(), manager)
    assert time.monotonic() - t0 < 30
    ray.kill(manager)


def test_every_ray_get_in_slime_is_bounded():
    """slime waits on actors through slime.utils.ray_calls.get (a stage, an actor, a timeout) or with
    a timeout of its own: no ray.get without one."""
    import ast
    from pathlib import Path

    repo = Path(__file__).resolve().parents[3]
    bare = []
    for path in [*(repo / "slime").rglob("*.py"), *repo.glob("*.py"), *(repo / "tools").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "ray"
                    and not any(k.arg == "timeout" for k in node.keywords)):
                bare.append(f"{path.relative_to(repo)}:{node.lineno}")
    assert bare == [], bare
