"""Start inference-engine servers as processes owned by Ray actors.

One `EngineServer` actor per engine: it is scheduled on the engine's placement
bundle, launches the server command as a child process bound to 127.0.0.1, waits
until `/health` answers, and kills the process on shutdown or when the actor dies.
The server's output goes to `<output-dir>/logs/engine_<rank>.log`.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from slime.arguments import cpu_threads

logger = logging.getLogger(__name__)

# Set by slime for every engine; not overridable through --sglang-*.
MANAGED_FLAGS = {"model_path", "host", "port"}


def _die_with_parent() -> None:
    """In the child before exec: get SIGKILL when the owning actor process dies (Linux), so an
    engine never outlives a crashed run."""
    try:
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def forwarded_flags(sglang_args: dict, accepted: set[str]) -> tuple[list[str], list[str]]:
    """`--sglang-*` values as server flags, for the keys the server's parser accepts.

    Returns (flags, ignored keys). `True` means a bare flag.
    """
    flags, ignored = [], []
    for key, value in sglang_args.items():
        if key not in accepted or key in MANAGED_FLAGS:
            ignored.append(key)
            continue
        flags.append("--" + key.replace("_", "-"))
        if value is not True:
            flags.append(str(value))
    return flags, ignored


def native_command(args, rank: int, host: str, port: int) -> list[str]:
    """Command line of the embedded engine for engine `rank`.

    `--sglang-*` flags whose names the native engine shares with SGLang's server
    (max-running-requests, context-length, random-seed, dtype, device, ...) are
    forwarded and override slime's defaults; the others are ignored with a warning.
    """
    from slime.engines.native.__main__ import build_parser

    accepted = {a.dest for a in build_parser()._actions}
    extra, ignored = forwarded_flags(args.sglang_args, accepted)
    if ignored:
        logger.warning("the native engine ignores %s", ", ".join(f"--sglang-{k.replace('_', '-')}" for k in ignored))
    return [
        sys.executable, "-m", "slime.engines.native",
        "--model-path", args.hf_checkpoint,
        "--host", host,
        "--port", str(port),
        "--num-threads", str(cpu_threads(args, "rollout")),
        "--random-seed", str(args.seed + rank),
        *extra,  # argparse keeps the last value, so these override the defaults above
    ]


def server_command(args, rank: int, host: str, port: int) -> list[str]:
    """The command line that serves engine `rank` for `--rollout-backend`."""
    if args.rollout_backend == "sglang":
        from slime.engines.sglang import sglang_command

        return sglang_command(args, rank, host, port)
    if args.rollout_backend == "vllm":
        from slime.engines.vllm import vllm_command

        return vllm_command(args, rank, host, port)
    return native_command(args, rank, host, port)


class EngineServer:
    """Ray actor owning one engine process."""

    def __init__(self, args, rank: int):
        self.args = args
        self.rank = rank
        self.process: subprocess.Popen | None = None
        self.url: str | None = None

    def start(self) -> str:
        return self._launch(free_port("127.0.0.1"))

    def _launch(self, port: int) -> str:
        from slime.engines.client import wait_until_healthy

        host = "127.0.0.1"
        cmd = server_command(self.args, self.rank, host, port)
        log_dir = Path(self.args.output_dir) / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"engine_{self.rank}.log"
        env = dict(os.environ, OMP_NUM_THREADS=str(cpu_threads(self.args, "rollout")), PYTHONUNBUFFERED="1")
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        self.url = f"http://{host}:{port}"
        try:
            wait_until_healthy(self.url, timeout=self.args.engine_startup_timeout, process=self.process)
        except Exception as e:
            tail = log_path.read_text(errors="replace")[-2000:]
            self.shutdown()
            raise RuntimeError(f"engine {self.rank} did not start ({e}); last output of {log_path}:\n{tail}") from None
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
            raise RuntimeError(f"engine {self.rank} was never started")
        port = int(self.url.rsplit(":", 1)[1])
        if self.process is not None:
            try:  # the whole group: a dead server may leave children behind
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait(timeout=30)
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
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        self.process = None

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass
