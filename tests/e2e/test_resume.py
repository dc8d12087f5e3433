"""Never lose a run: exact resume, and resume after the driver is killed with SIGKILL."""

import json
import shutil
import signal
import subprocess
import time

import psutil
import pytest

from tests.helpers.e2e import LP, REFERENCE_FLAGS, ROOT, comparable, driver_env, records, run, shape_cmd
from tests.helpers.ray_cluster import HeadNode

pytestmark = pytest.mark.e2e


RUN_PROCESSES = ("slime.engines.", "sglang::router", "ray::TrainActor", "ray::RolloutManager", "ray::EngineServer")


def _run_processes(driver_pid: int, cluster: HeadNode) -> list[psutil.Process]:
    """The driver's descendants and the run's actors, engines and router: those of the session's
    shared Ray `cluster` (it serves one run at a time; another pytest worker's run is on its own)."""
    found = {p.pid: p for p in psutil.Process(driver_pid).children(recursive=True)}
    for p in cluster.processes():
        if any(s in " ".join(_cmdline(p)) for s in RUN_PROCESSES):
            found[p.pid] = p
    return list(found.values())


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []

def test_resumed_run_matches_uninterrupted_run(task, reference_run, tmp_path):
    """Save after rollouts 0 and 1, stop, resume with --load: rollouts 2 and 3 are those of the
    uninterrupted reference run, and the checkpoints are laid out as documented."""
    part, ckpt = tmp_path / "part", tmp_path / "ckpt"
    flags = [*REFERENCE_FLAGS, "--save", str(ckpt), "--save-interval", "1"]
    proc = run(shape_cmd(task, part, *flags, "--num-rollout", "2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (ckpt / "latest").read_text().strip() == "rollout_000001"
    assert (ckpt / "rollout_000001" / "hf" / "model.safetensors").is_file()
    assert json.loads((ckpt / "rollout_000001" / "rollout_state.json").read_text())["data_source"]["offset"] == 8

    proc = run(shape_cmd(task, part, *flags, "--num-rollout", "4", "--load", str(ckpt)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout
    assert (ckpt / "latest").read_text().strip() == "rollout_000003"
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt / "rollout_000003" / "hf")
    assert model.config.vocab_size > 0

    expected, resumed = comparable(records(reference_run["out"])), comparable(records(part))
    assert sorted(resumed) == [0, 1, 2, 3]  # each rollout once in metrics.jsonl
    for rollout_id in (2, 3):
        assert resumed[rollout_id] == expected[rollout_id], rollout_id


def test_sigkill_mid_run_then_resume_loses_nothing(task, tmp_path, shared_ray_cluster):
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    cmd = shape_cmd(task, out, "--num-rollout", "5", "--save", str(ckpt), "--save-interval", "1", "--load", str(ckpt))
    driver = subprocess.Popen(cmd, cwd=ROOT, env=driver_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        latest = ckpt / "latest"
        if latest.is_file() and latest.read_text().strip() >= "rollout_000001":
            break
        assert driver.poll() is None, "the run ended before it could be killed"
        time.sleep(0.2)
    else:
        pytest.fail("no checkpoint of rollout 1 within 300 s")
    run_processes = _run_processes(driver.pid, shared_ray_cluster)
    assert any("slime.engines.native" in " ".join(_cmdline(p)) for p in run_processes)
    driver.send_signal(signal.SIGKILL)
    driver.wait(timeout=30)
    killed_at = (ckpt / "latest").read_text().strip()
    # nothing of the killed run is left 30 s later (engines die with the Ray worker that owns them)
    gone, alive = psutil.wait_procs(run_processes, timeout=30)
    assert not alive, [(p.pid, _cmdline(p)[:4]) for p in alive]

    proc = run(cmd)  # the same command resumes from the newest checkpoint
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {ckpt / killed_at}" in proc.stdout
    recs = [r for r in records(out) if "trained_rollouts" not in r]
    assert [r["rollout_id"] for r in recs] == [0, 1, 2, 3, 4]  # each rollout once in metrics.jsonl
    # every prompt was consumed exactly once: 5 rollouts x 4 prompts, none skipped or repeated
    state = json.loads((ckpt / "rollout_000004" / "rollout_state.json").read_text())["data_source"]
    assert (state["epoch"], state["offset"]) == (0, 20)


def test_deterministic_mode_runs_agree_bit_for_bit_also_across_a_resume(task, tmp_path):
    """--deterministic-mode: a run resumed from the checkpoint of rollout 0 (fresh engines given the
    saved weights) logs rollout 1 exactly as the run that went through did, to the last bit, the
    engine/trainer log-prob difference included (without the mode that one agrees only to ~1e-8:
    docs/reproducibility.md)."""
    through, resumed, ckpt = tmp_path / "through", tmp_path / "resumed", tmp_path / "ckpt"
    flags = ("--deterministic-mode", "--seed", "3", "--num-rollout", "2", "--save-interval", "1")
    proc = run(shape_cmd(task, through, *flags, "--save", str(ckpt)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    killed = tmp_path / "killed"  # what a run stopped right after its first save leaves
    shutil.copytree(ckpt / "rollout_000000", killed / "rollout_000000")
    (killed / "latest").write_text("rollout_000000\n")
    proc = run(shape_cmd(task, resumed, *flags, "--load", str(killed), "--save", str(killed)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {killed / 'rollout_000000'}" in proc.stdout

    def exact(recs):
        return {r["rollout_id"]: {k: v for k, v in r.items() if not k.startswith("perf/")}
                for r in recs if "trained_rollouts" not in r}

    expected, got = exact(records(through)), exact(records(resumed))
    assert sorted(got) == [1] and got[1][LP] > 0
    assert got[1] == expected[1]
