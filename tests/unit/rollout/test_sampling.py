"""Asynchronous rollout pieces without real engines: over-sampling with abort, resuming partial
samples (and masking their older tokens), staleness bookkeeping, and the fully asynchronous
generator's bound on groups in flight."""

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from slime.rollout.group_generation import FullyAsyncGenerator, GroupRunner, generate_until
from slime.rollout.rewards import RewardFunction
from slime.types import Sample, SampleStatus
from tests.helpers.args import make_args

ROOT = Path(__file__).resolve().parents[3]


class FakeEngines:
    """Prompt token t takes `delay[t]` seconds to produce all its tokens; an abort ends every request
    in flight with one token. Records every payload; the weight version is settable."""

    def __init__(self, delay):
        self.delay = delay
        self.aborted = asyncio.Event()
        self.payloads = []
        self.version = "3"
        self.in_flight = self.max_in_flight = 0

    async def generate(self, payload):
        self.payloads.append(payload)
        n = payload["sampling_params"]["max_new_tokens"]
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.wait_for(self.aborted.wait(), self.delay[payload["input_ids"][0]])
            ids, finish = [7], "abort"
        except asyncio.TimeoutError:
            ids, finish = [7] * n, "length"
        finally:
            self.in_flight -= 1
        return {"text": " x" * len(ids), "output_ids": ids,
                "meta_info": {"finish_reason": {"type": finish}, "weight_version": self.version,
                              "output_token_logprobs": [[-0.5, t, None] for t in ids]}}

    async def abort_all(self):
        self.aborted.set()


def _args(tiny_model_dir, tmp_path, *extra):
    return make_args(tiny_model_dir, tmp_path, "--rollout-batch-size", 2, "--n-samples-per-prompt", 2,
                     "--rollout-max-response-len", 6, *extra, data='{"input": "x"}\n')


def _groups(prompt_tokens, n=2):
    return [[Sample(prompt=f"p{t}", tokens=[t, 1], index=g * n + j, group_index=g) for j in range(n)]
            for g, t in enumerate(prompt_tokens)]


def test_over_sampling_keeps_the_first_complete_groups_and_aborts_the_rest(tiny_model_dir, tmp_path):
    args = _args(tiny_model_dir, tmp_path, "--over-sampling-batch-size", 4, "--partial-rollout",
                 "--mask-offpolicy-in-partial-rollout")
    engines = FakeEngines({10: 0.01, 11: 0.02, 12: 30.0, 13: 30.0})
    runner = GroupRunner(args, engines, RewardFunction(lambda a, s: 1.0), version_now=lambda: 3)

    async def run():
        kept, dropped, rest = await generate_until(runner, _groups([12, 10, 13, 11]), 0, target=2, keep=lambda g: True)
        assert [g[0].tokens[0] for g in kept] == [10, 11] and dropped == []
        assert sorted(g[0].tokens[0] for g in rest) == [12, 13]
        for g in rest:  # aborted after one token: partial, unscored, version recorded
            for s in g:
                assert s.status == SampleStatus.ABORTED and s.response_length == 1 and s.reward is None
                assert s.loss_mask == [1] and s.weight_versions == [3]
        assert all(s.reward == 1.0 and s.response_length == 6 for g in kept for s in g)

        # next rollout: the partial samples resume with the rest of their budget under new weights
        engines.aborted.clear()
        engines.delay[12] = engines.delay[13] = 0.01
        engines.version = "4"
        runner.version_now = lambda: 4
        engines.payloads.clear()
        resumed = await runner.group(rest[0], rollout_id=1)
        assert [p["sampling_params"]["max_new_tokens"] for p in engines.payloads] == [5, 5]
        assert all(p["input_ids"][-1] == 7 and len(p["input_ids"]) == 3 for p in engines.payloads)
        for s in resumed:
            assert s.status == SampleStatus.TRUNCATED and s.response_length == 6 and s.reward == 1.0
            assert s.loss_mask == [0, 1, 1, 1, 1, 1]  # the token from the older policy is masked
            assert s.weight_versions == [3, 4] and s.staleness(4) == 1

        # a finished group from the buffer is not generated again
        engines.payloads.clear()
        assert await runner.group(kept[0], rollout_id=1) == kept[0] and engines.payloads == []

    asyncio.run(run())


