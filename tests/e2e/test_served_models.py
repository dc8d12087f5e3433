"""End-to-end: a run serving a frozen teacher beside the policy (--sglang-config), reached by custom
code by name, never pushed to, restarted under --use-fault-tolerance, and distilled from
(--use-opd --opd-type sglang)."""

from __future__ import annotations

import json
import shutil
import textwrap

import pytest

from tests.helpers.e2e import records, run, shape_cmd

pytestmark = pytest.mark.e2e

REWARD = '''
import json
import os
import signal
from urllib.parse import urlparse

import psutil

from slime.rollout.api import context, get_model_url

LOG = {log!r}
KILLED = LOG + ".killed"


def kill_teacher_engine_once():
    """SIGKILL the teacher's engine process the first time a sample of the second rollout is scored."""
    if os.path.exists(KILLED):
        return
    open(KILLED, "w").close()
    port = urlparse(context().model("teacher").urls[0]).port
    pid = next(c.pid for c in psutil.net_connections("tcp") if c.status == "LISTEN" and c.laddr.port == port)
    os.kill(pid, signal.SIGKILL)


async def reward(args, sample):
    """The label check, after asking the teacher (by name) for the prompt's log-probs: its weight
    version and URL are logged beside the policy's."""
    if sample.weight_version == 1:
        kill_teacher_engine_once()
    start = len(sample.tokens) - sample.response_length
    out = await context().model("teacher").generate({{
        "input_ids": sample.tokens, "sampling_params": {{"max_new_tokens": 0}}, "return_logprob": True,
        "logprob_start_len": start}})
    with open(LOG, "a") as f:
        f.write(json.dumps({{"teacher_version": out["meta_info"].get("weight_version"),
                            "policy_version": sample.weight_version,
                            "scored": len(out["meta_info"]["input_token_logprobs"]),
                            "response_length": sample.response_length,
                            "teacher_url": get_model_url(args, "teacher"),
                            "policy_url": get_model_url(args, "actor")}}) + "\\n")
    return float(str(sample.label) in sample.response)
'''


def test_frozen_teacher_is_served_reached_by_name_and_distilled_from(task, tmp_path):
    teacher = tmp_path / "teacher"
    shutil.copytree(task["model"], teacher)  # the student's starting weights under another path
    config = tmp_path / "served.yaml"
    config.write_text(textwrap.dedent(f"""
        sglang:
          - name: actor
            server_groups: [{{worker_type: regular, num_gpus: 1}}]
          - name: teacher
            model_path: {teacher}
            update_weights: false
            server_groups: [{{worker_type: regular, num_gpus: 1}}]
        """))
    log = tmp_path / "calls.jsonl"
    reward = tmp_path / "teacher_reward.py"
    reward.write_text(REWARD.format(log=str(log)))
    out = tmp_path / "out"
    r = run(shape_cmd(task, out, "--sglang-config", str(config), "--rollout-num-gpus", "2",
                      "--custom-rm-path", f"{reward}:reward", "--use-opd", "--opd-type", "sglang",
                      "--opd-kl-coef", "1.0", "--rollout-temperature", "1.0", "--use-fault-tolerance",
                      "--rollout-health-check-interval", "1"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "served beside the policy (actor): teacher at http://127.0.0.1:" in r.stdout
    assert (out / "logs" / "engine_teacher_0.log").is_file() and (out / "logs" / "router_teacher.log").is_file()
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) == 3 * 16
    # the teacher scored every response token, behind its own router, and kept its weights while the
    # policy's version rose with every push
    assert all(c["scored"] == c["response_length"] for c in calls)
    assert len({c["teacher_url"] for c in calls}) == 1 and calls[0]["teacher_url"] != calls[0]["policy_url"]
    assert len({c["teacher_version"] for c in calls}) == 1
    assert sorted({c["policy_version"] for c in calls}) == [0, 1, 2]
    # the teacher's engine, killed during the second rollout, was restarted from its own checkpoint
    # (every call still answered, the version unchanged) and the restart counted
    assert (tmp_path / "calls.jsonl.killed").exists()
    recs = {rec["rollout_id"]: rec for rec in records(out) if "trained_rollouts" not in rec}
    assert sum(recs[i]["rollout/engine_restarts"] for i in range(3)) >= 1
    kl = [recs[i]["train/opd_reverse_kl"] for i in range(3)]
    # the teacher starts as the student: no gap at the first rollout (fp32 on both sides, T = 1), one
    # after the student moved
    assert abs(kl[0]) < 1e-4, kl
    assert abs(kl[2]) > 10 * abs(kl[0]), kl
