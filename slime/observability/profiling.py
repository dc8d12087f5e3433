"""`--profile-rollouts A-B`: training steps under torch.profiler (slime.profile_flags, docs/timeline.md).

`profile_rollout(args, rollout_id, rank, role)` wraps one rollout's training on one train rank:
outside the range it does nothing; inside, `torch.profiler` records CPU (and CUDA where a GPU is
used) activity and, when the step is done, writes
`<output-dir>/profiles/rollout_<N>_<role>_rank<r>.trace.json` (Chrome trace: chrome://tracing or
https://ui.perfetto.dev) and `....txt`, the top 30 operators by self time.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import torch

PROFILE_DIR = "profiles"


def profiled(args, rollout_id: int) -> bool:
    rng = getattr(args, "profile_rollout_range", None)
    return rng is not None and rng[0] <= rollout_id <= rng[1]


@contextlib.contextmanager
def profile_rollout(args, rollout_id: int, rank: int = 0, role: str = "actor") -> Iterator[None]:
    if not profiled(args, rollout_id):
        yield
        return
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    out = Path(args.output_dir) / PROFILE_DIR
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"rollout_{rollout_id}_{role}_rank{rank}"
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        yield
    prof.export_chrome_trace(str(stem) + ".trace.json")
    sort = "self_cuda_time_total" if len(activities) > 1 else "self_cpu_time_total"
    Path(str(stem) + ".txt").write_text(prof.key_averages().table(sort_by=sort, row_limit=30), encoding="utf-8")
