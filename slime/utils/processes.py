"""Child processes slime starts (engines, the router, vLLM behind its adapter): they die with their
owner and are stopped as a whole process group."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

import psutil

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """`preexec_fn` of a child: get SIGKILL when the owning process dies (Linux), so a server never
    outlives a crashed run. A no-op where prctl is missing."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


_WATCHDOG = """
import os, signal, sys
sys.stdin.buffer.read()
try:
    os.killpg(int(sys.argv[1]), signal.SIGKILL)
except ProcessLookupError:
    pass
"""
_watchdog_pipes: list[int] = []  # write ends held open for this process's lifetime


def kill_group_when_gone(pgid: int) -> subprocess.Popen:
    """Start a watchdog that SIGKILLs process group `pgid` once this process is gone, SIGKILL
    included. PR_SET_PDEATHSIG reaches only a direct child; a server's own children (vLLM's engine
    core and workers) outlive it. The watchdog reads a pipe whose only writer is this process: the
    kernel closes it when this process dies, and end-of-file is the signal."""
    read_end, write_end = os.pipe()  # non-inheritable: no other child holds the writer
    watchdog = subprocess.Popen([sys.executable, "-S", "-c", _WATCHDOG, str(pgid)], stdin=read_end,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    os.close(read_end)
    _watchdog_pipes.append(write_end)
    return watchdog


def stop_process_group(process: subprocess.Popen | None, timeout: float = 10.0) -> None:
    """SIGTERM the process group of `process` (started with `start_new_session=True`), SIGKILL it
    after `timeout` seconds; a process that already exited is left alone."""
    if process is None or process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=timeout)
    except ProcessLookupError:
        pass


def kill_process_group(process: subprocess.Popen | None, timeout: float = 30.0) -> None:
    """SIGKILL the whole group at once (a hung or stopped server may ignore SIGTERM) and reap it."""
    if process is None:
        return
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(timeout=timeout)


def listens_on(process: subprocess.Popen, port: int) -> bool | None:
    """Whether `process` or one of its descendants has a TCP socket listening on `port`: True,
    False, or None when the system does not say (no access to a process's sockets)."""
    try:
        root = psutil.Process(process.pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return False
    unknown = False
    for p in tree:
        try:
            conns = p.net_connections(kind="tcp")
        except psutil.NoSuchProcess:
            continue
        except psutil.AccessDenied:
            unknown = True
            continue
        if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in conns):
            return True
    return None if unknown else False
