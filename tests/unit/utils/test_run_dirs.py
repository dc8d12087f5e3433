"""A run's temporary directories: held while used, removed by the last holder, and swept by the next
start after the holder was SIGKILLed (slime.utils.run_dirs)."""

import os
import signal
import subprocess
import sys
import textwrap

from slime.utils import run_dirs

HOLDER = textwrap.dedent('''
    import os, sys, time
    from slime.utils import run_dirs
    base = sys.argv[1]
    stash = run_dirs.private_dir("slime-offload-", base)       # a made directory
    named = os.path.join(base, "slime-weights-abc")             # a named one (the run's weight directory)
    os.makedirs(named)
    run_dirs.hold(named)
    open(os.path.join(stash, "state.bin"), "wb").write(b"x" * 1000)
    print(stash, named, flush=True)
    if sys.argv[2] == "exit":
        sys.exit(0)  # a normal exit: atexit releases both
    time.sleep(600)
''')


def _holder(base, how):
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(base), how], stdout=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))))
    return proc, proc.stdout.readline().split()


def test_a_killed_holders_directories_are_swept_and_a_live_ones_are_kept(tmp_path):
    proc, (stash, named) = _holder(tmp_path, "sleep")
    not_held = tmp_path / "slime-made-by-someone-else"  # no lock file: never touched
    not_held.mkdir()
    other = tmp_path / "unrelated"
    other.mkdir()
    mine = run_dirs.private_dir("slime-native-released-", str(tmp_path))
    try:
        assert run_dirs.sweep(str(tmp_path)) == []  # the holder lives: nothing goes
        assert os.path.isfile(os.path.join(stash, "state.bin")) and os.path.isdir(named)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        assert sorted(run_dirs.sweep(str(tmp_path))) == sorted([stash, named])
        assert not os.path.exists(stash) and not os.path.exists(named)
        assert os.path.isdir(mine) and not_held.is_dir() and other.is_dir()  # held by this process; not ours
    finally:
        proc.kill()
        run_dirs.release(mine)
    assert not os.path.exists(mine)  # the last (only) holder removes it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["slime-made-by-someone-else", "unrelated"]


def test_a_normal_exit_removes_what_the_process_held(tmp_path):
    proc, (stash, named) = _holder(tmp_path, "exit")
    assert proc.wait(timeout=30) == 0
    assert not os.path.exists(stash) and not os.path.exists(named)


def test_a_shared_directory_goes_with_its_last_holder(tmp_path):
    proc, (stash, named) = _holder(tmp_path, "sleep")
    try:
        run_dirs.hold(named)  # two processes hold the weight directory, as two train ranks do
        assert run_dirs.release(named) is False and os.path.isdir(named)  # the other still holds it
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        run_dirs.hold(named)
        assert run_dirs.release(named) is True and not os.path.exists(named)  # now this was the last
    finally:
        proc.kill()
