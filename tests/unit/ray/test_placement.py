"""Placement groups: a request larger than the cluster fails at once with what is missing and what
there is; rank i lands on bundle i; engines share the ranks' bundles only with --colocate."""

from __future__ import annotations

import time

import pytest
import ray

from slime.ray import placement
from slime.utils.errors import SlimeError
from tests.helpers.args import make_args


@pytest.fixture(scope="module")
def fake_gpu_ray():
    """A local Ray that declares 2 GPUs and 4 CPUs (placement only looks at the resource counts)."""
    ray.init(address="local", num_cpus=4, num_gpus=2, include_dashboard=False)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture
def placement_args(tiny_model_dir, tmp_path):
    def build(dp, rollout, colocate=False):
        flags = ["--actor-num-gpus-per-node", dp, "--rollout-num-gpus", rollout, "--rollout-batch-size", dp]
        return make_args(tiny_model_dir, tmp_path, *flags, *(["--colocate"] if colocate else []))

    return build


def test_more_gpus_than_exist_fails_fast_with_numbers(fake_gpu_ray, placement_args):
    _args = placement_args
    assert placement.use_gpus()
    start = time.monotonic()
    with pytest.raises(SlimeError) as ei:
        placement.create(_args(dp=2, rollout=2))  # 4 GPU bundles on a 2-GPU cluster
    assert time.monotonic() - start < 10  # no waiting for resources that cannot appear
    msg = str(ei.value)
    assert "4 bundles of {'GPU': 1, 'CPU': 1} (2 train ranks + 2 rollout devices)" in msg
    assert "need {'GPU': 4, 'CPU': 4}" in msg
    assert "the cluster has {'GPU': 2, 'CPU': 4} in total" in msg
    assert "missing {'GPU': 2}" in msg


def _bundle_cpu(pg, i):
    key = f"CPU_group_{i}_{pg.id.hex()}"
    return ray.available_resources().get(key, 0.0)


@ray.remote
class Probe:
    def ready(self):
        return True


@pytest.mark.parametrize("colocate", [True, False])
def test_rank_i_lands_on_bundle_i(fake_gpu_ray, colocate, placement_args):
    args = placement_args(dp=2, rollout=2, colocate=True) if colocate else placement_args(dp=1, rollout=1)
    p = placement.create(args)
    try:
        n_actor = args.dp_size
        assert p.actor_bundles == list(range(n_actor))
        assert p.engine_bundles == ([0, 1] if colocate else [1])  # colocated: on the ranks' own bundles
        probes = []
        for rank in range(n_actor):
            # each rank takes a distinct share of its bundle's CPU, so the bundle it sits in is visible
            probes.append(Probe.options(num_cpus=0.25 * (rank + 1), num_gpus=0,
                                        scheduling_strategy=p.strategy(p.actor_bundles[rank])).remote())
        ray.get([a.ready.remote() for a in probes])
        deadline = time.monotonic() + 10
        expected = {rank: 1 - 0.25 * (rank + 1) for rank in range(n_actor)}
        while time.monotonic() < deadline and any(
                abs(_bundle_cpu(p.pg, r) - v) > 1e-6 for r, v in expected.items()):
            time.sleep(0.2)
        for rank, v in expected.items():
            assert _bundle_cpu(p.pg, rank) == pytest.approx(v), rank
        for a in probes:
            ray.kill(a)
    finally:
        ray.util.remove_placement_group(p.pg)


def _node(ip: str, gpus: float) -> dict:
    return {"Alive": True, "NodeManagerAddress": ip, "NodeID": f"id-{ip}", "Resources": {"GPU": gpus, "CPU": 4.0}}


def test_train_ranks_spread_over_nodes_and_errors_name_the_nodes(monkeypatch, tiny_model_dir, tmp_path):
    """--actor-num-nodes N: G ranks pinned to each of N distinct nodes that have G devices; too few
    nodes, or nodes without the devices, are one line naming them."""
    gpu = placement.GPU_BUNDLE
    args = make_args(tiny_model_dir, tmp_path, "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "2",
                     "--rollout-num-gpus", "1", "--rollout-batch-size", "4")
    nodes = [_node("10.0.0.3", 2), _node("10.0.0.1", 1), _node("10.0.0.2", 4)]
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    selectors = placement._train_node_selectors(args, gpu, 5)
    # the nodes with two devices, in address order: ranks 0-1 on 10.0.0.2, ranks 2-3 on 10.0.0.3
    assert selectors == [{"ray.io/node-id": "id-10.0.0.2"}] * 2 + [{"ray.io/node-id": "id-10.0.0.3"}] * 2 + [{}]

    nodes[:] = [_node("10.0.0.1", 1), _node("10.0.0.2", 4)]
    with pytest.raises(SlimeError) as e:
        placement._train_node_selectors(args, gpu, 5)
    assert str(e.value) == ("--actor-num-nodes 2 --actor-num-gpus-per-node 2: each train node needs {'GPU': 2, 'CPU': 2}, "
                            "only 1 of 2 node(s) have it (node 10.0.0.1 has {'GPU': 1, 'CPU': 4})")

    nodes[:] = [_node("10.0.0.2", 4)]
    with pytest.raises(SlimeError, match=r"--actor-num-nodes 2: the cluster has 1 alive node\(s\) \(10.0.0.2\)"):
        placement._train_node_selectors(args, gpu, 5)
