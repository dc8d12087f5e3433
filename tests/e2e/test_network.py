"""The network surface of a run (docs/security.md): a plain `python train.py`, started the way the
README starts it (no RAY_ADDRESS, no Ray variable in its environment, no engine key given), listens
on loopback only, in every process of the run: Ray's GCS, raylet, workers and agents, the train
ranks' stores, the engines and the router."""

from __future__ import annotations

import ipaddress
import subprocess
import time

import psutil

from tests.helpers.e2e import ROOT, driver_env, records, shape_cmd


def _is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(addr, "ipv4_mapped", None)
    return (mapped or addr).is_loopback


def _listening(root: psutil.Process) -> dict[tuple[str, int], str]:
    """{(ip, port): what listens there} over `root` and all its descendants, right now."""
    found = {}
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return found
    for p in procs:
        try:
            conns = p.net_connections(kind="tcp")
            what = p.name() + " " + " ".join(p.cmdline()[1:4])
        except psutil.Error:
            continue
        for c in conns:
            if c.status == psutil.CONN_LISTEN:
                found[(c.laddr.ip, c.laddr.port)] = what
    return found


def test_a_plain_local_run_listens_on_loopback_only(task, tmp_path):
    out = tmp_path / "out"
    env = driver_env(RAY_ADDRESS=None, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=None, SLIME_ENGINE_API_KEY=None,
                     RAY_AUTH_MODE=None)
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in env and "RAY_ADDRESS" not in env
    driver = subprocess.Popen(shape_cmd(task, out, "--num-rollout", "2"), cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: dict[tuple[str, int], str] = {}
    root = psutil.Process(driver.pid)
    deadline = time.monotonic() + 600
    while driver.poll() is None and time.monotonic() < deadline:
        seen.update(_listening(root))
        time.sleep(0.3)
    output = driver.communicate(timeout=60)[0]
    assert driver.returncode == 0, output[-3000:]
    assert len(records(out)) == 2
    listeners = " | ".join(sorted(set(seen.values())))
    # the sampling saw the whole run: Ray's own servers, an engine and the router
    for part in ("gcs_server", "raylet", "slime.engines.native", "sglang::router", "TrainActor"):
        assert part in listeners, f"never saw {part} listening; saw: {listeners}"
    open_ = {f"{ip}:{port}": what for (ip, port), what in seen.items() if not _is_loopback(ip)}
    assert not open_, f"listening beyond loopback: {open_}"
    assert "Token authentication is enabled" in output  # Ray's token auth, on for the local cluster
