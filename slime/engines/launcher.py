"""Start inference-engine servers as processes owned by Ray actors.

One `EngineServer` actor per engine: it is scheduled on the engine's placement bundle, launches
the engine kind's server command (`slime.engines.kinds`) as a child process bound to its node's
address (`slime.utils.net.node_address`: 127.0.0.1 on a local run), with the run's engine key in its
environment and the run's directories and cluster addresses as the only ones it accepts
(`slime.engines.auth`), waits until `/health` answers, and kills the process on shutdown or when the actor dies. The
server's output goes to `<output-dir>/logs/engine_<rank>.log` (`engine_<model>_<rank>.log` for a
model served beside the policy, `--sglang-config`).
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from pathlib import Path

from slime.engines.auth import API_KEY_ENV
from slime.engines.kinds import engine_kind
from slime.engines.startup import ForeignListener, wait_until_healthy
from slime.utils.net import cluster_addresses, free_port, node_address
from slime.utils.processes import (
    die_with_parent,
    kill_process_group,
    stop_process_group,
)
from slime.utils.threads import cpu_threads

logger = logging.getLogger(__name__)


class EngineServer:
    """Ray actor owning one engine process."""

    def __init__(self, args, rank: int, log_name: str | None = None):
        self.args = args
        self.rank = rank
        self.log_name = log_name or f"engine_{rank}"
        self.label = self.log_name.replace("_", " ")  # "engine 0", "engine teacher 0"
        self.process: subprocess.Popen | None = None
        self.url: str | None = None

    def start(self, attempts: int = 3) -> str:
        """Launch on a free port of this node; when another process takes the port before the
        engine binds it (another server answers there, or the engine exits unable to bind), launch
        again on another."""
        for attempt in range(attempts):
            try:
                return self._launch(free_port(node_address()))
            except ForeignListener as e:
                if attempt + 1 == attempts:
                    raise RuntimeError(f"{self.label} did not start: {e}") from None
                logger.warning("%s: %s; launching on another port", self.label, e)
        raise AssertionError("unreachable")

    def _launch(self, port: int) -> str:
        host = node_address()
        kind = engine_kind(self.args)
        cmd = kind.launch_command(self.args, self.rank, host, port, cluster_addresses())
        log_dir = Path(self.args.output_dir) / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"{self.log_name}.log"
        start = log_path.stat().st_size if log_path.exists() else 0  # this launch's output follows
        env = dict(os.environ, OMP_NUM_THREADS=str(cpu_threads(self.args, "rollout")), PYTHONUNBUFFERED="1",
                   **{API_KEY_ENV: self.args.engine_api_key}, **kind.launch_env(self.args))
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                preexec_fn=die_with_parent,
            )
        self.url = f"http://{host}:{port}"
        try:
            wait_until_healthy(self.url, timeout=self.args.engine_startup_timeout, process=self.process)
        except ForeignListener:
            self.shutdown()
            raise
        except Exception as e:
            with open(log_path, "rb") as f:
                f.seek(start)
                output = f.read().decode(errors="replace")
            self.shutdown()
            if "address already in use" in output.lower():  # taken between free_port and the engine's bind
                raise ForeignListener(f"port {port} was taken before the engine could bind it") from None
            raise RuntimeError(f"{self.label} did not start ({e}); last output of {log_path}:\n{output[-2000:]}") \
                from None
        return self.url

    def is_alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def restart(self, attempts: int = 3) -> str:
        """Kill the engine (SIGKILL: it may be hung or stopped) and start it again on the same port,
        so the URL the trainer pushes weights to stays valid. It starts from --hf-checkpoint: the
        caller gives it the current weights. Returns the URL."""
        if self.url is None:
            raise RuntimeError(f"{self.label} was never started")
        port = int(self.url.rsplit(":", 1)[1])
        kill_process_group(self.process)  # the whole group: a dead server may leave children behind
        self.process = None
        for attempt in range(attempts):
            try:
                return self._launch(port)
            except RuntimeError:  # e.g. the port is not free yet
                if attempt + 1 == attempts:
                    raise
                time.sleep(1.0 + attempt)
        raise AssertionError("unreachable")

    def shutdown(self) -> None:
        stop_process_group(self.process)
        self.process = None

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass
