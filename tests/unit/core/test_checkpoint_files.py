"""Checkpoint durability and the --load/--save doors (slime/checkpoint.py, slime/utils/checkpoint_files.py):
every file and directory fsynced before `latest` moves; a `latest` naming a missing or broken
checkpoint falls back to the newest complete one, saying so; a failed save (a full disk) leaves
`latest` as it was and no temporary directory; --save-keep-last; a mistyped --load and a --save
directory of another, newer run refused before anything starts."""

import errno
import json
import os
from types import SimpleNamespace

import pytest

from slime import checkpoint
from slime.arguments import parse_args
from slime.utils.checkpoint_files import LATEST, checkpoint_dir, latest
from slime.utils.errors import RunFailure, SlimeConfigError, SlimeError


def _complete(root, rollout_id):
    path = checkpoint_dir(root, rollout_id)
    (path / "train_state").mkdir(parents=True)
    (path / "meta.json").write_text(json.dumps({"rollout_id": rollout_id}))
    (path / "rollout_state.json").write_text("{}")
    return path


def test_latest_falls_back_to_the_newest_complete_checkpoint(tmp_path, capsys):
    assert latest(tmp_path) is None
    one, two = _complete(tmp_path, 1), _complete(tmp_path, 2)
    assert latest(tmp_path) == two  # no marker (a crash before it moved): the newest complete one
    (tmp_path / LATEST).write_text("rollout_000001\n")
    assert latest(tmp_path) == one and capsys.readouterr().out == ""
    (tmp_path / LATEST).write_text("rollout_000009\n")  # names a checkpoint that is not there
    assert latest(tmp_path) == two
    assert "names " + str(tmp_path / "rollout_000009") in capsys.readouterr().out
    (tmp_path / LATEST).write_text("rollout_000002\n")
    (two / "meta.json").write_text('{"rollout_')  # truncated
    assert latest(tmp_path) == one
    (one / "rollout_state.json").unlink()
    with pytest.raises(SlimeError, match=r"latest names .*rollout_000002, which is not a complete checkpoint"):
        latest(tmp_path)


class _Trainer:
    def __init__(self, fail=None):
        self.fail = fail

    def save(self, path):
        os.makedirs(os.path.join(path, "train_state"))
        with open(os.path.join(path, "train_state", "shard.distcp"), "w") as f:
            f.write("x")
        if self.fail:
            raise self.fail


class _Manager:
    class state_dict:  # noqa: N801 - stands for an actor method
        @staticmethod
        def remote(rollout_id=None):
            return None


@pytest.fixture
def no_ray(monkeypatch):
    monkeypatch.setattr(checkpoint, "get", lambda ref, stage, actor, timeout: {"data_source": {"offset": 3}})


def test_save_fsyncs_everything_before_latest_moves(tmp_path, no_ray, monkeypatch):
    synced, real = [], os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    args = SimpleNamespace(save=str(tmp_path), stage_timeout=5, save_keep_last=None)
    final = checkpoint.save(args, 0, _Trainer(), _Manager())
    tmp = str(tmp_path / ".tmp-rollout_000000")
    for name in ("train_state/shard.distcp", "train_state", "meta.json", "rollout_state.json", ""):
        assert os.path.join(tmp, name).rstrip("/") in synced, name  # written and synced under the temporary name
    rename_synced = synced.index(str(tmp_path))  # the root after the rename
    assert synced[-2:] == [str(tmp_path / "latest.tmp"), str(tmp_path)]  # then latest, then the root again
    assert rename_synced < len(synced) - 2
    assert latest(tmp_path) == final


def test_a_full_disk_leaves_latest_and_no_temporary_directory(tmp_path, no_ray):
    args = SimpleNamespace(save=str(tmp_path), stage_timeout=5, save_keep_last=None)
    checkpoint.save(args, 0, _Trainer(), _Manager())
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    with pytest.raises(RunFailure, match=r"save to .*rollout_000001 failed \(No space left on device\); "
                                         r".*latest still names rollout_000000"):
        checkpoint.save(args, 1, _Trainer(fail=full), _Manager())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "rollout_000000"]
    assert latest(tmp_path) == checkpoint_dir(tmp_path, 0)


def test_save_keep_last(tmp_path, no_ray):
    args = SimpleNamespace(save=str(tmp_path), stage_timeout=5, save_keep_last=2)
    for rollout_id in range(4):
        checkpoint.save(args, rollout_id, _Trainer(), _Manager())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "rollout_000002", "rollout_000003"]


@pytest.fixture
def base(tiny_model_dir, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"input": f"q{i}", "label": str(i)}) for i in range(10)) + "\n")
    return ["--hf-checkpoint", tiny_model_dir, "--prompt-data", str(data), "--output-dir", str(tmp_path / "out"),
            "--rollout-batch-size", "1", "--num-rollout", "1"]


def test_load_and_save_doors(base, tmp_path):
    mine, other = tmp_path / "mine", tmp_path / "other"
    with pytest.raises(SlimeConfigError, match=rf"--load: {tmp_path / 'typo'} does not exist \(to start fresh"):
        parse_args(base + ["--load", str(tmp_path / "typo"), "--save", str(mine)])
    parse_args(base + ["--load", str(mine), "--save", str(mine) + "/"])  # a run that resumes itself: fresh at first
    _complete(other, 5)
    (other / LATEST).write_text("rollout_000005\n")
    with pytest.raises(SlimeConfigError, match=r"--save: .*other holds checkpoints of another run up to rollout_000005, "
                                                r"as new as or newer than this run's first save \(rollout 0\); resume it "
                                                r"with --load .*other, choose another --save, or pass "
                                                r"--overwrite-checkpoints"):
        parse_args(base + ["--save", str(other)])
    parse_args(base + ["--save", str(other), "--overwrite-checkpoints"])
    parse_args(base + ["--load", str(other), "--save", str(other)])
    _complete(mine, 7)
    parse_args(base + ["--load", str(mine), "--save", str(other)])  # resumes at 8: other's 5 is older
    with pytest.raises(SlimeConfigError, match=r"--save-keep-last must be >= 1, got 0"):
        parse_args(base + ["--save", str(mine), "--load", str(mine), "--save-keep-last", "0"])
