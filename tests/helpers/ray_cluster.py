"""A private Ray head node on loopback for tests (`ray start --head` with its own temp dir), stopped
by killing exactly its own processes: `ray stop` would stop every Ray instance of this user on the
machine, including other test sessions'."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time

import psutil

from slime.utils.net import free_port

LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}



def processes_of(marker: str) -> list[psutil.Process]:
    """The processes whose command line names `marker` (a Ray cluster's temp dir) and all their
    descendants, never this process or its callers."""
    roots = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(marker in part for part in (p.info["cmdline"] or [])):
                roots.append(p)
        except psutil.Error:
            pass
    me = psutil.Process()
    mine = {me.pid} | {a.pid for a in me.parents()}
    roots = [p for p in roots if p.pid not in mine]
    found = {p.pid: p for p in roots}
    for p in roots:
        try:
            found.update({c.pid: c for c in p.children(recursive=True) if c.pid not in mine})
        except psutil.Error:
            pass
    return list(found.values())


def ray_env() -> dict[str, str]:
    env = dict(os.environ, **LOOPBACK_ENV)
    env.pop("RAY_ADDRESS", None)
    return env


class HeadNode:
    def __init__(self, num_cpus: int = 2):
        self.num_cpus = num_cpus
        self._pick()

    def _pick(self) -> None:
        """A fresh temp dir and ports."""
        self.temp_dir = tempfile.mkdtemp(prefix="slray", dir="/tmp")  # short: Ray's socket paths are limited
        self.port, self.dashboard_port = free_port(), free_port()

    @property
    def address(self) -> str:
        """The GCS address a driver joins (RAY_ADDRESS)."""
        return f"127.0.0.1:{self.port}"

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def start(self, timeout: float = 240, attempts: int = 3) -> "HeadNode":
        """`ray start --head`; tried again (fresh ports, a fresh temp dir) when it fails: the ports are
        free when picked but another process on the machine may take one before Ray binds it, and the
        e2e session's shared head failing once would fail every test of its pytest worker."""
        for attempt in range(attempts):
            if attempt:
                self._pick()
            error = self._start(timeout)
            if error is None:
                return self
        raise RuntimeError(f"ray start failed {attempts} times; the last:\n{error}")

    def _start(self, timeout: float) -> str | None:
        cmd = ["ray", "start", "--head", "--port", str(self.port), "--node-ip-address", "127.0.0.1",
               "--num-cpus", str(self.num_cpus), "--include-dashboard", "true",
               "--dashboard-port", str(self.dashboard_port), "--dashboard-host", "127.0.0.1",
               "--temp-dir", self.temp_dir]
        # Ray's agents and servers default to fixed ports: a second head on this machine (the e2e
        # session's shared one runs beside a test's own) would find them taken and never get a job agent
        for flag in ("--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--metrics-export-port",
                     "--runtime-env-agent-port", "--ray-client-server-port", "--node-manager-port",
                     "--object-manager-port"):
            cmd += [flag, str(free_port())]
        try:
            proc = subprocess.run(cmd, env=ray_env(), capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            return f"no answer within {timeout:.0f} s"
        if proc.returncode != 0:
            self.stop()
            return f"exit {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        return None

    def processes(self) -> list[psutil.Process]:
        return processes_of(self.temp_dir)

    def stop(self) -> None:
        procs = self.processes()
        for p in procs:
            try:
                p.send_signal(signal.SIGTERM)
            except psutil.Error:
                pass
        _, alive = psutil.wait_procs(procs, timeout=5)
        for p in alive:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(alive, timeout=10)
        time.sleep(0.5)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
