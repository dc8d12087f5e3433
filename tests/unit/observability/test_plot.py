import json
import subprocess
import sys

from slime.plot import plot_run, series


def write_run(tmp_path):
    recs = [{"rollout_id": 0, "trained_rollouts": 0, "eval/toy": 0.1}]
    for i in range(4):
        recs.append({"rollout_id": i, "rollout/raw_reward": 0.1 * i, "rollout/response_len/mean": 5.0 + i,
                     "train/kl_loss": 0.01 * i, "train/entropy_loss": 2.0 - 0.1 * i, "perf/rollout_time": 1.0,
                     "perf/train_time": 2.0})
    recs.append({"rollout_id": 4, "trained_rollouts": 4, "eval/toy": 0.5})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return recs


def test_series_share_the_rollouts_trained_axis(tmp_path):
    recs = write_run(tmp_path)
    assert series(recs, "rollout/raw_reward") == {"rollout/raw_reward": ([0, 1, 2, 3], [0.0, 0.1, 0.2, 0.30000000000000004])}
    assert series(recs, "eval/*") == {"eval/toy": ([0, 4], [0.1, 0.5])}


def test_plot_writes_pngs(tmp_path):
    write_run(tmp_path)
    paths = plot_run(tmp_path)
    assert sorted(p.name for p in paths) == ["entropy.png", "kl.png", "response_length.png", "reward.png", "time.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


def test_cli_error_names_the_file(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "slime.plot", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"slime: error: {tmp_path / 'metrics.jsonl'} does not exist (is {tmp_path} a slime --output-dir?)"
