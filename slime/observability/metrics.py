"""Run metrics: `<output-dir>/metrics.jsonl` (always), TensorBoard, and optionally wandb.

Each `log` call appends one JSON object and flushes it to disk, so a crashed run
keeps every record written before the crash. Training records carry the rollout's
metrics; evaluation records carry `eval/*` metrics and `trained_rollouts` (how
many rollouts had been trained on when the eval ran).

Every line is valid JSON: a non-finite value is written as the string "NaN", "Infinity" or
"-Infinity" (TensorBoard skips it; wandb gets the float), and a last line a crash cut short is
moved into `metrics.partial-<n>.jsonl` before the next run appends (nothing written is lost).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from torch.utils.tensorboard import SummaryWriter


class MetricsLogger:
    def __init__(self, output_dir: str | Path, tensorboard: bool = True, wandb_config: dict | None = None):
        """`wandb_config`: keyword arguments for `wandb.init` (entity, project, group, name, mode, config),
        plus an optional `login` ({key, host}: `wandb.login` first, from --wandb-key / --wandb-host), or
        None for no wandb."""
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.output_dir / "metrics.jsonl"
        set_aside_partial_line(self.path)
        self._file = open(self.path, "a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            self._tb = SummaryWriter(log_dir=str(self.output_dir / "tensorboard"))
        self._wandb = None
        if wandb_config is not None:
            import wandb  # optional: only with --use-wandb

            login = wandb_config.pop("login", {})
            if login.get("key") or login.get("host"):  # --wandb-key / --wandb-host
                wandb.login(key=login.get("key"), host=login.get("host"), relogin=bool(login.get("key")))
            self._wandb = wandb.init(dir=str(self.output_dir), **wandb_config)

    @classmethod
    def from_args(cls, args, start_rollout_id: int = 0) -> "MetricsLogger":
        """The run's logger; on a resumed run (`start_rollout_id` > 0) records of the rollouts that
        will run again are first moved aside (see `set_aside_rerun_records`)."""
        if start_rollout_id > 0:
            set_aside_rerun_records(Path(args.output_dir) / "metrics.jsonl", start_rollout_id)
        wandb_config = None
        if args.use_wandb:
            wandb_config = {
                "entity": args.wandb_team,
                "project": args.wandb_project,
                "group": args.wandb_group,
                "name": args.wandb_run_name or Path(args.output_dir).name,
                "mode": args.wandb_mode or os.environ.get("WANDB_MODE", "online"),
                "config": {k: v for k, v in vars(args).items()
                           if not k.startswith("_") and k not in ("engine_api_key", "wandb_key")},
                "login": {"key": args.wandb_key, "host": args.wandb_host},
            }
        return cls(args.output_dir, tensorboard=args.use_tensorboard, wandb_config=wandb_config)

    def log(self, step: int, record: dict) -> None:
        self._file.write(json.dumps(json_safe(record), sort_keys=False, allow_nan=False) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        if self._tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                    self._tb.add_scalar(key, value, global_step=step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


_NON_FINITE = {math.inf: "Infinity", -math.inf: "-Infinity"}


def json_safe(value):
    """`value` with every non-finite float (in dicts and lists too) as the string JSON readers
    know it by: "NaN", "Infinity", "-Infinity" (json.dumps would write bare NaN: not JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else _NON_FINITE[value]
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def set_aside_partial_line(path: Path) -> Path | None:
    """A last line without its newline (a crash during a write) is moved from `path` into
    `metrics.partial-<n>.jsonl`, so the next record starts a line of its own and the file stays
    one JSON object per line. Returns the side file, or None when the file ends cleanly."""
    if not path.is_file() or path.stat().st_size == 0:
        return None
    with open(path, "rb+") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) == b"\n":
            return None
        f.seek(0)
        data = f.read()
        cut = data.rfind(b"\n") + 1
        k = 1
        while (side := path.with_name(f"metrics.partial-{k}.jsonl")).exists():
            k += 1
        side.write_bytes(data[cut:] + b"\n")
        with open(side, "rb") as s:
            os.fsync(s.fileno())
        f.truncate(cut)
        f.flush()
        os.fsync(f.fileno())
    return side


def set_aside_rerun_records(path: Path, start_rollout_id: int) -> Path | None:
    """Before resuming at `start_rollout_id`: move records that the resumed run will write again
    (training records of rollouts >= start, evals after more than `start` rollouts) from
    `metrics.jsonl` into `metrics.rerun-<n>.jsonl`, so the main file holds each rollout once
    and nothing already written is lost. Returns the side file, or None if nothing moved."""
    if not path.is_file():
        return None
    keep, rerun = [], []
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a crash belongs to a rollout that reruns
            rerun.append(line if line.endswith("\n") else line + "\n")
            continue
        later = rec.get("trained_rollouts", -1) > start_rollout_id if "trained_rollouts" in rec \
            else rec.get("rollout_id", -1) >= start_rollout_id
        (rerun if later else keep).append(line)
    if not rerun:
        return None
    k = 1
    while (side := path.with_name(f"metrics.rerun-{k}.jsonl")).exists():
        k += 1
    side.write_text("".join(rerun), encoding="utf-8")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(keep), encoding="utf-8")
    os.replace(tmp, path)
    return side


def console_line(rollout_id: int, record: dict) -> str:
    """One line per rollout for the console."""
    parts = [f"rollout {rollout_id}"]
    for key, label, fmt in (
        ("rollout/raw_reward", "reward", "{:.3f}"),
        ("rollout/response_len/mean", "len", "{:.1f}"),
        ("train/pg_loss", "pg_loss", "{:+.4f}"),
        ("train/sft_loss", "sft_loss", "{:.4f}"),
        ("train/kl_loss", "kl", "{:.2e}"),
        ("train/grad_norm", "grad_norm", "{:.3f}"),
        ("train/train_rollout_logprob_abs_diff", "lp_diff", "{:.1e}"),
        ("perf/rollout_time", "rollout_s", "{:.1f}"),
        ("perf/train_time", "train_s", "{:.1f}"),
    ):
        if key in record:
            parts.append(f"{label}={fmt.format(record[key])}")
    return " | ".join(parts)