def test_stale_partial_samples_start_over(tiny_model_dir, tmp_path):
    from slime.rollout.manager import RolloutManager
    from slime.rollout.metrics import staleness_metrics
    from slime.rollout.sampling import Staleness

    staleness = Staleness(max_staleness=1)
    s = Sample(tokens=[1, 2], prompt="p")
    s.append_model_tokens([5, 6], [-1.0, -1.0])
    s.weight_versions, s.status = [2], SampleStatus.ABORTED
    fresh = Sample(tokens=[1, 2])
    fresh.append_model_tokens([5], [-1.0])
    fresh.weight_versions, fresh.status = [3], SampleStatus.ABORTED
    staleness.refresh([[s, fresh]], rollout_id=4)
    assert s.tokens == [1, 2] and s.response_length == 0 and s.status == SampleStatus.PENDING
    assert s.weight_versions == [] and s.loss_mask is None
    assert fresh.response_length == 1  # lag 1 <= bound: kept
    assert staleness.counts["regenerated_samples"] == 1
    metrics = staleness_metrics([fresh, Sample(weight_versions=[4]), Sample(weight_versions=[4])], 4, staleness.counts)
    assert metrics["rollout/staleness/mean"] == pytest.approx(1 / 3) and metrics["rollout/staleness/max"] == 1.0
    assert metrics["rollout/staleness/count_0"] == 2.0 and metrics["rollout/staleness/count_1"] == 1.0
    # the counters are part of the manager's saved state
    m = RolloutManager(_args(tiny_model_dir, tmp_path, "--max-staleness", 1))
    m.staleness.counts["regenerated_samples"] = 1
    state = m.state_dict()
    m2 = RolloutManager(_args(tiny_model_dir, tmp_path, "--max-staleness", 1))
    m2.load_state_dict(state)
    assert m2.staleness.counts == {"regenerated_samples": 1, "dropped_groups": 0}


def test_fully_async_generator_bounds_groups_in_flight(tiny_model_dir, tmp_path):
    args = _args(tiny_model_dir, tmp_path)
    engines = FakeEngines({t: 0.01 for t in range(100)})
    made = []

    def next_groups(k):
        (g,) = _groups([len(made) % 100])
        made.append(g)
        return [g]

    async def run():
        gen = FullyAsyncGenerator(GroupRunner(args, engines, RewardFunction(lambda a, s: float(s.tokens[0] % 2))),
                                  next_groups, in_flight=3, keep=lambda g: g[0].tokens[0] % 3 != 0)
        gen.start()
        first = await gen.take(2)
        await asyncio.sleep(0.3)  # the trainer is busy: no more than 3 groups are launched or waiting
        launched_while_idle = len(made) - gen.dropped
        second = await gen.take(2)
        await gen.stop()
        return first, second, launched_while_idle, gen.dropped

    first, second, launched, dropped = asyncio.run(run())
    assert launched <= 2 + 3  # taken + slots
    assert all(g[0].tokens[0] % 3 != 0 for g in first + second)  # the filter dropped multiples of 3
    assert dropped >= 1
    assert len({s.index for g in first + second for s in g}) == 8  # unique indices -> unique seeds
    assert engines.max_in_flight <= 3 * 2


