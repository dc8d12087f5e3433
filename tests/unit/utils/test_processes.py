"""A server's whole process tree goes with its owner: `kill_group_when_gone` SIGKILLs a process group
once the process that started the watchdog is gone, SIGKILL of that process included."""

import os
import subprocess
import sys
import time

import psutil

OWNER = '''
import subprocess, sys, time
from slime.utils.processes import kill_group_when_gone
server = subprocess.Popen(["sh", "-c", "sleep 300 & sleep 300 & wait"], start_new_session=True)  # a server, children
kill_group_when_gone(server.pid)
print(server.pid, flush=True)
if sys.argv[1] == "exit":
    time.sleep(0.5)
    sys.exit(0)
time.sleep(300)
'''


def _group(pgid: int) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        try:
            if p.status() != psutil.STATUS_ZOMBIE and os.getpgid(p.pid) == pgid:
                out.append(p)
        except (psutil.Error, ProcessLookupError):
            pass
    return out


def _owner(how: str):
    owner = subprocess.Popen([sys.executable, "-c", OWNER, how], stdout=subprocess.PIPE, text=True)
    pgid = int(owner.stdout.readline())
    deadline = time.monotonic() + 10
    while len(_group(pgid)) < 3 and time.monotonic() < deadline:  # sh and its two sleeps
        time.sleep(0.05)
    assert len(_group(pgid)) == 3
    return owner, pgid


def _gone_within(pgid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _group(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _group(pgid)


def test_the_group_dies_when_its_owner_is_sigkilled():
    owner, pgid = _owner("sleep")
    owner.kill()
    owner.wait(timeout=10)
    assert _gone_within(pgid, 5)


def test_the_group_dies_when_its_owner_exits():
    owner, pgid = _owner("exit")
    assert owner.wait(timeout=10) == 0
    assert _gone_within(pgid, 5)
