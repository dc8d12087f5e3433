"""Start `python -m slime.engines.native` on a free loopback port for a test module."""

from __future__ import annotations

import contextlib
import subprocess
import sys

from slime.engines.startup import wait_until_healthy
from slime.utils.net import free_port


@contextlib.contextmanager
def native_server(model_dir: str, log_path, *extra: str):
    port = free_port()
    with open(log_path, "wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "slime.engines.native", "--model-path", model_dir, "--port", str(port),
             "--num-threads", "1", "--random-seed", "0", *extra],
            stdout=f, stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(url, timeout=120, process=proc)
        yield url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
