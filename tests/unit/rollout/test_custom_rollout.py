"""Custom rollout plumbing: rewards (remote, reasoning-gym, group), data sources and the buffer,
row slices and --tool-key, --custom-config-path, eval metrics (pass@k, --eval-function-path),
sample filters and batch fitting. No engines: generation is faked where needed."""

import asyncio
import json
import math

import pytest
from aiohttp import web

from slime.arguments import parse_args
from slime.rollout.generate import score, score_group
from slime.rollout.rewards import RewardFunction
from slime.types import Sample, SampleStatus
from slime.utils.errors import DataError, SlimeConfigError
from tests.helpers.args import make_args
from tests.helpers.rollout import ScriptedFleet


def _args(model_dir, tmp_path, *extra, data='{"input": "1 + 1", "label": "2"}\n'):
    (tmp_path / "prompts.jsonl").write_text(data)
    return make_args(model_dir, tmp_path, "--label-key", "label", *extra)


# ------------------------------------------------------------------------- remote reward


class _RewardServer:
    """A reward service on 127.0.0.1 whose paths behave differently; counts calls per path."""

    def __init__(self):
        self.calls: dict[str, int] = {}

    async def handle(self, request):
        path = request.path
        self.calls[path] = self.calls.get(path, 0) + 1
        body = await request.json()
        if path == "/ok":
            return web.json_response({"reward": float(body["response"] == body["label"])})
        if path == "/dict":
            return web.json_response({"acc": 1.0, "format": 0.5})
        if path == "/flaky" and self.calls[path] < 3:
            return web.Response(status=503, text="busy")
        if path == "/flaky":
            return web.json_response(0.75)
        if path == "/bad":
            return web.Response(status=422, text="no label")
        if path == "/slow":
            await asyncio.sleep(5)
        return web.Response(status=500, text="broken")


