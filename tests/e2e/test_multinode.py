"""A run that spans two nodes: `scripts/local_cluster.sh` starts a Ray cluster of two nodes on this
machine (the head on 127.0.0.2, the other on 127.0.0.3, one declared GPU each, token auth on) and
`ray job submit` runs GRPO on it in both layouts: the train rank and the engine on different
nodes (weights by a broadcast group across nodes), and two train ranks on two nodes
(`--actor-num-nodes 2`, engines colocated). Every address slime hands out is a node's: no slime
process listens on 127.0.0.1 or reaches a slime server there, so a leftover hard-coded loopback
fails here (Ray's own workers talk to their node's agents on 127.0.0.1; those are not counted)."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers.e2e import ROOT, records
from tests.helpers.ray_cluster import processes_of

SCRIPT = ROOT / "scripts" / "local_cluster.sh"
NODES = {"127.0.0.2", "127.0.0.3"}
EXCLUDES = [".venv", ".venv-vllm", ".git", "outputs", "*.egg-info", "__pycache__", ".pytest_cache"]
# the processes that are slime's (Ray's own daemons and idle workers bind what `ray start` binds)
SLIME_PROCESSES = ("slime.engines.native", "sglang::router", "ray::TrainActor", "ray::EngineServer",
                   "ray::RolloutManager")

REWARD = '''
def reward(args, sample):
    """A signal a random tiny model can climb: the share of digits in its response."""
    text = sample.response or ""
    return sum(c.isdigit() for c in text) / max(1, len(text))
'''


def _cluster_env() -> dict[str, str]:
    env = dict(os.environ, PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]))
    for k in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_AUTH_MODE", "SLIME_ENGINE_API_KEY"):
        env.pop(k, None)
    return env


@pytest.fixture(scope="module")
def cluster():
    work = tempfile.mkdtemp(prefix="slmn", dir="/tmp")  # short: Ray's socket paths are limited
    env = _cluster_env()
    try:
        started = subprocess.run(["bash", str(SCRIPT), "start", work, "2", "1"], env=env, capture_output=True,
                                 text=True, timeout=300)
        assert started.returncode == 0, started.stderr[-3000:]
        exports = started.stdout.strip().splitlines()[-1].removeprefix("export ").split()
        env.update(dict(kv.split("=", 1) for kv in exports))
        yield {"dir": work, "env": env}
    finally:
        subprocess.run(["bash", str(SCRIPT), "stop", work], env=env, timeout=120)
        assert not _cluster_processes(work)
        subprocess.run(["rm", "-rf", work])


def _cluster_processes(work: str) -> list[psutil.Process]:
    return processes_of(work + "/ray")


def _ip(addr: str) -> str:
    ip = ipaddress.ip_address(addr.split("%")[0])
    return str(getattr(ip, "ipv4_mapped", None) or ip)


def _sample(work: str, seen: dict) -> None:
    """Record every listening socket and every outgoing connection of slime's processes. Ray's own
    daemons and workers are not slime's: a Ray worker reports to its node's agent on 127.0.0.1 and
    talks to the owners of the objects and actors it holds (Ray's design, and ports Ray picks at
    run time), so the check below is about slime's servers: the ports slime's processes listen on."""
    for p in _cluster_processes(work):
        try:
            what = " ".join(p.cmdline()[:3])
            if not any(s in what for s in SLIME_PROCESSES):
                continue
            conns = p.net_connections(kind="tcp")
        except psutil.Error:
            continue
        listening = {c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN}
        for c in conns:
            if c.status == psutil.CONN_LISTEN:
                seen.setdefault("listen", set()).add((_ip(c.laddr.ip), what[:60]))
                seen.setdefault("slime_ports", {})[c.laddr.port] = what[:60]
            elif c.raddr and c.laddr.port not in listening:  # slime connected out
                seen.setdefault("connect", set()).add((_ip(c.raddr.ip), c.raddr.port, what[:60]))


def _submit(cluster, task, out: Path, *flags: str):
    reward = out.parent / "reward.py"
    reward.write_text(REWARD)
    runtime_env = {"env_vars": {"OMP_NUM_THREADS": "1"}, "excludes": EXCLUDES}
    cmd = ["ray", "job", "submit", "--working-dir", str(ROOT), "--runtime-env-json", json.dumps(runtime_env), "--",
           "python", "train.py", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
           "--global-batch-size", "16", "--num-rollout", "3", "--prompt-data", task["train"], "--input-key", "prompt",
           "--label-key", "label", "--apply-chat-template", "--hf-checkpoint", task["model"],
           "--rollout-max-response-len", "8", "--rollout-temperature", "1.0", "--lr", "1e-2",
           "--micro-batch-size", "4", "--seed", "7", "--custom-rm-path", f"{reward}:reward",
           "--check-weight-update-equal", "--output-dir", str(out), *flags]
    seen: dict = {}
    proc = subprocess.Popen(cmd, env=cluster["env"], cwd=out.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    deadline = time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        _sample(cluster["dir"], seen)
        time.sleep(0.3)
    log = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0 and "succeeded" in log, log[-4000:]
    placed = re.search(r"slime: \d+ engine\(s\) at (.+?); \d+ train rank\(s\) on ([^;]+);", log)
    assert placed, log[-3000:]
    engines = {u.strip().split("//")[1].rsplit(":", 1)[0] for u in placed.group(1).split(",")}
    ranks = {a.strip() for a in placed.group(2).split(",")}
    return log, engines, ranks, seen


def _learned_and_closed(out: Path, seen: dict) -> None:
    recs = records(out)
    assert [r["rollout_id"] for r in recs] == [0, 1, 2]
    # every push reached the engines bit for bit (--check-weight-update-equal) and they served it
    assert any(r["train/grad_norm"] > 0 for r in recs), recs
    assert all(r["train/train_rollout_logprob_abs_diff"] < 1e-3 for r in recs), recs
    listen = {ip for ip, _ in seen["listen"]}
    assert listen <= NODES | {"0.0.0.0", "::"} and "127.0.0.1" not in listen, seen["listen"]
    # slime's own servers bind a node's address, never every interface
    for ip, what in seen["listen"]:
        if "slime.engines.native" in what or "sglang::router" in what:
            assert ip in NODES, (ip, what)
    # slime's processes reach slime's servers (engines, router, stores) at a node's address, never
    # 127.0.0.1: a client that did would only work while every process shares one machine
    ports = seen["slime_ports"]
    assert any(ip in NODES and port in ports for ip, port, _ in seen["connect"]), (seen["connect"], ports)
    to_loopback = sorted(x for x in seen["connect"] if x[0] == "127.0.0.1" and x[1] in ports)
    assert not to_loopback, [(x, "listened on by " + ports[x[1]]) for x in to_loopback]


def test_train_rank_and_engine_on_different_nodes(cluster, task, tmp_path):
    out = tmp_path / "out"
    log, engines, ranks, seen = _submit(cluster, task, out, "--actor-num-nodes", "1",
                                        "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1")
    assert len(engines) == 1 and len(ranks) == 1 and engines.isdisjoint(ranks) and engines | ranks == NODES
    assert "weights by distributed" in log  # one broadcast group across the two nodes
    _learned_and_closed(out, seen)


def test_two_train_ranks_on_two_nodes(cluster, task, tmp_path):
    out = tmp_path / "out"
    log, engines, ranks, seen = _submit(cluster, task, out, "--actor-num-nodes", "2",
                                        "--actor-num-gpus-per-node", "1", "--colocate")
    assert ranks == NODES and engines == NODES  # one rank and its colocated engine on each node
    _learned_and_closed(out, seen)


def test_more_train_nodes_than_the_cluster_has_is_one_line(cluster, task, tmp_path):
    out = tmp_path / "out"
    cmd = ["ray", "job", "submit", "--working-dir", str(ROOT),
           "--runtime-env-json", json.dumps({"excludes": EXCLUDES}), "--",
           "python", "train.py", "--actor-num-nodes", "3", "--actor-num-gpus-per-node", "1", "--colocate",
           "--rollout-batch-size", "3", "--n-samples-per-prompt", "4", "--global-batch-size", "12",
           "--num-rollout", "1",
           "--prompt-data", task["train"], "--input-key", "prompt", "--apply-chat-template",
           "--hf-checkpoint", task["model"],
           "--output-dir", str(out)]
    proc = subprocess.run(cmd, env=cluster["env"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "--actor-num-nodes 3: the cluster has 2 alive node(s) (127.0.0.2, 127.0.0.3)" in log, log[-3000:]
