"""The files of a `--save` directory: `rollout_<id>/` checkpoints and `latest`, read without loading
anything (slime.checkpoint writes them; argument checks read them before a run starts).

A checkpoint is complete when its `meta.json` and `rollout_state.json` parse and it has its
trainer state (`train_state/`); `latest` names the newest one. When `latest` is missing, unreadable
or names a checkpoint that is not complete (a disk that lost data, a hand edit), the newest
complete checkpoint is used instead, and slime says so.
"""

from __future__ import annotations

import json
from pathlib import Path

from slime.utils.errors import SlimeError

LATEST = "latest"
PREFIX = "rollout_"


def checkpoint_dir(root: str | Path, rollout_id: int) -> Path:
    return Path(root) / f"{PREFIX}{rollout_id:06d}"


def rollout_id_of(path: Path) -> int | None:
    """The rollout id of a complete checkpoint at `path`, else None."""
    try:
        meta = json.loads((path / "meta.json").read_text())
        json.loads((path / "rollout_state.json").read_text())
    except (OSError, ValueError):
        return None
    rollout_id = meta.get("rollout_id") if isinstance(meta, dict) else None
    if not isinstance(rollout_id, int) or not (path / "train_state").is_dir():
        return None
    return rollout_id


def complete_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """(rollout id, path) of every complete checkpoint under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for path in root.glob(f"{PREFIX}*"):
        rollout_id = rollout_id_of(path) if path.is_dir() else None
        if rollout_id is not None:
            found.append((rollout_id, path))
    return sorted(found)


def latest(root: str | Path) -> Path | None:
    """The checkpoint to resume from under `root`: the one `latest` names when it is complete, else
    the newest complete one (with a warning); None when there is none. A `latest` that names a
    checkpoint when no complete one exists is one clear line (SlimeError)."""
    root = Path(root)
    marker = root / LATEST
    named = None
    try:
        named = root / marker.read_text().strip()
    except (OSError, UnicodeDecodeError):
        pass
    if named is not None and named.parent == root and rollout_id_of(named) is not None:
        return named
    complete = complete_checkpoints(root)
    if not complete:
        if marker.exists():
            raise SlimeError(f"{marker} names {named or 'nothing readable'}, which is not a complete checkpoint "
                             f"(meta.json, rollout_state.json and train_state/), and {root} holds no other")
        return None
    newest = complete[-1][1]
    if marker.exists():
        print(f"slime: {marker} names {named or 'nothing readable'}, which is missing or incomplete; "
              f"resuming from the newest complete checkpoint {newest}")
    return newest
