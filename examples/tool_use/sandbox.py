"""Run untrusted code (the model's Python) in a bubblewrap (`bwrap`) sandbox, or refuse to.

`run(argv, limits)` runs `argv` inside `bwrap` with

- every namespace unshared (`--unshare-all`): no network (a fresh network namespace with only its own
  loopback), its own PID (the command is its PID 1, `--as-pid-1`), IPC, UTS, cgroup and user namespaces,
  no capabilities (`--cap-drop ALL`);
- a read-only view of the system: `/usr` (and the `/bin`, `/lib*` links into it), a few `/etc` files
  the dynamic loader needs, and the Python installation of the interpreter (read-only); nothing of
  `$HOME`, the repository, the virtual environment or the rest of the file system; the root is remounted
  read-only; a private `/tmp` and a private, empty working directory `/work` (the current directory),
  both size-limited tmpfs (`disk_mb` each, as is /dev/shm: memory, gone when the run ends);
- a seccomp filter that refuses new processes (fork, vfork, clone without CLONE_THREAD, clone3) and
  namespace, mount, ptrace, keyring and BPF calls; threads are allowed;
- rlimits set in the child before `bwrap` runs: RLIMIT_AS (memory), RLIMIT_CPU, RLIMIT_FSIZE (largest
  file written), RLIMIT_CORE=0; and RLIMIT_NPROC set inside the sandbox (`python_argv`), so that it
  counts only the sandbox's own threads (the kernel does not apply it to root: there the seccomp
  filter and RLIMIT_AS bound processes and threads);
- stdout read in chunks and cut at `max_output` bytes (the run is killed once over it), a bounded
  stderr tail, a wall-clock timeout;
- the whole process tree killed with SIGKILL when `run` returns, times out, passes the output cap or
  is cancelled: first bwrap's child, the sandbox's PID 1 (the kernel then kills everything in its PID
  namespace, and bwrap reaps it: no zombie is left to the host's init), then bwrap's process group
  (`--die-with-parent` covers a bwrap killed from outside).

`unavailable()` says why there is no sandbox (no `bwrap` on PATH, or its start-up probe failed), or
None. `run(..., sandbox=False)` runs without one (rlimits, timeout and output cap only): unsafe.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import platform
import shutil
import signal
import struct
import subprocess
import sys
import tempfile

WORKDIR = "/work"  # the private working directory, as the sandboxed code sees it
INSTALL_HINT = "apt-get install bubblewrap"
STDERR_TAIL = 4096  # bytes of stderr kept (the last ones)
ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": WORKDIR, "TMPDIR": "/tmp"}
_ETC = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "alternatives")


@dataclasses.dataclass(frozen=True)
class Limits:
    timeout: float = 5.0  # wall-clock seconds
    memory_mb: int = 256  # RLIMIT_AS
    cpu_seconds: int = 2  # RLIMIT_CPU
    file_mb: int = 16  # RLIMIT_FSIZE: no file written may grow past this
    disk_mb: int = 32  # size of each of the sandbox's tmpfs: /tmp, /work, /dev/shm
    threads: int = 32  # RLIMIT_NPROC inside the sandbox (python_argv)
    max_output: int = 1000  # bytes of stdout kept; the run is killed once past it


@dataclasses.dataclass
class Result:
    returncode: int | None  # None: timed out; < 0: killed by that signal
    stdout: bytes
    stderr: bytes  # the last STDERR_TAIL bytes
    truncated: bool  # stdout went past max_output (and the run was killed)


def interpreter() -> str:
    """The real Python interpreter behind sys.executable (outside any virtual environment)."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


_BOOT = ("import resource as r, sys\nn = int(sys.argv.pop(1))\nif n: r.setrlimit(r.RLIMIT_NPROC, (n, n))\n"
         "code = sys.argv[1]; del r, n; sys.argv[1:] = []\n"
         "exec(compile(code, '<string>', 'exec'), {'__name__': '__main__', '__builtins__': __builtins__})")


def python_argv(code: str, threads: int = 0, python: str | None = None) -> list[str]:
    """`python -I` running `code` after setting RLIMIT_NPROC to `threads` (0: unchanged)."""
    return [python or interpreter(), "-I", "-c", _BOOT, str(int(threads)), str(code)]


# ------------------------------------------------------------------------------------ seccomp

_ARCH = {  # audit arch, x32 bit, syscalls: fork/vfork/clone3 ... refused, clone checked for CLONE_THREAD
    "x86_64": (0xC000003E, 0x40000000, 56, {"fork": 57, "vfork": 58, "unshare": 272, "setns": 308, "mount": 165,
                                            "ptrace": 101, "keyctl": 250, "add_key": 248, "request_key": 249,
                                            "bpf": 321, "perf_event_open": 298, "userfaultfd": 323,
                                            "io_uring_setup": 425, "open_tree": 428, "fsopen": 430}),
    "aarch64": (0xC00000B7, 0, 220, {"unshare": 97, "setns": 268, "mount": 40, "ptrace": 117, "keyctl": 219,
                                     "add_key": 217, "request_key": 218, "bpf": 280, "perf_event_open": 241,
                                     "userfaultfd": 282, "io_uring_setup": 425, "open_tree": 428, "fsopen": 430}),
}
_CLONE3, _CLONE_THREAD, _EPERM, _ENOSYS = 435, 0x10000, 1, 38
_ALLOW, _ERRNO, _KILL = 0x7FFF0000, 0x00050000, 0x80000000


