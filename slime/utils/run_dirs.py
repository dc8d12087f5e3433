"""A run's temporary directories (weight-push and adapter buckets, a released engine's weight stash,
offloaded train state, the vLLM adapter's socket and weights): held while used, removed when the
last holder lets go, and removed by the next start after a SIGKILL.

Each directory holds a lock file, `.slime-held`, on which every process that uses the directory
keeps a shared `flock`. The kernel drops a process's locks when it dies, SIGKILL included, so a
directory whose lock nobody holds belongs to no live process: `sweep(base)` removes those of this
user (run by the driver at start, and once per process and base before a new directory is made).
A directory without the lock file (made by something else, or being made right now) is never
touched. `release(path)` (normal exit) removes the directory when no other process still holds it.
"""

from __future__ import annotations

import atexit
import fcntl
import os
import shutil
import tempfile
import threading

PREFIX = "slime-"
LOCK_FILE = ".slime-held"

_held: dict[str, int] = {}  # directory -> the fd of its lock file (shared lock)
_swept: set[str] = set()
_lock = threading.Lock()


def shm_or_tmp() -> str:
    """/dev/shm where it is writable (RAM, Linux), else the system temp dir."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def hold(path: str) -> str:
    """Hold the existing directory `path` for this process (shared lock on its lock file, created
    locked and then renamed into place so a sweep never sees it unlocked). Returns `path`."""
    path = os.path.abspath(path)
    with _lock:
        if path in _held:
            return path
        lock_path = os.path.join(path, LOCK_FILE)
        try:
            fd = os.open(lock_path, os.O_RDWR)
        except FileNotFoundError:
            fd_tmp, tmp = tempfile.mkstemp(prefix=".slime-held-", dir=path)
            fcntl.flock(fd_tmp, fcntl.LOCK_SH)
            os.replace(tmp, lock_path)
            fd = fd_tmp
        else:
            fcntl.flock(fd, fcntl.LOCK_SH)
        _held[path] = fd
    return path


def private_dir(prefix: str, base: str | None = None) -> str:
    """A new directory `base/prefix*` of this user only (0700), held by this process; stale
    directories under `base` are swept first (once per process)."""
    assert prefix.startswith(PREFIX), prefix
    base = base or tempfile.gettempdir()
    sweep_once(base)
    return hold(tempfile.mkdtemp(prefix=prefix, dir=base))


def release(path: str) -> bool:
    """Stop holding `path`; remove it when no other process holds it. True when removed."""
    path = os.path.abspath(path)
    with _lock:
        fd = _held.pop(path, None)
    if fd is None:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # only the last holder gets it
    except BlockingIOError:
        os.close(fd)
        return False
    shutil.rmtree(path, ignore_errors=True)
    os.close(fd)
    return True


def sweep(base: str) -> list[str]:
    """Remove this user's `slime-*` directories under `base` whose lock no live process holds;
    returns what was removed."""
    removed = []
    try:
        entries = list(os.scandir(base))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(PREFIX):
            continue
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
            fd = os.open(os.path.join(entry.path, LOCK_FILE), os.O_RDWR)
        except OSError:  # not ours, not a held directory, or gone meanwhile
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a live process holds it
            os.close(fd)
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        os.close(fd)
        removed.append(entry.path)
    return removed


def sweep_once(base: str) -> list[str]:
    """`sweep(base)` the first time this process asks for `base`."""
    base = os.path.abspath(base)
    with _lock:
        if base in _swept:
            return []
        _swept.add(base)
    return sweep(base)


@atexit.register
def _release_all() -> None:
    for path in list(_held):
        release(path)