def test_train_async_refuses_colocate(tiny_model_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"input": "x"}\n')
    r = subprocess.run([sys.executable, "train_async.py", "--hf-checkpoint", str(tiny_model_dir), "--prompt-data",
                        str(prompts), "--rollout-batch-size", "1", "--num-rollout", "1", "--colocate"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "slime: error: train_async.py overlaps generation and training, which needs separate devices" in r.stderr


def test_async_flags(tiny_model_dir, tmp_path):
    from slime.utils.errors import SlimeConfigError

    for extra, msg in [
        (["--partial-rollout"], "--partial-rollout needs --over-sampling-batch-size > --rollout-batch-size"),
        (["--mask-offpolicy-in-partial-rollout"], "needs --partial-rollout"),
        (["--update-weights-interval", 0], "--update-weights-interval must be >= 1"),
        (["--max-staleness", -1], "--max-staleness must be >= 0"),
        (["--fully-async", "--partial-rollout", "--over-sampling-batch-size", 4], "--fully-async keeps generating"),
    ]:
        with pytest.raises(SlimeConfigError, match=msg):
            _args(tiny_model_dir, tmp_path, *extra)
    assert _args(tiny_model_dir, tmp_path, "--over-sampling-batch-size", 5).async_groups_in_flight == 5


def test_rollout_max_context_len_cuts_each_requests_budget(tiny_model_dir, tmp_path):
    # --rollout-max-response-len 6, context 5: a 2-token prompt may add 3 tokens; a 5-token one none
    args = _args(tiny_model_dir, tmp_path, "--rollout-max-context-len", 5)
    engines = FakeEngines({10: 0.0, 11: 0.0})
    runner = GroupRunner(args, engines, RewardFunction(lambda a, s: 1.0))
    short = Sample(prompt="p", tokens=[10, 1], index=0)
    full = Sample(prompt="p", tokens=[11, 1, 1, 1, 1], index=1)

    async def run():
        return await runner.sample(short, 0, False), await runner.sample(full, 0, False)

    (a,), (b,) = asyncio.run(run())
    assert [p["sampling_params"]["max_new_tokens"] for p in engines.payloads] == [3]
    assert a.response_length == 3 and len(a.tokens) == 5
    assert b.status == SampleStatus.TRUNCATED and b.response_length == 0 and b.reward == 1.0


def test_fully_async_resume_uses_every_prompt_exactly_once(tiny_model_dir, tmp_path):
    """The state saved after rollout 0 puts the groups still generating (or done but not taken)
    back in front of the data: the killed run's rollouts 0 and 1, and a run resumed after rollout 0,
    together train on a prefix of the prompts, each once (none skipped, none repeated)."""
    import threading
    from collections import Counter

    from slime.data.dataset import Prompt
    from slime.data.source import RolloutDataSource
    from slime.rollout.extensions import Extensions
    from slime.rollout.manager import RolloutManager
    from slime.rollout.sampling import FullyAsync, Staleness

    args = _args(tiny_model_dir, tmp_path, "--fully-async", "--async-groups-in-flight", 4)
    prompts = [Prompt(prompt=f"p{i}", input_ids=[i, 1], label=i) for i in range(40)]
    # prompt token t takes a while when t % 3 == 1: later groups overtake it
    delays = {t: (0.3 if t % 3 == 1 else 0.01) for t in range(40)}

    def start(source):
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, daemon=True).start()
        runner = GroupRunner(args, FakeEngines(delays), RewardFunction(lambda a, s: 1.0), version_now=lambda: 0)
        return FullyAsync(args, source, runner, loop, Extensions(), Staleness(None))

    def labels(rollout):
        return [s.label for s in rollout.samples[:: args.n_samples_per_prompt]]

    killed = start(RolloutDataSource(args, list(prompts)))
    trained = labels(killed.sample(0))
    data, in_flight = killed.saved_data()  # what the checkpoint of rollout 0 holds
    assert in_flight and data["offset"] > len(trained)  # more was drawn than trained: the old loss
    killed.sample(1)  # trained by the killed run, never saved: not part of what the resumed run continues
    killed.stop()

    manager = RolloutManager(args)
    manager.data_source = RolloutDataSource(args, list(prompts))
    manager.load_state_dict({"data_source": data, "groups_in_flight": in_flight, "staleness": {}})
    resumed = start(manager.data_source)
    for rollout_id in (1, 2, 3):
        trained += labels(resumed.sample(rollout_id))
    _, still_out = resumed.saved_data()
    resumed.stop()
    assert max(Counter(trained).values()) == 1  # none twice
    pending = [g[0]["label"] for g in still_out]
    assert not set(pending) & set(trained)
    drawn = sorted(trained + pending)
    assert drawn == list(range(len(drawn)))  # none skipped: trained or still generating, a prefix of the data