def seccomp_filter() -> bytes | None:
    """A classic-BPF seccomp program (bwrap --seccomp) for this machine, or None for an unknown arch."""
    arch = _ARCH.get(platform.machine())
    if arch is None:
        return None
    audit, x32, clone, refused = arch
    ins = []  # (code, jt, jf, k); jumps are filled in relative to the return instructions at the end

    def op(code, k, jt=0, jf=0):
        ins.append([code, jt, jf, k])

    op(0x20, 4)  # ld arch
    op(0x15, audit, 0, "kill")  # jeq
    op(0x20, 0)  # ld nr
    if x32:
        op(0x35, x32, "kill", 0)  # jge: the x32 ABI
    for nr in refused.values():
        op(0x15, nr, "eperm", 0)
    op(0x15, _CLONE3, "enosys", 0)  # libc falls back to clone, which is checked
    op(0x15, clone, 0, "allow")
    op(0x20, 16)  # ld the low half of args[0] (flags)
    op(0x45, _CLONE_THREAD, "allow", "eperm")  # jset
    ends = {"allow": _ALLOW, "eperm": _ERRNO | _EPERM, "enosys": _ERRNO | _ENOSYS, "kill": _KILL}
    at = {name: len(ins) + i for i, name in enumerate(ends)}
    for i, (code, jt, jf, k) in enumerate(ins):
        ins[i][1] = at[jt] - i - 1 if isinstance(jt, str) else jt
        ins[i][2] = at[jf] - i - 1 if isinstance(jf, str) else jf
    ins += [[0x06, 0, 0, k] for k in ends.values()]
    return b"".join(struct.pack("=HBBI", *i) for i in ins)


# ------------------------------------------------------------------------------------ bwrap

def bwrap_argv(bwrap: str, limits: Limits, seccomp_fd: int | None = None) -> list[str]:
    """The bwrap command line, up to the sandboxed command."""
    size = str(limits.disk_mb << 20)
    argv = [bwrap, "--unshare-all", "--as-pid-1", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
            "--ro-bind", "/usr", "/usr", "--proc", "/proc", "--dev", "/dev"]
    argv += [a for d in ("/tmp", WORKDIR, "/dev/shm") for a in ("--size", size, "--tmpfs", d)]
    for d in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(d):
            argv += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            argv += ["--ro-bind", d, d]
    argv += [a for name in _ETC for a in ("--ro-bind-try", f"/etc/{name}", f"/etc/{name}")]
    python = interpreter()
    for prefix in sorted({os.path.realpath(sys.base_prefix), os.path.dirname(os.path.dirname(python))}):
        if not (prefix + "/").startswith("/usr/"):
            argv += ["--ro-bind", prefix, prefix]
    argv += ["--remount-ro", "/", "--chdir", WORKDIR, "--clearenv"]
    argv += [a for k, v in ENV.items() for a in ("--setenv", k, v)]
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
    return argv + ["--"]


_PROBED: dict = {}


