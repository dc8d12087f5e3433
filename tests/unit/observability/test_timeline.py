"""The rollout timeline: span bookkeeping (slime.observability.spans) on a fake engine that reports
the native engine's timing, the default, multi-turn and group-reward paths, the per-rollout file the
manager writes, the HTML page and summary (slime.observability.timeline_page), the CLI
(`python -m slime.timeline`), `--profile-rollouts` and the training rollout's pass@k and lengths."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoTokenizer

from slime.observability import spans
from slime.observability.profiling import profile_rollout
from slime.observability.spans import add_engine_call, close_sample, coverage, sample_span
from slime.observability.timeline_page import COLORS, render_html, summarize
from slime.profile_flags import parse_rollout_range
from slime.rollout import api
from slime.rollout.group_generation import GroupRunner, generate_groups
from slime.rollout.manager import RolloutManager
from slime.rollout.metrics import rollout_metrics
from slime.rollout.multiturn import run_tool_loop
from slime.rollout.rewards import build_reward
from slime.timeline import write_timeline
from slime.types import Sample, SampleStatus
from slime.utils.errors import SlimeConfigError, SlimeError
from tests.helpers.args import make_args
from tests.helpers.rollout import ScriptedFleet

TOL = 5e-3  # seconds of gap or overlap a sample's spans may show over its wall time


class TimedFleet(ScriptedFleet):
    """Two fake engines, one request at a time each (the rest wait: queued), 10 ms prefill and 2 ms per
    output token; answers carry the native engine's timing (queue_time, prefill_time, e2e_latency) and
    engine_url, measured as they happen."""

    def __init__(self, tokens: int = 10):
        super().__init__(lambda payload: ("ab", list(range(5, 5 + tokens)), "length", None))
        self.urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
        self.n = 0
        self._locks: dict = {}

    async def generate(self, payload: dict) -> dict:
        url = self.urls[self.n % 2]
        self.n += 1
        lock = self._locks.setdefault(url, asyncio.Lock())
        t0 = time.perf_counter()
        async with lock:
            t1 = time.perf_counter()
            await asyncio.sleep(0.01)
            t2 = time.perf_counter()
            out = await super().generate(payload)
            await asyncio.sleep(0.002 * len(out["output_ids"]))
        out["meta_info"].update(queue_time=t1 - t0, prefill_time=t2 - t1, e2e_latency=time.perf_counter() - t0,
                                engine_url=url)
        return out


async def slow_reward(args, sample):
    await asyncio.sleep(0.02)
    return float(sample.index % 2)


async def slow_group_reward(args, samples):
    await asyncio.sleep(0.02)
    return [1.0] * len(samples)


def _window(s: Sample) -> tuple[float, float]:
    return min(x["start"] for x in s.spans), max(x["end"] for x in s.spans)


def _kinds(s: Sample) -> dict[str, float]:
    out: dict[str, float] = {}
    for x in s.spans:
        out[x["kind"]] = out.get(x["kind"], 0.0) + x["end"] - x["start"]
    return out


# ------------------------------------------------------------------------------ bookkeeping
def test_engine_call_split_and_plain_generate():
    s = Sample()
    add_engine_call(s, 100.0, 101.0, {"queue_time": 0.2, "prefill_time": 0.1, "e2e_latency": 0.8},
                    engine="http://e:1", weight_version=3, tokens=7)
    assert [(x["kind"], round(x["start"], 6), round(x["end"], 6)) for x in s.spans] == [
        ("queued", 100.0, 100.4), ("prefill", 100.4, 100.5), ("decode", 100.5, 101.0)]
    assert s.spans[2]["engine"] == "http://e:1" and s.spans[2]["weight_version"] == 3 and s.spans[2]["tokens"] == 7
    # an engine that reports no split (SGLang, vLLM, a stand-in): one generate span, nothing made up
    t = Sample()
    add_engine_call(t, 5.0, 6.0, {"e2e_latency": 0.9}, weight_version=1)
    assert t.spans == [{"kind": "generate", "start": 5.0, "end": 6.0, "weight_version": 1}]
    # engine timing longer than the client saw (clock skew): clamped into the window
    u = Sample()
    add_engine_call(u, 0.0, 1.0, {"queue_time": 0.0, "prefill_time": 0.8, "e2e_latency": 2.0})
    assert coverage(u.spans, 0.0, 1.0) == (0.0, 0.0) and u.spans[0]["kind"] == "prefill"


def test_close_sample_fills_gaps_and_keeps_earlier_rollouts():
    s = Sample(spans=[{"kind": "decode", "start": 1.0, "end": 2.0}])  # an earlier rollout (partial rollout)
    spans.add_span(s, "generate", 10.5, 11.0)
    spans.add_span(s, "reward", 11.5, 12.0)
    close_sample(s, 10.0, 12.25)
    assert [(x["kind"], x["start"], x["end"]) for x in s.spans] == [
        ("decode", 1.0, 2.0), ("other", 10.0, 10.5), ("generate", 10.5, 11.0), ("other", 11.0, 11.5),
        ("reward", 11.5, 12.0), ("other", 12.0, 12.25)]
    assert coverage(s.spans, 10.0, 12.25) == (0.0, 0.0)
    assert coverage([{"start": 0, "end": 2}, {"start": 1, "end": 3}], 0, 4) == (1.0, 1.0)


def test_sample_span_records_on_error_and_extra_attributes():
    s = Sample()
    with pytest.raises(ValueError):
        with sample_span(s, "tool", name="search") as attrs:
            attrs["ok"] = False
            raise ValueError("boom")
    assert s.spans[0]["kind"] == "tool" and s.spans[0]["name"] == "search" and s.spans[0]["ok"] is False
    assert api.sample_span is sample_span


def test_spans_travel_with_the_sample():
    s = Sample(prompt="p", tokens=[1, 2], response_length=1, status=SampleStatus.COMPLETED)
    spans.add_span(s, "decode", 1.0, 2.0, engine="http://e:1")
    d = json.loads(json.dumps(s.to_dict()))
    assert Sample.from_dict(d).spans == s.spans
    del d["spans"]  # a dump written before spans existed
    assert Sample.from_dict(d).spans == []


# ------------------------------------------------------------------------------ rollout paths
def _runner(tiny_model_dir, tmp_path, fleet, *flags):
    args = make_args(tiny_model_dir, tmp_path, "--custom-rm-path", f"{__name__}.slow_reward", *flags)
    return args, GroupRunner(args, fleet, build_reward(args))


def _groups(n_groups, n):
    out = []
    for g in range(n_groups):
        out.append([Sample(prompt="p", tokens=[1, 2, 3], index=g * n + j, group_index=g) for j in range(n)])
    return out


def test_default_path_spans_cover_each_sample_without_gaps_or_overlaps(tiny_model_dir, tmp_path):
    args, runner = _runner(tiny_model_dir, tmp_path, TimedFleet())
    before = time.time()
    groups = asyncio.run(generate_groups(runner, _groups(3, 2), 0, False))
    after = time.time()
    samples = [s for g in groups for s in g]
    for s in samples:
        a, b = _window(s)
        assert before <= a and b <= after
        gap, overlap = coverage(s.spans, a, b)
        assert gap < TOL and overlap < TOL, s.spans
        k = _kinds(s)
        assert {"prefill", "decode", "reward"} <= set(k), s.spans
        assert k.get("other", 0.0) < TOL  # the recorded spans explain the wall time
        assert k["reward"] >= 0.018 and k["prefill"] >= 0.009 and k["decode"] >= 0.018
        engine_spans = [x for x in s.spans if x["kind"] in ("prefill", "decode")]
        assert all(x["engine"] in TimedFleet().urls and x["weight_version"] == 4 for x in engine_spans)
    # every sample launched at once, two engines one request at a time: later ones queued
    assert max(_kinds(s).get("queued", 0.0) for s in samples) > 0.05
    assert min(_window(s)[0] for s in samples) - before < 0.05


def test_group_reward_waits_and_tool_loop_spans(tiny_model_dir, tmp_path):
    args = make_args(tiny_model_dir, tmp_path, "--custom-rm-path", f"{__name__}.slow_group_reward", "--group-rm")
    runner = GroupRunner(args, TimedFleet(), build_reward(args))
    groups = asyncio.run(generate_groups(runner, _groups(1, 3), 0, False))
    for s in groups[0]:
        a, b = _window(s)
        gap, overlap = coverage(s.spans, a, b)
        assert gap < TOL and overlap < TOL and _kinds(s)["reward"] >= 0.018
        assert s.spans[-1]["kind"] == "reward" and s.spans[-1]["name"] == "group"
    assert any("wait" in _kinds(s) for s in groups[0])  # done before the others: waited for its group


def test_tool_loop_records_tool_and_env_spans(tiny_model_dir, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    eos = tok.eos_token_id
    call = '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>'
    turn1 = tok("compute", add_special_tokens=False)["input_ids"] + [eos]
    turn2 = tok("seven", add_special_tokens=False)["input_ids"] + [eos]
    fleet = ScriptedFleet([(call, turn1, "stop", eos), ("seven", turn2, "stop", eos)])
    args = make_args(tiny_model_dir, tmp_path, "--max-turns", 4, "--rollout-max-response-len", 64)

    def add(a, b):
        time.sleep(0.03)
        return a + b

    async def episode():
        s = Sample(prompt="q", tokens=tok("what is 3 plus 4 ?")["input_ids"])
        start = time.time()
        await run_tool_loop(args, s, {"max_new_tokens": 64}, {"add": add})
        close_sample(s, start, time.time())
        return s, start

    api.set_context(api.RolloutContext(args, tok, fleet, "http://unused"))
    try:
        s, start = asyncio.run(episode())
    finally:
        api.set_context(None)
    kinds = [x["kind"] for x in s.spans if x["kind"] != "other"]
    assert kinds == ["generate", "tool", "env", "generate"]
    tool = next(x for x in s.spans if x["kind"] == "tool")
    assert tool["name"] == "add" and tool["end"] - tool["start"] >= 0.029
    a, b = _window(s)
    assert coverage(s.spans, a, b)[0] < TOL and coverage(s.spans, a, b)[1] < TOL


# ------------------------------------------------------------------------------ file, page, CLI
def _manager_run(tiny_model_dir, tmp_path, monkeypatch):
    data = "".join(json.dumps({"input": f"say {i}", "label": str(i)}) + "\n" for i in range(4))
    (tmp_path / "prompts.jsonl").write_text(data)
    args = make_args(tiny_model_dir, tmp_path, "--custom-rm-path", f"{__name__}.slow_reward",
                     "--rollout-batch-size", 2, "--n-samples-per-prompt", 2, "--global-batch-size", 4,
                     "--num-rollout", 2)
    monkeypatch.setattr("ray.put", lambda x: x)
    fleet = TimedFleet()
    m = RolloutManager(args, fleet=fleet)
    m.init()
    _, metrics = m.generate(0)
    m.generate(1)
    return args, metrics


def test_manager_writes_the_rollout_file_and_the_cli_draws_it(tiny_model_dir, tmp_path, monkeypatch):
    args, metrics = _manager_run(tiny_model_dir, tmp_path, monkeypatch)
    path = spans.rollout_path(args.output_dir, 0)
    header, rows = spans.read_rollout(path)
    assert header["rollout_id"] == 0 and header["engines"] == TimedFleet().urls
    assert len(rows) == 4 and all(r["trained"] for r in rows)
    for r in rows:
        a, b = min(x["start"] for x in r["spans"]), max(x["end"] for x in r["spans"])
        assert header["start"] <= a and b <= header["end"]
        assert sum(coverage(r["spans"], a, b)) < TOL
    # pass@k and length statistics of the training rollout (slow_reward passes odd indices)
    assert metrics["rollout/pass@1"] == pytest.approx(0.5) and metrics["rollout/pass@2"] == 1.0
    assert metrics["rollout/response_len/p50"] == 10.0 and metrics["rollout/response_len/std"] == 0.0

    page, summary = write_timeline(args.output_dir, 0)
    assert page == path.with_suffix(".html")
    text = page.read_text()
    assert text.startswith("<!DOCTYPE html>") and "<script" not in text and "http" not in text.split("<svg")[0]
    for kind in ("prefill", "decode", "reward"):
        assert f'fill="{COLORS[kind]}"' in text
    assert "http://127.0.0.1:1" in text and "sample 0 (group 0)" in text
    assert "reward" in summary and "http://127.0.0.1:2" in summary and "busy%" in summary

    proc = subprocess.run([sys.executable, "-m", "slime.timeline", str(args.output_dir)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "rollout 1:" in proc.stdout and f"wrote {spans.rollout_path(args.output_dir, 1).with_suffix('.html')}" \
        in proc.stdout


def test_cli_bad_input_is_one_line(tmp_path):
    def run(*argv):
        p = subprocess.run([sys.executable, "-m", "slime.timeline", *map(str, argv)], capture_output=True,
                           text=True, timeout=120)
        return p.returncode, p.stderr.strip()

    assert run(tmp_path / "nope") == (2, f"slime: error: RUN_DIR {tmp_path / 'nope'} does not exist "
                                         "(give a run's --output-dir)")
    code, err = run(tmp_path)
    assert code == 2 and err.startswith(f"slime: error: {tmp_path / 'timeline'} holds no rollout_<N>.jsonl")
    for k in (0, 1, 2, 5):
        spans.write_rollout(tmp_path, k, [], [], [], 0.0, 1.0)
    code, err = run(tmp_path, "--rollout", 3)
    assert code == 2 and err == (f"slime: error: --rollout 3: {spans.rollout_path(tmp_path, 3)} does not exist; "
                                 f"{tmp_path} has the timelines of rollouts 0-2, 5")
    spans.rollout_path(tmp_path, 2).write_text('{"rollout_id": 2}\n{not json\n')
    code, err = run(tmp_path, "--rollout", 2)
    assert code == 2 and err == f"slime: error: {spans.rollout_path(tmp_path, 2)}:2: malformed JSON (Expecting " \
                                "property name enclosed in double quotes)"
    assert "\n" not in err


def test_summary_shows_idle_engines_and_the_tail():
    header = {"rollout_id": 7, "start": 0.0, "end": 10.0, "engines": ["http://a", "http://idle"]}
    rows = [{"index": i, "group_index": 0, "status": "completed", "response_length": 3, "trained": True,
             "spans": [{"kind": "queued", "start": 0.0, "end": 1.0, "engine": "http://a"},
                       {"kind": "prefill", "start": 1.0, "end": 2.0, "engine": "http://a"},
                       {"kind": "decode", "start": 2.0, "end": 3.0 + (6.0 if i == 9 else 0.0), "engine": "http://a"},
                       {"kind": "tool", "start": 3.0 + (6.0 if i == 9 else 0.0), "end": 9.5 if i == 9 else 4.0,
                        "name": "t"}]}
            for i in range(10)]
    sm = summarize(header, rows)
    assert sm["engines"]["http://idle"] == {"requests": 0, "samples": 0, "busy": 0.0, "busy_pct": 0.0, "idle": 10.0}
    assert sm["engines"]["http://a"]["requests"] == 10 and sm["engines"]["http://a"]["busy"] == pytest.approx(8.0)
    assert sm["slowest"][0]["index"] == 9 and sm["slowest"][0]["most"] == "decode"
    assert sm["tail"] == pytest.approx(5.5) and sm["sample_wall"]["max"] == pytest.approx(9.5)
    assert sm["kinds"]["tool"]["count"] == 10
    html_text = render_html(header, rows)
    assert html_text.count(f'fill="{COLORS["tool"]}"') == 10 and "http://idle" in html_text


# ------------------------------------------------------------------------------ profiling, flags
def test_profile_rollouts_range_and_traces(tiny_model_dir, tmp_path):
    assert parse_rollout_range("2-3") == (2, 3) and parse_rollout_range("4") == (4, 4)
    for bad, msg in (("3-2", "--profile-rollouts 3-2: the range ends (2) before it starts (3)"),
                     ("a-b", "--profile-rollouts 'a-b': expected A-B (rollout ids, e.g. 2-3) or one id N")):
        with pytest.raises(SlimeConfigError) as e:
            parse_rollout_range(bad)
        assert str(e.value) == msg
    with pytest.raises(SlimeConfigError, match=r"--profile-rollouts 5-6: this run trains rollouts 0-1"):
        make_args(tiny_model_dir, tmp_path, "--num-rollout", 2, "--profile-rollouts", "5-6")
    args = make_args(tiny_model_dir, tmp_path, "--num-rollout", 3, "--profile-rollouts", "1-2")
    assert args.profile_rollout_range == (1, 2)
    for rollout_id in range(3):
        with profile_rollout(args, rollout_id, rank=0, role="actor"):
            torch.randn(64, 64) @ torch.randn(64, 64)
    out = tmp_path / "out" / "profiles"
    assert sorted(p.name for p in out.iterdir()) == [
        "rollout_1_actor_rank0.trace.json", "rollout_1_actor_rank0.txt",
        "rollout_2_actor_rank0.trace.json", "rollout_2_actor_rank0.txt"]
    assert "traceEvents" in json.loads((out / "rollout_1_actor_rank0.trace.json").read_text())
    assert "aten::mm" in (out / "rollout_1_actor_rank0.txt").read_text()


def test_training_rollout_pass_at_k_and_lengths(tiny_model_dir, tmp_path):
    args = make_args(tiny_model_dir, tmp_path)
    samples = []
    for g, rewards in enumerate(([1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0])):
        for j, r in enumerate(rewards):
            samples.append(Sample(group_index=g, index=4 * g + j, reward=r, response_length=4 * g + j + 1,
                                  status=SampleStatus.COMPLETED))
    m = rollout_metrics(args, samples, samples, elapsed=1.0, sample_filter=False)
    assert m["rollout/pass@1"] == pytest.approx(0.125) and m["rollout/pass@2"] == pytest.approx(0.25)
    assert m["rollout/pass@4"] == pytest.approx(0.5) and "rollout/pass@8" not in m
    assert m["rollout/response_len/min"] == 1 and m["rollout/response_len/max"] == 8
    assert m["rollout/response_len/p50"] == pytest.approx(4.5) and m["rollout/response_len/p90"] == pytest.approx(7.3)
    assert m["rollout/response_len/pass_mean"] == 1.0 and m["rollout/response_len/fail_mean"] == pytest.approx(5.0)
    with pytest.raises(SlimeError):
        write_timeline(tmp_path / "missing")


@pytest.mark.slow
def test_page_shows_the_bars_in_headless_chromium(tmp_path):
    """scripts/check_timeline_html.sh: a screenshot of the page holds the bars' colours."""
    if not any(shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome")):
        pytest.skip("no chromium on PATH (Debian: apt-get install -y chromium): the page is not checked in a browser")
    proc = subprocess.run(["bash", "scripts/check_timeline_html.sh", str(tmp_path)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 0 and "OK:" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
