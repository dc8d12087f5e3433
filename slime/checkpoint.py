"""Checkpoints: `<save>/rollout_<id>/` written atomically, `<save>/latest` names the newest.

A checkpoint directory holds
  hf/             the policy as Hugging Face safetensors (+ config and tokenizer)
  train_state/    torch DCP directory: model and optimizer state of every rank
  rollout_state.json  the data source's position (epoch, offset)
  meta.json       {"rollout_id": k}: training resumes at rollout k + 1

It is first written under a temporary name and renamed into place, and `latest`
is replaced atomically after that, so a crash mid-save leaves the previous
checkpoint whole and `latest` pointing at it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

from slime.utils.checkpoint_files import LATEST, checkpoint_dir, complete_checkpoints, latest
from slime.utils.errors import RunFailure
from slime.utils.ray_calls import get

def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """Every file under `root`, then every directory (deepest first), on disk."""
    dirs = [root]
    for path in root.rglob("*"):
        if path.is_dir():
            dirs.append(path)
        elif path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for d in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
        _fsync_dir(d)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def save(args, rollout_id: int, actor, rollout_manager) -> Path:
    """Write `<save>/rollout_<id>/` under a temporary name, fsync every file and directory, rename
    it into place, then move `latest` to it (also fsynced). A failure on the way (a full disk, a
    rank that died) removes the temporary directory and leaves `latest` as it was."""
    root = Path(args.save)
    root.mkdir(parents=True, exist_ok=True)
    final = checkpoint_dir(root, rollout_id)
    tmp = root / f".tmp-{final.name}"
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        tmp.mkdir()
        actor.save(str(tmp))
        state = get(rollout_manager.state_dict.remote(rollout_id), "save", "RolloutManager", args.stage_timeout)
        _write_atomic(tmp / "rollout_state.json", json.dumps(state))
        _write_atomic(tmp / "meta.json", json.dumps({"rollout_id": rollout_id}))
        _fsync_tree(tmp)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise RunFailure(f"save to {final} failed ({e.strerror or e}); {root / LATEST} still names "
                             f"{_named(root)}") from e
        raise
    if final.exists():  # re-saving the same rollout id (e.g. a resumed run)
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    _write_atomic(root / LATEST, final.name + "\n")
    if getattr(args, "save_keep_last", None):
        for _, old in complete_checkpoints(root)[: -args.save_keep_last]:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
    return final


def _named(root: Path) -> str:
    try:
        return (root / LATEST).read_text().strip() or "nothing"
    except OSError:
        return "nothing (no checkpoint yet)"


def load(args, actor, rollout_manager) -> int:
    """Restore from `--load`; returns the first rollout id to run (0 when there is no checkpoint)."""
    if args.load is None:
        return 0
    path = latest(args.load)
    if path is None:
        print(f"slime: no checkpoint in {args.load} yet; starting from --hf-checkpoint")
        return 0
    # the data state first: it is small, and it refuses a resume onto other prompts before any weights move
    get(rollout_manager.load_state_dict.remote(json.loads((path / "rollout_state.json").read_text())), "resume",
        "RolloutManager", args.stage_timeout)
    actor.load(str(path))
    rollout_id = json.loads((path / "meta.json").read_text())["rollout_id"]
    print(f"slime: resumed from {path} (rollout {rollout_id})")
    return rollout_id + 1


@contextlib.contextmanager
def resume_hint_on_failure(args):
    """Append where to resume from to a RunFailure raised inside the block."""
    try:
        yield
    except RunFailure as e:
        newest = latest(args.save) if args.save else None
        hint = (f"the newest checkpoint is {newest}; resume with --load {args.save}" if newest is not None
                else "no checkpoint was written (add --save DIR --save-interval N to make runs resumable)")
        raise RunFailure(f"{e}; {hint}") from e