async def _with_server(fn):
    server = _RewardServer()
    app = web.Application()
    app.router.add_route("POST", "/{tail:.*}", server.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        return await fn(f"http://127.0.0.1:{port}", server)
    finally:
        await runner.cleanup()


def test_remote_reward_retries_then_fails_the_sample_never_scores_zero(tiny_model_dir, tmp_path):
    from slime.rollout.rewards.remote import RemoteReward

    def args(key=None):
        return _args(tiny_model_dir, tmp_path, "--rm-timeout", 10, *(["--reward-key", key] if key else []))

    async def run(url, server):
        def rm(path, timeout=10.0, retries=2):
            return RewardFunction(RemoteReward(url + path, timeout, retries))

        def s():
            return Sample(prompt="q", response="4", label="4", status=SampleStatus.COMPLETED)

        ok = await score(rm("/ok"), args(), s())
        flaky = await score(rm("/flaky"), args(), s())
        bad = await score(rm("/bad"), args(), s())
        broken = await score(rm("/broken", retries=1), args(), s())
        slow = await score(rm("/slow", timeout=0.3, retries=1), args(), s())
        d = await score(rm("/dict"), args("acc"), s())
        return server.calls, ok, flaky, bad, broken, slow, d

    calls, ok, flaky, bad, broken, slow, d = asyncio.run(_with_server(run))
    assert ok.reward == 1.0 and ok.status == SampleStatus.COMPLETED
    assert flaky.reward == 0.75 and calls["/flaky"] == 3  # two 503s retried
    assert bad.reward is None and bad.status == SampleStatus.FAILED and calls["/bad"] == 1  # 4xx: no retry
    assert broken.status == SampleStatus.FAILED and calls["/broken"] == 2  # 1 + 1 retry
    assert slow.status == SampleStatus.FAILED and calls["/slow"] == 2
    assert d.reward == 1.0 and d.reward_dict == {"acc": 1.0, "format": 0.5}


def test_rm_timeout_bounds_each_attempt_and_the_retries_happen(tiny_model_dir, tmp_path):
    """Through the parser: --rm-timeout is each attempt's bound, so an attempt that times out is
    retried (the whole call is bounded by all attempts), and the sample fails after the last."""
    from slime.rollout.rewards import build_reward

    async def run(url, server):
        args = _args(tiny_model_dir, tmp_path, "--rm-url", url + "/slow", "--rm-timeout", "0.4",
                     "--rm-max-retries", "2")
        reward = build_reward(args)
        assert reward.time_limit(args.rm_timeout) == pytest.approx(3 * 0.4 + 0.5 + 1.0 + 1.0)
        t0 = asyncio.get_running_loop().time()
        out = await score(reward, args, Sample(prompt="q", response="4", label="4"))
        return server.calls, out, asyncio.get_running_loop().time() - t0

    calls, out, seconds = asyncio.run(_with_server(run))
    assert calls["/slow"] == 3 and out.status == SampleStatus.FAILED and out.reward is None
    assert 3 * 0.4 + 1.5 <= seconds < 3 * 0.4 + 1.5 + 1.0  # three timed-out attempts and two backoffs


def test_rm_flags(tiny_model_dir, tmp_path):
    a = _args(tiny_model_dir, tmp_path, "--rm-url", "http://127.0.0.1:9/score")
    assert a.rm_type == "remote_rm"
    assert _args(tiny_model_dir, tmp_path).rm_type == "math"
    for extra, msg in [
        (["--rm-type", "remote_rm"], "--rm-type remote_rm needs --rm-url"),
        (["--rm-type", "exact", "--rm-url", "http://x"], "--rm-url is only used with --rm-type remote_rm"),
        (["--rm-url", "ftp://x"], "--rm-url must be an http"),
        (["--group-rm"], "--group-rm needs --custom-rm-path"),
        (["--custom-rm-path", "nope.module.fn"], "--custom-rm-path nope.module.fn: cannot import module"),
        (["--max-turns", "0"], "--max-turns must be >= 1"),
    ]:
        with pytest.raises(SlimeConfigError, match=msg):
            _args(tiny_model_dir, tmp_path, *extra)


def test_group_reward_and_sync_or_async_functions(tiny_model_dir, tmp_path):
    args = _args(tiny_model_dir, tmp_path, "--rm-timeout", 5)

    async def by_rank(args, samples):
        order = sorted(range(len(samples)), key=lambda i: len(samples[i].response))
        return [float(order.index(i)) for i in range(len(samples))]

    group = [Sample(response="x" * k, index=k) for k in (3, 1, 2)]
    out = asyncio.run(score_group(RewardFunction(by_rank, group=True), args, group))
    assert [s.reward for s in out] == [2.0, 0.0, 1.0]

    def nan_for_empty(args, samples):
        return [float("nan") if not s.response else 1.0 for s in samples]

    out = asyncio.run(score_group(RewardFunction(nan_for_empty, group=True), args,
                                  [Sample(response=""), Sample(response="a")]))
    assert [s.status for s in out] == [SampleStatus.FAILED, SampleStatus.PENDING] and out[1].reward == 1.0

    def infinite(args, samples):  # a remote RM's JSON `Infinity` parses to the same float
        return [float("inf"), 0.0, float("-inf"), 1.0]

    out = asyncio.run(score_group(RewardFunction(infinite, group=True), args,
                                  [Sample(index=i, group_index=0) for i in range(4)]))
    assert [s.status for s in out] == [SampleStatus.FAILED, SampleStatus.PENDING, SampleStatus.FAILED,
                                       SampleStatus.PENDING]
    # the group's normalized rewards stay finite: the failed ones get 0, the others are normalized alone
    from slime.rollout.train_data import train_rewards

    rewards = train_rewards(args, out, None)
    assert rewards[0] == rewards[2] == 0.0 and rewards[1] < 0 < rewards[3]
    assert all(r == r and abs(r) < 10 for r in rewards)

    def wrong_length(args, samples):
        return [1.0]

    out = asyncio.run(score_group(RewardFunction(wrong_length, group=True), args, [Sample(), Sample()]))
    assert all(s.status == SampleStatus.FAILED and s.reward is None for s in out)


# ------------------------------------------------------------------------- reasoning gym


def test_reasoning_gym_rows_and_verifier():
    from slime.data.reasoning_gym import make_rows
    from slime.rollout.rewards.reasoning_gym import reasoning_gym_reward

    rows = make_rows("chain_sum", size=4, seed=3)
    assert len(rows) == 4 and rows == make_rows("chain_sum", size=4, seed=3)  # deterministic
    row = rows[0]
    json.dumps(row)  # JSON-safe (JSONL export and checkpoints)
    right = Sample(response=f"So <answer>{row['label']}</answer>", metadata=row["metadata"])
    wrong = Sample(response="<answer>123456789</answer>", metadata=row["metadata"])
    bare = Sample(response=f" {row['label']} ", metadata=row["metadata"])
    assert reasoning_gym_reward(None, right) == 1.0
    assert reasoning_gym_reward(None, wrong) == 0.0
    assert reasoning_gym_reward(None, bare) == 1.0
    with pytest.raises(ValueError, match="metadata has no 'reasoning_gym'"):
        reasoning_gym_reward(None, Sample(response="1"))


def test_reasoning_gym_data_source_serves_groups_and_resumes(tiny_model_dir, tmp_path):
    from slime.data.reasoning_gym import ReasoningGymDataSource

    cfg = tmp_path / "rg.yaml"
    cfg.write_text("reasoning_gym:\n  datasets:\n    chain_sum: {size: 5, seed: 1}\n    basic_arithmetic: {size: 3}\n")
    args = parse_args(["--hf-checkpoint", str(tiny_model_dir), "--num-rollout", "2", "--rollout-batch-size", "2",
                       "--n-samples-per-prompt", "3", "--data-source-path",
                       "slime.data.reasoning_gym.ReasoningGymDataSource", "--custom-config-path", str(cfg),
                       "--rm-type", "reasoning_gym", "--output-dir", str(tmp_path / "o")])
    src = ReasoningGymDataSource(args)
    assert len(src) == 8
    groups = src.get_samples(2)
    assert [len(g) for g in groups] == [3, 3]
    assert groups[0][0].metadata["reasoning_gym"]["dataset"] == "chain_sum"
    assert groups[0][0].tokens and groups[0][0].tokens == groups[0][1].tokens
    state = src.state_dict()
    after = [g[0].label for g in src.get_samples(3)]
    again = ReasoningGymDataSource(args)
    again.load_state_dict(state)
    assert [g[0].label for g in again.get_samples(3)] == after


# ------------------------------------------------------------------------- data


def test_row_slices_and_tool_key(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    from slime.data.dataset import count_rows, load_prompts

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"input": f"say {i}", "label": str(i)}) + "\n" for i in range(6)))
    assert [p.label for p in load_prompts(f"{path}@[1:4]", tok, "input", "label")] == ["1", "2", "3"]
    assert [p.label for p in load_prompts(f"{path}@[-2:]", tok, "input", "label")] == ["4", "5"]
    assert count_rows(f"{path}@[:5]") == 5
    with pytest.raises(DataError, match=r"bad row slice '\[a:b\]'"):
        load_prompts(f"{path}@[a:b]", tok, "input")

    tools = [{"type": "function", "function": {"name": "calc", "parameters": {}}}]
    tpath = tmp_path / "t.jsonl"
    tpath.write_text(json.dumps({"input": "compute 1 + 1", "tools": tools}) + "\n")
    (p,) = load_prompts(tpath, tok, "input", None, "metadata", True, None, "tools")
    assert p.metadata["tools"] == tools
    tpath.write_text(json.dumps({"input": "compute", "tools": "calc"}) + "\n")
    with pytest.raises(DataError, match=r"t.jsonl:1: field 'tools' \(--tool-key\) must be a list"):
        load_prompts(tpath, tok, "input", None, "metadata", True, None, "tools")