def unavailable() -> str | None:
    """Why the sandbox cannot run here (a short phrase), or None when it can. Probed once per bwrap path."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return "bwrap (bubblewrap) not found on PATH"
    if bwrap not in _PROBED:
        _PROBED[bwrap] = _probe(bwrap)
    return _PROBED[bwrap]


def _probe(bwrap: str) -> str | None:
    """Run `print('ok')` in the sandbox, synchronously; None if it printed ok, else why not."""
    read = _seccomp_fd()
    try:
        r = subprocess.run(bwrap_argv(bwrap, Limits(), read) + python_argv("print('ok')"), capture_output=True,
                           check=False, timeout=20, pass_fds=() if read is None else (read,), env=ENV, cwd="/",
                           preexec_fn=_rlimits(Limits()), start_new_session=True)
    except (OSError, subprocess.SubprocessError) as e:
        return f"bwrap fails its start-up probe ({type(e).__name__}: {str(e)[:160]})"
    finally:
        if read is not None:
            os.close(read)
    if r.returncode == 0 and r.stdout.strip() == b"ok":
        return None
    why = r.stderr.decode("utf-8", "replace").strip().splitlines()[-1:] or [f"exit status {r.returncode}"]
    return f"bwrap fails its start-up probe ({why[0][:160]})"


def _seccomp_fd() -> int | None:
    """The read end of a pipe holding the seccomp program for bwrap --seccomp (None: no filter here)."""
    program = seccomp_filter()
    if program is None:
        return None
    read, write = os.pipe()
    os.write(write, program)  # a few hundred bytes: fits the pipe buffer
    os.close(write)
    return read


# ------------------------------------------------------------------------------------ running

def _rlimits(limits: Limits):
    def apply():  # in the child, before exec
        import resource

        memory, fsize = limits.memory_mb << 20, limits.file_mb << 20
        for what, value in ((resource.RLIMIT_AS, memory), (resource.RLIMIT_CPU, limits.cpu_seconds),
                            (resource.RLIMIT_FSIZE, fsize), (resource.RLIMIT_CORE, 0)):
            resource.setrlimit(what, (value, value))

    return apply


def _kill(proc) -> None:
    """SIGKILL the process group of `proc` (it leads its own session) and `proc` itself."""
    for kill, target in ((os.killpg, proc.pid), (os.kill, proc.pid)):
        try:
            kill(target, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(child) for child in f.read().split()]
    except (OSError, ValueError):
        return []


async def _end(proc) -> None:
    """Kill the whole tree of `proc` and reap it. The children of `proc` go first (bwrap's PID 1: the kernel
    then kills everything in the sandbox's PID namespace), so that `proc` itself reaps them and no zombie is
    left to the host's init; then the process group and `proc`."""
    if proc.returncode is None:
        children = _children(proc.pid)
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if children:
            try:
                await asyncio.wait_for(asyncio.shield(proc.wait()), 1.0)
            except TimeoutError:
                pass
    _kill(proc)
    await proc.wait()


async def _read_capped(stream, out: bytearray, cap: int) -> bool:
    """Read `stream` into `out` in chunks until EOF (False) or until past `cap` bytes (True; `out` keeps `cap`)."""
    while chunk := await stream.read(1 << 16):
        out += chunk[: cap + 1 - len(out)]
        if len(out) > cap:
            del out[cap:]
            return True
    return False


async def _read_tail(stream, tail: bytearray, keep: int) -> None:
    while chunk := await stream.read(1 << 16):
        tail += chunk
        del tail[:-keep]


async def run(argv: list[str], limits: Limits = Limits(), *, sandbox: bool = True) -> Result:
    """Run `argv` in the sandbox (or, sandbox=False, without one: unsafe) under `limits`. The process tree
    is killed when this returns, on timeout, past `max_output` bytes of stdout, and on cancellation."""
    loop = asyncio.get_running_loop()
    # unsafe: a fresh host temp dir as the working directory; sandboxed: the sandbox's own /work
    with contextlib.nullcontext("/") if sandbox else tempfile.TemporaryDirectory(prefix="slime_py_") as work:
        read = None
        if sandbox:
            bwrap = shutil.which("bwrap")
            if bwrap is None:
                raise FileNotFoundError("bwrap")
            read = _seccomp_fd()
            argv = bwrap_argv(bwrap, limits, read) + list(argv)
        spawn = asyncio.ensure_future(asyncio.create_subprocess_exec(
            *argv, cwd=work, env=ENV if sandbox else {**ENV, "HOME": work, "TMPDIR": work},
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            preexec_fn=_rlimits(limits), start_new_session=True, pass_fds=() if read is None else (read,)))
        try:
            # the code may already run while the pipes are still being connected: a cancellation then
            # must not leave it to asyncio's transport, which kills bwrap alone
            proc = await asyncio.shield(spawn)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await _end(await spawn)
            raise
        finally:
            if read is not None:
                os.close(read)
        out, err = bytearray(), bytearray()
        out_task = asyncio.ensure_future(_read_capped(proc.stdout, out, limits.max_output))
        err_task = asyncio.ensure_future(_read_tail(proc.stderr, err, STDERR_TAIL))
        exit_task = asyncio.ensure_future(proc.wait())
        truncated = timed_out = False
        try:
            end = loop.time() + limits.timeout
            while not exit_task.done():  # until it exits, passes the output cap or runs out of time
                waiting = {exit_task} if out_task.done() else {exit_task, out_task}
                done, _ = await asyncio.wait(waiting, timeout=end - loop.time(), return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    timed_out = True
                    break
                if out_task in done and out_task.result():
                    truncated = True
                    break
            await _end(proc)
            await asyncio.wait({out_task, err_task}, timeout=0.5)  # what the dead tree left in the pipes
            if truncated:  # read the rest to EOF (and drop it), so that the pipe's transport closes
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(proc.stdout.read(), 0.5)
        finally:  # on return, timeout and cancellation alike
            for task in (out_task, err_task, exit_task):
                task.cancel()
            await _end(proc)
    returncode = None if timed_out else proc.returncode
    if sandbox and returncode is not None and returncode > 128:
        returncode = 128 - returncode  # bwrap reports a child killed by signal N as exit status 128 + N
    return Result(returncode, bytes(out), bytes(err), truncated)
