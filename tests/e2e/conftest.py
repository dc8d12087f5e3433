"""End-to-end runs share one Ray cluster (a head node on loopback that every driver joins through
RAY_ADDRESS, instead of starting and stopping a private one per run) and one tiny model and task."""

from __future__ import annotations

import os

import pytest

from tests.helpers import e2e
from tests.helpers.ray_cluster import HeadNode


@pytest.fixture(scope="session", autouse=True)
def shared_ray_cluster():
    head = HeadNode(num_cpus=os.cpu_count() or 2).start()
    e2e.SHARED_RAY_ADDRESS = head.address
    try:
        yield head
    finally:
        e2e.SHARED_RAY_ADDRESS = None
        head.stop()


@pytest.fixture(scope="session")
def task(tiny_model_dir, tmp_path_factory):
    """The tiny model with the tiny task's train and eval data: {model, train, eval, work}."""
    return e2e.make_task(tiny_model_dir, tmp_path_factory.mktemp("e2e_task"))


@pytest.fixture(scope="session")
def reference_run(task, tmp_path_factory):
    """One run of the quick-start shape (`REFERENCE_FLAGS` of tests.helpers.e2e: seed 7, 4 rollouts, every weight push
    checked bit for bit) that saves its scored rollouts; the determinism, exact-resume and replay
    tests compare their runs with it. {"out": its output dir, "rollouts": the saved rollouts' path
    pattern, "stdout": what it printed}."""
    work = tmp_path_factory.mktemp("reference")
    rollouts = str(work / "rollouts" / "rollout_{rollout_id}.json")
    proc = e2e.run(e2e.shape_cmd(task, work / "out", *e2e.REFERENCE_FLAGS, "--save-debug-rollout-data", rollouts))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"out": work / "out", "rollouts": rollouts, "stdout": proc.stdout}
