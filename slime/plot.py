"""Draw a run's curves: `python -m slime.plot RUN_DIR [--out DIR]`.

Reads `RUN_DIR/metrics.jsonl` and writes one PNG per panel into `RUN_DIR/plots/`
(or `--out`): reward (train and eval), response length, KL, entropy, and time
per rollout. A panel whose metrics the run did not log is skipped.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display needed
import matplotlib.pyplot as plt  # noqa: E402 (after the backend is chosen)

from slime.utils.errors import SlimeError, run_main

# panel name -> (title, [(metric key or prefix*, label)])
PANELS = {
    "reward": ("Reward", [("rollout/raw_reward", "train reward"), ("eval/*", "eval")]),
    "response_length": ("Response length (tokens)", [("rollout/response_len/mean", "mean"),
                                                     ("rollout/response_len/max", "max")]),
    "kl": ("KL to reference", [("train/kl_loss", "kl loss"), ("train/ppo_kl", "ppo kl (old vs new)")]),
    "entropy": ("Entropy", [("train/entropy_loss", "mean token entropy")]),
    "time": ("Seconds per rollout", [("perf/rollout_time", "rollout"), ("perf/train_time", "train"),
                                     ("perf/update_weights_time", "weight sync")]),
}


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise SlimeError(f"{path} does not exist (is {run_dir} a slime --output-dir?)")
    records = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise SlimeError(f"{path}:{lineno}: malformed JSON ({e.msg})") from None
    return records


def series(records: list[dict], key: str) -> dict[str, tuple[list[float], list[float]]]:
    """key -> (x, y) on one axis, "rollouts trained": rollout k was generated (and its losses
    computed) by the policy after k updates, and an eval record says how many it followed."""
    keys = sorted({k for r in records for k in r if k.startswith(key[:-1]) and k.count("/") == 1}) \
        if key.endswith("*") else [key]
    out = {}
    for k in keys:
        xs, ys = [], []
        for r in records:
            if k in r and isinstance(r[k], (int, float)):
                xs.append(r.get("trained_rollouts", r["rollout_id"]))
                ys.append(r[k])
        if xs:
            out[k] = (xs, ys)
    return out


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    out_dir = Path(out_dir) if out_dir else run_dir / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (title, lines) in PANELS.items():
        drawn = 0
        fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
        for key, label in lines:
            for k, (xs, ys) in series(records, key).items():
                ax.plot(xs, ys, marker="o", markersize=3, label=k if key.endswith("*") else label)
                drawn += 1
        if drawn:
            ax.set_title(f"{title} - {run_dir.name}")
            ax.set_xlabel("rollouts trained")
            ax.grid(alpha=0.3)
            ax.legend()
            fig.tight_layout()
            path = out_dir / f"{name}.png"
            fig.savefig(path)
            written.append(path)
        plt.close(fig)
    if not written:
        raise SlimeError(f"{run_dir / 'metrics.jsonl'} has no metrics to plot")
    return written


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m slime.plot", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("--out", default=None, help="output folder (default: RUN_DIR/plots)")
    args = parser.parse_args()
    for path in plot_run(args.run_dir, args.out):
        print(path)


if __name__ == "__main__":
    run_main(main)
    sys.exit(0)