def test_custom_config_becomes_args(tiny_model_dir, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("search_top_k: 3\ncorpus: docs.jsonl\n")
    a = _args(tiny_model_dir, tmp_path, "--custom-config-path", cfg)
    assert a.search_top_k == 3 and a.custom_config == {"search_top_k": 3, "corpus": "docs.jsonl"}
    cfg.write_text("lr: 0.1\n")
    with pytest.raises(SlimeConfigError, match="key 'lr' is a slime flag or setting"):
        _args(tiny_model_dir, tmp_path, "--custom-config-path", cfg)
    cfg.write_text("- a\n- b\n")
    with pytest.raises(SlimeConfigError, match="must hold a mapping"):
        _args(tiny_model_dir, tmp_path, "--custom-config-path", cfg)
    cfg.write_text("a: 1\nb: [2,\n")  # malformed: one line naming the file and the line
    with pytest.raises(SlimeConfigError, match=r"^--custom-config-path .*c\.yaml: not valid YAML \(line 3\): ") as e:
        _args(tiny_model_dir, tmp_path, "--custom-config-path", cfg)
    assert "\n" not in str(e.value)


def test_eval_only_and_skip_flags(tiny_model_dir, tmp_path):
    ev = tmp_path / "ev.jsonl"
    ev.write_text('{"input": "x", "label": "1"}\n')
    a = _args(tiny_model_dir, tmp_path, "--num-rollout", 0, "--eval-prompt-data", "ev", ev)
    assert a.num_rollout == 0
    with pytest.raises(SlimeConfigError, match="--num-rollout must be >= 1 \\(or 0 with --eval-prompt-data"):
        _args(tiny_model_dir, tmp_path, "--num-rollout", 0)
    with pytest.raises(SlimeConfigError, match="eval-only run; --skip-eval-before-train"):
        _args(tiny_model_dir, tmp_path, "--num-rollout", 0, "--eval-prompt-data", "ev", ev,
              "--skip-eval-before-train")


# ------------------------------------------------------------------------- buffer


def test_data_buffer_is_served_first_through_the_buffer_filter(tiny_model_dir, tmp_path):
    from slime.data.source import RolloutDataSource

    hook = tmp_path / "bf.py"
    hook.write_text("def newest_first(args, buffer, num_groups):\n    return buffer[::-1][:num_groups]\n")
    data = "".join(json.dumps({"input": f"say {i}", "label": str(i)}) + "\n" for i in range(4))
    src = RolloutDataSource(_args(tiny_model_dir, tmp_path, "--n-samples-per-prompt", 2, data=data))
    src.add_samples([[Sample(label="b1")], [Sample(label="b2")]])
    assert [g[0].label for g in src.get_samples(3)] == ["b1", "b2", "0"]
    src.add_samples([[Sample(label="b3", status=SampleStatus.ABORTED)]])
    state = json.loads(json.dumps(src.state_dict()))  # what a checkpoint holds
    fresh = RolloutDataSource(_args(tiny_model_dir, tmp_path, "--n-samples-per-prompt", 2, data=data))
    fresh.load_state_dict(state)
    got = fresh.get_samples(2)
    assert got[0][0].label == "b3" and got[0][0].status == SampleStatus.ABORTED and got[1][0].label == "1"

    src = RolloutDataSource(_args(tiny_model_dir, tmp_path, "--buffer-filter-path", f"{hook}:newest_first",
                                  data=data))
    src.add_samples([[Sample(label="b1")], [Sample(label="b2")], [Sample(label="b3")]])
    assert [g[0].label for g in src.get_samples(2)] == ["b3", "b2"]
    assert [g[0].label for g in src.get_samples(2)] == ["b1", "0"]


# ------------------------------------------------------------------------- manager


def test_pass_at_k():
    from slime.rollout.metrics import pass_at_k

    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - math.comb(3, 2) / math.comb(4, 2))
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0


