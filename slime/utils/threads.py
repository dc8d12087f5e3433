"""How many CPU threads each slime process takes on the machine it runs on."""

from __future__ import annotations

import os


def cpu_threads(args, role: str, processes: int | None = None) -> int:
    """Threads for each of the `processes` train ranks (`role="train"`, default `args.dp_size`) or
    rollout engines (`role="rollout"`, default `args.num_engines`) on this machine.

    train.py alternates generation and training, so each role may use all the CPUs. train_async.py
    runs both at once, so the roles split the CPUs in proportion to their process counts: threads of
    both on the same cores slow each other down (a tiny model's train step took 3.5x longer while an
    engine generated beside it with two threads each on two cores)."""
    share = 1.0
    if args.overlap_training:
        train, rollout = args.dp_size * (2 if args.use_critic else 1), args.num_engines
        share = (train if role == "train" else rollout) / (train + rollout)
    if processes is None:
        processes = args.dp_size if role == "train" else args.num_engines
    return max(1, int((os.cpu_count() or 1) * share) // max(1, processes))


def default_num_threads() -> int:
    """OMP_NUM_THREADS when set, else the CPUs this process may run on."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
