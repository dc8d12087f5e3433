"""--use-fault-tolerance end to end: a train.py run with two engines behind sglang-router where the
test kills (SIGKILL) or freezes (SIGSTOP) one engine in the middle of a rollout. The run must
finish every rollout, count the restart in `rollout/engine_restarts`, and the restarted engine
must serve the trainer's current weights (same `/weights_checksum` as the other engine) and must
not serve a request before it has them."""

from __future__ import annotations

import os
import signal

import pytest

from tests.helpers.fault import NUM_ROLLOUT, run_with_fault

pytestmark = pytest.mark.e2e


def _check(seen: dict) -> None:
    assert seen["returncode"] == 0, seen["output"][-4000:]
    records = [r for r in seen["records"] if "rollout/raw_reward" in r]
    assert [r["rollout_id"] for r in records] == list(range(NUM_ROLLOUT))  # every rollout finished
    restarts = [r["rollout/engine_restarts"] for r in records]
    assert sum(restarts) >= 1 and all(r >= 0 for r in restarts), restarts
    assert seen["restarted_pid"] not in (None, seen["killed_pid"])  # a new process on the same URL
    assert seen["same_weights"] is True  # it serves exactly the weights the healthy engine serves
    assert seen["served_before_weights"] == []  # and served nothing before it had them


def test_killed_engine_is_restarted_with_current_weights(task, tmp_path):
    seen = run_with_fault(task, tmp_path / "kill", signal.SIGKILL, os.environ.get("SLIME_FT_DRIVER", "train.py"))
    _check(seen)
    assert "its process exited" in seen["output"] or "GET /health failed" in seen["output"]


def test_hung_engine_is_detected_by_the_timeout_and_restarted(task, tmp_path):
    seen = run_with_fault(task, tmp_path / "stop", signal.SIGSTOP, os.environ.get("SLIME_FT_DRIVER", "train.py"))
    _check(seen)
    assert "GET /health failed" in seen["output"] and "timed out after 3" in seen["output"]