REWARD_BY_POSITION = [1.0, 0.0, 0.0, 0.0]


def reward_by_position(args, sample):
    """Sample j of a group scores REWARD_BY_POSITION[j % 4]."""
    return REWARD_BY_POSITION[sample.index % args.n_samples_per_prompt % 4]


def _offline_manager(tiny_model_dir, tmp_path, monkeypatch, *extra, data=None):
    """A RolloutManager whose engines are scripted (every answer: tokens [5, 6]) and whose reward of
    sample j of a group is REWARD_BY_POSITION[j % 4]."""
    from slime.rollout.manager import RolloutManager

    tmp_path.mkdir(parents=True, exist_ok=True)
    data = data or "".join(json.dumps({"input": f"say {i}", "label": str(i)}) + "\n" for i in range(4))
    args = _args(tiny_model_dir, tmp_path, "--custom-rm-path", f"{__name__}.reward_by_position", *extra, data=data)
    monkeypatch.setattr("ray.put", lambda x: x)
    m = RolloutManager(args, fleet=ScriptedFleet(lambda payload: ("ab", [5, 6], "stop", None)))
    m.init()
    return m


def test_eval_reports_mean_reward_and_pass_at_k(tiny_model_dir, tmp_path, monkeypatch):
    ev = tmp_path / "ev.jsonl"
    ev.write_text('{"input": "p", "label": "1"}\n{"input": "q", "label": "0"}\n')
    m = _offline_manager(tiny_model_dir, tmp_path, monkeypatch, "--n-samples-per-eval-prompt", 4,
                         "--n-samples-per-prompt", 4, "--global-batch-size", 4, "--eval-prompt-data", "toy", ev)
    metrics = m.eval(0)
    assert metrics["eval/toy"] == 0.25
    assert metrics["eval/toy/pass@1"] == pytest.approx(0.25)
    assert metrics["eval/toy/pass@2"] == pytest.approx(0.5)
    assert metrics["eval/toy/pass@4"] == 1.0
    assert "eval/toy/pass@8" not in metrics and metrics["eval/toy/response_len/mean"] == 2.0

    hook = tmp_path / "ev.py"
    hook.write_text("async def evaluate(args, rollout_id):\n    return {'custom/score': rollout_id * 0.5}\n")
    m = _offline_manager(tiny_model_dir, tmp_path / "b", monkeypatch, "--eval-function-path", f"{hook}:evaluate")
    assert m.eval(4) == {"eval/custom/score": 2.0}


def test_sample_filter_removes_from_loss_and_extra_samples_are_dropped(tiny_model_dir, tmp_path, monkeypatch):
    from slime.rollout.train_data import fit_batch

    hook = tmp_path / "sf.py"
    hook.write_text("def drop_second(args, groups):\n    for g in groups:\n        g[1].remove_sample = True\n")
    m = _offline_manager(tiny_model_dir, tmp_path, monkeypatch, "--n-samples-per-prompt", 2, "--rollout-batch-size", 2,
                         "--rollout-sample-filter-path", f"{hook}:drop_second")
    (batch,), metrics = m.generate(0)
    assert [sum(x) for x in batch.loss_masks] == [2, 0, 2, 0]
    assert metrics["rollout/removed_samples"] == 2.0

    extra = {}
    samples = [Sample(index=i) for i in range(6)]
    assert fit_batch(m.args, samples, extra) == samples[:4] and extra == {"rollout/dropped_samples": 2.0}
    with pytest.raises(ValueError, match="produced 3 samples, fewer than"):
        fit_batch(m.args, samples[:3], {})
