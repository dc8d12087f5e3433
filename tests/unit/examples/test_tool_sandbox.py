"""The tool-use example's sandbox (examples/tool_use/sandbox.py, bubblewrap) and the bounds of its tools.

The sandbox tests need a working `bwrap` (scripts/test.sh installs bubblewrap where it can); without one
they skip, and the refusal / unsafe-switch tests still run (they hide bwrap by emptying PATH)."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import socket
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[3]
TOOL_USE = ROOT / "examples" / "tool_use"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_tool_use_{name}", TOOL_USE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


tools = _load("tools")
sb = tools._sandbox
WHY = sb.unavailable()
needs_bwrap = pytest.mark.skipif(WHY is not None, reason=f"no sandbox here: {WHY}")
REFUSAL = ("error: no sandbox for the python tool: bwrap (bubblewrap) not found on PATH; install bubblewrap "
           "(apt-get install bubblewrap) or set SLIME_TOOL_SANDBOX=unsafe (python_sandbox: unsafe in the config) "
           "to run it unsandboxed")


def py(code: str, **limits) -> str:
    return asyncio.run(tools.run_python(code, **limits))


def sandboxed(code: str, **limits):
    return asyncio.run(sb.run(sb.python_argv(code, 32), sb.Limits(**limits)))


@pytest.fixture
def no_bwrap(monkeypatch, tmp_path):
    """A PATH without bwrap on it (and the sandbox's probe cache emptied)."""
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv(tools.SANDBOX_ENV, raising=False)
    monkeypatch.setattr(sb, "_PROBED", {})


# ------------------------------------------------------------------------------- isolation


@needs_bwrap
def test_no_network_not_even_the_hosts_loopback():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.setblocking(False)
    port = server.getsockname()[1]
    code = f"""import socket
for host in ('127.0.0.1', '192.0.2.1'):
    try:
        socket.create_connection((host, {port}), timeout=1)
        print(host, 'connected')
    except OSError as e:
        print(host, type(e).__name__, e.errno)"""
    try:
        # the sandbox's own loopback has nothing listening; no route anywhere else
        assert py(code) == "127.0.0.1 ConnectionRefusedError 111\n192.0.2.1 OSError 101"
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing reached the host's listener
    finally:
        server.close()


@needs_bwrap
def test_read_only_system_no_home_no_repository(tmp_path):
    secret = tempfile.NamedTemporaryFile(dir=Path.home(), prefix=".slime_sandbox_test_")  # noqa: SIM115
    try:
        hidden = [secret.name, str(ROOT / "pyproject.toml"), str(ROOT / ".venv"), str(tmp_path), os.getcwd()]
        code = f"""import os
for p in ['/usr/x', '/etc/x', '/x', {str(Path(sys.base_prefix) / 'x')!r}]:
    try:
        open(p, 'w')
        print(p, 'written')
    except OSError as e:
        print(e.errno, end=' ')
print([os.path.exists(p) for p in {hidden!r}])
open('here', 'w').write('ok'); open('/tmp/t', 'w').write('ok')
print(os.getcwd(), os.listdir('.'), os.environ.get('HOME'))"""
        # EROFS (30) everywhere but the private /work and /tmp
        assert py(code) == f"30 30 30 30 {[False] * len(hidden)}\n/work ['here'] /work"
    finally:
        secret.close()
    assert py("import os; print(os.listdir('.'), os.listdir('/tmp'))") == "[] []"  # a fresh /work and /tmp each run


@needs_bwrap
def test_processes_refused_threads_allowed():
    assert py("import os\nwhile True: os.fork()") == "error: exit status 1: PermissionError: [Errno 1] Operation not permitted"
    assert py("import subprocess; subprocess.run(['true'])") == (
        "error: exit status 1: PermissionError: [Errno 1] Operation not permitted")
    assert py("import threading; t = threading.Thread(target=print, args=(7,)); t.start(); t.join()") == "7"


@needs_bwrap
def test_file_size_and_disk_are_bounded():
    assert py("open('big', 'wb').write(b'x' * (2 << 20))", file_mb=1) == "error: exit status 1: OSError: [Errno 27] File too large"
    code = "n = 0\ntry:\n    while True:\n        open(f'/tmp/f{n}', 'wb').write(b'x' * (1 << 20)); n += 1\nexcept OSError as e: print(n, e.errno)"
    assert py(code, file_mb=4) == "32 28"  # /tmp holds disk_mb (32) MiB, then ENOSPC


@needs_bwrap
def test_memory_cpu_and_wall_clock_limits():
    assert py("x = bytearray(1 << 30)", memory_mb=128) == "error: exit status 1: MemoryError"
    assert py("while True: pass", cpu_seconds=1, timeout=20).startswith("error: killed by signal")
    assert py("import time; time.sleep(10)", timeout=0.5) == "error: timed out after 0.5 s"


@needs_bwrap
def test_output_is_cut_at_exactly_the_cap_and_the_writer_killed():
    r = sandboxed("import sys\nwhile True: sys.stdout.write('x' * 65536)", max_output=1000, timeout=10)
    assert (r.stdout, r.truncated, r.returncode) == (b"x" * 1000, True, -9)  # killed at the cap, not by the timeout
    assert py("print('é' * 10)", max_output=5) == "éé\ufffd"  # bytes: a cut character is replaced
    assert py("print('x' * 5000)", max_output=10) == "x" * 10


async def _tree(task, marker: str) -> list[psutil.Process]:
    """The sandbox's processes (bwrap and what runs under it) once the Python whose code holds `marker` runs."""
    for _ in range(250):
        await asyncio.sleep(0.01)
        for p in psutil.Process().children():
            try:
                tree = [p, *p.children(recursive=True)]
                if p.name() == "bwrap" and any(q.name() != "bwrap" and marker in " ".join(q.cmdline()) for q in tree):
                    return tree
            except psutil.NoSuchProcess:
                continue
    raise AssertionError(f"no sandboxed process seen; task done: {task.done()}")


def _alive(procs):  # a zombie counts as alive: nobody reaped it
    return [p for p in procs if p.is_running()]


@pytest.mark.parametrize("how", ["return", "timeout", "cancel"])
@needs_bwrap
def test_the_whole_process_tree_is_gone(how):
    code = {"return": "import time  # MARK\ntime.sleep(0.4)\nprint('done')",
            "timeout": "import time  # MARK\ntime.sleep(30)", "cancel": "import time  # MARK\ntime.sleep(30)"}[how]

    async def main():
        task = asyncio.ensure_future(sb.run(sb.python_argv(code, 32), sb.Limits(timeout=1.0 if how == "timeout" else 10)))
        procs = await _tree(task, "MARK")
        assert sorted(p.name() for p in procs) == ["bwrap", Path(sb.interpreter()).name]  # python is its PID 1
        if how == "cancel":
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        else:
            r = await task
            assert (r.returncode, r.stdout) == ((0, b"done\n") if how == "return" else (None, b""))
        return procs

    procs = asyncio.run(main())
    assert _alive(procs) == []  # at once, reaped: nothing survives, no zombie is left behind


# ------------------------------------------------------------------------------- no sandbox: refuse, or the unsafe switch


def test_without_bwrap_the_tool_refuses(no_bwrap):
    assert sb.unavailable() == "bwrap (bubblewrap) not found on PATH"
    assert tools.sandbox_refusal() == REFUSAL
    assert py("print(1)") == REFUSAL
    assert py("print(1)", sandbox="bwrap") == REFUSAL
    with pytest.raises(ValueError, match="must be 'bwrap' or 'unsafe'"):
        py("print(1)", sandbox="off")


def test_a_failing_bwrap_is_no_sandbox(monkeypatch, tmp_path):
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.delenv(tools.SANDBOX_ENV, raising=False)
    monkeypatch.setattr(sb, "_PROBED", {})
    why = "bwrap fails its start-up probe (bwrap: No permissions to create new namespace)"
    assert sb.unavailable() == why
    assert py("print(1)") == REFUSAL.replace("bwrap (bubblewrap) not found on PATH", why)


def test_the_unsafe_switch_runs_without_a_sandbox(no_bwrap, monkeypatch):
    code = "import os; print(6 * 7, os.path.basename(os.getcwd())[:9])"
    assert py(code, sandbox="unsafe") == "42 slime_py_"  # the host's temp dir: not sandboxed
    monkeypatch.setenv(tools.SANDBOX_ENV, "unsafe")
    assert tools.sandbox_refusal() is None
    assert py(code) == "42 slime_py_"
    assert py("print('x' * 5000)", max_output=10) == "x" * 10  # the limits still hold
    assert py("import time; time.sleep(10)", timeout=0.5) == "error: timed out after 0.5 s"


def test_generate_refuses_to_start_the_python_tool_without_a_sandbox(no_bwrap, monkeypatch):
    from types import SimpleNamespace

    gen = _load("generate")
    monkeypatch.setattr(gen, "context", lambda: SimpleNamespace(tokenizer=SimpleNamespace(decode=lambda *a, **k: "")))
    args = SimpleNamespace(call_format="hermes", python_tool=True)
    with pytest.raises(RuntimeError) as e:
        asyncio.run(gen.generate(args, SimpleNamespace(tokens=[]), {}))
    assert str(e.value) == REFUSAL


# ------------------------------------------------------------------------------- the calculator's bounds


@pytest.mark.parametrize("expression, result", [
    ("999999999 * 999999999", "999999998000000001"),
    ("2 ** 32 * 2 ** 32", "18446744073709551616"),
    ("(10 ** 30) ** 9 - (10 ** 30) ** 9 + 1", "1"),  # 10**270 is within 300 digits
    ("10**32*10**32*10**32*10**32*10**32*10**32*10**32*10**32*10**32", "1" + "0" * 288),
    ("10**32*10**32*10**32*10**32*10**32*10**32*10**32*10**32*10**32*10**32", "error: number too large (more than 300 digits)"),
    ("(10 ** 32) ** 32", "error: number too large (more than 300 digits)"),
    ("((9 ** 32) ** 32) ** 32", "error: number too large (more than 300 digits)"),  # refused before 9**1024
    ("1e200 * 1e200", "error: number too large (more than 300 digits)"),
    ("1e999", "error: number too large (more than 300 digits)"),  # inf
    ("-" * 40 + "1", "error: expression nested too deeply (more than 32 levels)"),
    ("2 ** 99", "error: cannot evaluate '2 ** 99' (ValueError)"),
    ("(-8) ** 0.5", "error: cannot evaluate '(-8) ** 0.5' (ValueError)"),
])
def test_calculator_bounds_size_before_computing(expression, result):
    assert tools.calculate(expression) == result


def test_calculator_never_multiplies_a_refused_product(monkeypatch):
    import operator

    calls = []
    monkeypatch.setitem(tools._BINARY, tools.ast.Mult, lambda a, b: calls.append((a, b)) or operator.mul(a, b))
    assert tools.calculate("10**32*10**32*10**32*10**32*10**32*10**32*10**32*10**32*10**32*10**32").startswith(
        "error: number too large")
    assert len(calls) == 8  # the 9th product (and the 10th) were refused from the bit lengths, not computed


@needs_bwrap
def test_a_cancellation_while_starting_leaves_nothing_behind():
    """Cancelled at any moment of its start (bwrap may already run the code while asyncio still connects
    the pipes): every process seen under this one is gone and reaped afterwards."""
    async def main(delay):
        seen = {}
        before = {p.pid for p in psutil.Process().children(recursive=True)}  # other tests' servers
        task = asyncio.ensure_future(sb.run(sb.python_argv("import time\ntime.sleep(30)", 32), sb.Limits(timeout=10)))
        end = asyncio.get_running_loop().time() + delay
        while asyncio.get_running_loop().time() < end:
            seen.update((p.pid, p) for p in psutil.Process().children(recursive=True) if p.pid not in before)
            await asyncio.sleep(0.001)
        task.cancel()
        cancelled = asyncio.get_running_loop().time()
        with pytest.raises(asyncio.CancelledError):
            await task
        return list(seen.values()), asyncio.get_running_loop().time() - cancelled

    for delay in (0, 0.002, 0.005, 0.01, 0.02, 0.05):
        procs, took = asyncio.run(main(delay))
        assert _alive(procs) == [] and took < 2.0  # not after the code's 30 s sleep
