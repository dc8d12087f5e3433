"""Profiling flags and their start-up check (docs/timeline.md).

- `--profile-rollouts A-B` (or `N`): the training steps of rollouts A..B (inclusive) run under
  `torch.profiler`; every train rank writes a Chrome trace and a table of its top operators under
  `<output-dir>/profiles/` (`slime.observability.profiling`).

`validate_profile(args)` runs at parse time (after `--num-rollout` is known) and sets
`args.profile_rollout_range` to (A, B), or None without the flag; a bad range is one line naming
the flag.
"""

from __future__ import annotations

import re

from slime.utils.errors import SlimeConfigError


def add_profile_flags(p) -> None:
    g = p.add_argument_group("profiling (docs/timeline.md)")
    g.add_argument("--profile-rollouts", default=None, metavar="A-B",
                   help="run the training steps of rollouts A through B (inclusive; one rollout: N) under "
                        "torch.profiler; each train rank writes <output-dir>/profiles/rollout_<N>_<role>_rank<r>"
                        ".trace.json (open in chrome://tracing or Perfetto) and a .txt table of its top operators")


def parse_rollout_range(text: str) -> tuple[int, int]:
    """"A-B" or "N" -> (A, B); SlimeConfigError naming the flag otherwise."""
    m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", text)
    if m is None:
        raise SlimeConfigError(f"--profile-rollouts {text!r}: expected A-B (rollout ids, e.g. 2-3) or one id N")
    a, b = int(m.group(1)), int(m.group(2) if m.group(2) is not None else m.group(1))
    if b < a:
        raise SlimeConfigError(f"--profile-rollouts {text}: the range ends ({b}) before it starts ({a})")
    return a, b


def validate_profile(args) -> None:
    args.profile_rollout_range = None
    if args.profile_rollouts is None:
        return
    a, b = parse_rollout_range(args.profile_rollouts)
    if a >= args.num_rollout:
        raise SlimeConfigError(f"--profile-rollouts {args.profile_rollouts}: this run trains rollouts 0-"
                               f"{args.num_rollout - 1} (--num-rollout {args.num_rollout}); nothing would be profiled")
    args.profile_rollout_range = (a, b)
