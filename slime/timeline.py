"""One rollout's timeline: `python -m slime.timeline RUN_DIR [--rollout N] [--out FILE]`.

Reads `RUN_DIR/timeline/rollout_<N>.jsonl` (every sample's spans, written by the rollout side of a
run with `--output-dir RUN_DIR`; docs/timeline.md), writes one self-contained HTML page (default
`RUN_DIR/timeline/rollout_<N>.html`: per engine over time, its busy bar and the samples it served)
and prints a summary table (sample wall times and the tail, time per span kind, each engine's busy
and idle time). Without `--rollout`, the newest rollout.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from slime.observability.spans import TIMELINE_DIR, read_rollout, rollout_path
from slime.observability.timeline_page import format_summary, render_html, summarize
from slime.utils.errors import SlimeError, run_main


def rollouts_in(run_dir: Path) -> list[int]:
    """The rollout ids with a timeline file under `run_dir`, ascending."""
    names = (p.name for p in (run_dir / TIMELINE_DIR).glob("rollout_*.jsonl"))
    return sorted(int(m.group(1)) for n in names if (m := re.fullmatch(r"rollout_(\d+)\.jsonl", n)))


def write_timeline(run_dir: str | Path, rollout_id: int | None = None,
                   out: str | Path | None = None) -> tuple[Path, str]:
    """(the HTML page written, the summary table) of rollout `rollout_id` (default: the newest)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise SlimeError(f"RUN_DIR {run_dir} does not exist (give a run's --output-dir)")
    have = rollouts_in(run_dir)
    if not have:
        raise SlimeError(f"{run_dir / TIMELINE_DIR} holds no rollout_<N>.jsonl (is {run_dir} a slime --output-dir "
                         "of a run that generated a rollout?)")
    rollout_id = have[-1] if rollout_id is None else rollout_id
    path = rollout_path(run_dir, rollout_id)
    if not path.is_file():
        raise SlimeError(f"--rollout {rollout_id}: {path} does not exist; {run_dir} has the timelines of rollouts "
                         f"{_ranges(have)}")
    try:
        header, rows = read_rollout(path)
    except ValueError as e:
        raise SlimeError(str(e)) from None
    page = Path(out) if out else path.with_suffix(".html")
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(render_html(header, rows, title=f"{run_dir.name}: rollout {rollout_id}"), encoding="utf-8")
    return page, format_summary(summarize(header, rows))


def _ranges(ids: list[int]) -> str:
    out, start = [], ids[0]
    for a, b in zip(ids, ids[1:] + [None]):
        if b != a + 1:
            out.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ", ".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m slime.timeline", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run's --output-dir")
    parser.add_argument("--rollout", type=int, default=None, metavar="N", help="the rollout (default: the newest)")
    parser.add_argument("--out", default=None, metavar="FILE",
                        help="the HTML page to write (default: RUN_DIR/timeline/rollout_<N>.html)")
    args = parser.parse_args()
    page, summary = write_timeline(args.run_dir, args.rollout, args.out)
    print(summary)
    print(f"\nwrote {page}")


if __name__ == "__main__":
    run_main(main)
    sys.exit(0)
