"""On-policy distillation with a served teacher, rollout side (`--use-opd --opd-type sglang`,
slime/rollout/teacher.py): a real native engine's teacher log-probs of every response token equal
a plain Hugging Face fp32 forward at temperature 1, through the rollout pipeline too (concurrently,
after the reward, not for evaluation); a failing teacher fails the sample, logged once; the
log-probs survive to_dict/from_dict, debug dumps and the train batch's rank splits."""

from __future__ import annotations

import asyncio
import logging
import shutil
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM

from slime.engines.control import AsyncEngineControl
from slime.rollout import api
from slime.rollout.api import RolloutContext
from slime.rollout.debug_data import load_samples, save_samples
from slime.rollout.group_generation import GroupRunner, generate_groups
from slime.rollout.rewards import RewardFunction
from slime.rollout.teacher import score_teacher
from slime.rollout.train_data import to_train_batch
from slime.types import RolloutBatch, Sample, SampleStatus
from tests.helpers.args import make_args
from tests.helpers.native_server import native_server


@pytest.fixture(scope="module")
def teacher_dir(tiny_model_dir, tmp_path_factory):
    """The served teacher's directory: the tiny model under another path (the engine serves this one)."""
    d = tmp_path_factory.mktemp("opd_teacher") / "model"
    shutil.copytree(tiny_model_dir, d)
    return str(d)


@pytest.fixture(scope="module")
def engine_url(teacher_dir, tmp_path_factory):
    with native_server(teacher_dir, tmp_path_factory.mktemp("opd_engine") / "log.txt") as (url, _):
        yield url


@pytest.fixture(scope="module")
def hf_model(teacher_dir):
    return AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()


def hf_log_probs(model, tokens: list[int], r: int) -> list[float]:
    """The response tokens' log-probs under a plain Hugging Face forward at temperature 1."""
    ids = torch.tensor(tokens)
    with torch.no_grad():
        logits = model(ids[None]).logits[0].float()
    p = len(tokens) - r
    return torch.log_softmax(logits, -1)[p - 1: p - 1 + r].gather(-1, ids[p:, None]).squeeze(-1).tolist()


def served_args(model_dir, teacher_dir, tmp_path, *extra):
    cfg = tmp_path / "served.yaml"
    cfg.write_text(textwrap.dedent(f"""
        sglang:
          - name: actor
            server_groups: [{{worker_type: regular, num_gpus: 1}}]
          - name: teacher
            model_path: {teacher_dir}
            update_weights: false
            server_groups: [{{worker_type: regular, num_gpus: 1}}]
        """))
    return make_args(model_dir, tmp_path, "--sglang-config", cfg, "--use-opd", "--opd-type", "sglang",
                     "--rollout-batch-size", 2, "--n-samples-per-prompt", 2, "--rollout-max-response-len", 5,
                     "--rollout-temperature", 1, *extra, data='{"input": "x"}\n')


class RecordingPool:
    """A pool around a real engine client (or a scripted answer), recording payloads and the most
    calls in flight at once."""

    def __init__(self, client=None, answer=None, delay: float = 0.0):
        self.client, self.answer, self.delay = client, answer, delay
        self.payloads: list[dict] = []
        self.in_flight = self.max_in_flight = 0

    async def generate(self, payload: dict) -> dict:
        self.payloads.append(payload)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay)
            if self.client is not None:
                return await self.client.generate(payload)
            return self.answer(payload) if callable(self.answer) else self.answer
        finally:
            self.in_flight -= 1


def finished(tokens, r, index=0, status=SampleStatus.COMPLETED) -> Sample:
    return Sample(prompt="p", index=index, group_index=0, tokens=list(tokens), response_length=r,
                  loss_mask=[1] * r, rollout_log_probs=[-1.0] * r, reward=1.0, status=status)


def random_samples(vocab: int, shapes, seed=0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    return [finished(torch.randint(4, vocab, (p + r,), generator=g).tolist(), r, index=i)
            for i, (p, r) in enumerate(shapes)]


def with_client(url, fn):
    async def main():
        client = AsyncEngineControl(url, timeout=60)
        try:
            return await fn(client)
        finally:
            await client.close()

    return asyncio.run(main())


# ---- against a real engine ---------------------------------------------------------------------


def test_teacher_log_probs_of_a_real_engine_equal_hugging_face(tiny_model_dir, teacher_dir, tmp_path, engine_url,
                                                               hf_model):
    args = served_args(tiny_model_dir, teacher_dir, tmp_path)
    samples = random_samples(hf_model.config.vocab_size, [(1, 1), (3, 5), (6, 2), (2, 7), (4, 0)])
    samples[1].loss_mask[2] = 0  # a tool token: scored as well (its loss mask keeps it out of the loss)

    async def run(client):
        pool = RecordingPool(client)
        out = await asyncio.gather(*(score_teacher(args, s, pool) for s in samples))
        return pool, out

    pool, scored = with_client(engine_url, run)
    assert len(pool.payloads) == 4  # nothing to score in an empty response
    for s in scored:
        assert s.status == SampleStatus.COMPLETED and s.reward == 1.0
        assert len(s.teacher_log_probs) == s.response_length
        expected = hf_log_probs(hf_model, s.tokens, s.response_length) if s.response_length else []
        assert torch.allclose(torch.tensor(s.teacher_log_probs), torch.tensor(expected), atol=1e-5, rtol=0), s.index
    payload = next(p for p in pool.payloads if len(p["input_ids"]) == 8)
    assert payload["logprob_start_len"] == 2 and payload["return_logprob"] is True
    assert payload["sampling_params"] == {"max_new_tokens": 0, "temperature": 1.0}


@pytest.mark.parametrize("group_rm", [False, True])
def test_the_rollout_sends_every_finished_sample_to_the_teacher(tiny_model_dir, teacher_dir, tmp_path, engine_url,
                                                               hf_model, group_rm):
    """The policy and the teacher are both the real engine: generated samples carry the teacher's
    log-probs (= Hugging Face at T=1), after their reward; evaluation samples are not sent."""
    args = served_args(tiny_model_dir, teacher_dir, tmp_path)
    order = []

    def reward(a, x):
        order.append("reward")
        return [1.0] * len(x) if group_rm else 1.0

    async def run(client):
        teacher = RecordingPool(client)
        orig = teacher.generate

        async def generate(payload):
            order.append("teacher")
            return await orig(payload)

        teacher.generate = generate
        api.set_context(RolloutContext(args=args, tokenizer=None, engines=client, base_url=engine_url,
                                       models={"teacher": teacher}))
        try:
            runner = GroupRunner(args, client, RewardFunction(reward, group=group_rm))
            groups = [[Sample(prompt="p", tokens=[5, 9, 17], index=j, group_index=0) for j in range(3)]]
            (train,) = await generate_groups(runner, groups, 0, evaluation=False)
            n_train = len(teacher.payloads)
            evals = [[Sample(prompt="p", tokens=[5, 9, 17], index=j, group_index=0) for j in range(2)]]
            (ev,) = await generate_groups(runner, evals, 0, evaluation=True)
            return train, ev, n_train, len(teacher.payloads)
        finally:
            api.set_context(None)

    train, ev, n_train, n_total = with_client(engine_url, run)
    assert n_train == n_total == 3 and all(s.teacher_log_probs is None for s in ev)
    assert order.index("teacher") > order.index("reward")
    for s in train:
        assert s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED) and s.response_length > 0
        expected = hf_log_probs(hf_model, s.tokens, s.response_length)
        assert torch.allclose(torch.tensor(s.teacher_log_probs), torch.tensor(expected), atol=1e-5, rtol=0)
        # the teacher is the policy at T=1: its log-probs are the engine's own sampling log-probs
        assert torch.allclose(torch.tensor(s.teacher_log_probs), torch.tensor(s.rollout_log_probs), atol=1e-4)


class InstantPolicy:
    """A policy engine that answers at once with two tokens."""

    async def generate(self, payload):
        return {"text": " a b", "output_ids": [7, 8],
                "meta_info": {"finish_reason": {"type": "stop"}, "output_token_logprobs": [[-0.5, 7, None],
                                                                                          [-0.5, 8, None]]}}


def _scripted_answer(payload):
    ids = payload["input_ids"][payload["logprob_start_len"]:]
    return {"meta_info": {"finish_reason": {"type": "length", "length": 0},
                          "input_token_logprobs": [[None, ids[0], None]] + [[-0.25, t, None] for t in ids[1:]]}}


@pytest.mark.parametrize("group_rm", [False, True])
def test_the_samples_of_a_group_are_sent_concurrently(tiny_model_dir, teacher_dir, tmp_path, group_rm):
    args = served_args(tiny_model_dir, teacher_dir, tmp_path)
    teacher = RecordingPool(answer=_scripted_answer, delay=0.1)
    reward = RewardFunction((lambda a, x: [0.0] * len(x)) if group_rm else (lambda a, x: 0.0), group=group_rm)

    async def run():
        api.set_context(RolloutContext(args=args, tokenizer=None, engines=None, base_url="",
                                       models={"teacher": teacher}))
        try:
            groups = [[Sample(prompt="p", tokens=[5, 9], index=j, group_index=0) for j in range(4)]]
            return await generate_groups(GroupRunner(args, InstantPolicy(), reward), groups, 0, evaluation=False)
        finally:
            api.set_context(None)

    (group,) = asyncio.run(run())
    assert teacher.max_in_flight == 4
    assert all(s.teacher_log_probs == [-0.25, -0.25] for s in group)


# ---- failures ------------------------------------------------------------------------------------


def _answer(entries, finish="length"):
    return {"meta_info": {"finish_reason": {"type": finish}, "input_token_logprobs": entries}}


def _raise(payload):
    raise ConnectionError("engine down")


FAILING = {
    "raises": dict(answer=_raise),
    "times out": dict(answer=_scripted_answer, delay=5.0),
    "too few entries": dict(answer=_answer([[None, 9, None], [-0.1, 21, None]])),
    "other tokens": dict(answer=_answer([[None, 9, None], [-0.1, 21, None], [-0.2, 99, None]])),
    "null log-prob": dict(answer=_answer([[None, 9, None], [-0.1, 21, None], [None, 22, None]])),
    "aborted": dict(answer=_answer([], finish="abort")),
}


@pytest.mark.parametrize("case", sorted(FAILING))
def test_a_failing_teacher_fails_the_sample_and_logs_it_once(tiny_model_dir, teacher_dir, tmp_path, caplog, case):
    args = served_args(tiny_model_dir, teacher_dir, tmp_path, "--rm-timeout", 0.2)
    s = finished([5, 9, 21, 22], 2, index=7)
    with caplog.at_level(logging.WARNING, logger="slime.rollout.teacher"):
        out = asyncio.run(score_teacher(args, s, RecordingPool(**FAILING[case])))
    assert out.status == SampleStatus.FAILED and out.reward is None and out.teacher_log_probs is None
    records = [r for r in caplog.records if r.name == "slime.rollout.teacher"]
    assert len(records) == 1 and "sample 7" in records[0].getMessage()
    assert "--opd-teacher-model teacher" in records[0].getMessage()


def test_no_served_teacher_in_the_context_fails_the_sample(tiny_model_dir, teacher_dir, tmp_path):
    args = served_args(tiny_model_dir, teacher_dir, tmp_path)
    api.set_context(RolloutContext(args=args, tokenizer=None, engines=None, base_url="", models={}))
    try:
        out = asyncio.run(score_teacher(args, finished([5, 9, 21], 1)))
    finally:
        api.set_context(None)
    assert out.status == SampleStatus.FAILED


@pytest.mark.parametrize("status", [SampleStatus.FAILED, SampleStatus.ABORTED])
def test_failed_and_aborted_samples_are_not_sent(tiny_model_dir, teacher_dir, tmp_path, status):
    args = served_args(tiny_model_dir, teacher_dir, tmp_path)
    pool = RecordingPool(answer=_scripted_answer)
    out = asyncio.run(score_teacher(args, finished([5, 9, 21], 1, status=status), pool))
    assert pool.payloads == [] and out.status == status and out.teacher_log_probs is None


def test_a_failing_teacher_in_the_rollout_fails_only_its_sample(tiny_model_dir, teacher_dir, tmp_path):
    args = served_args(tiny_model_dir, teacher_dir, tmp_path)
    calls = []

    def answer(payload):
        calls.append(payload)
        if len(calls) == 2:
            raise TimeoutError("teacher overloaded")
        return _scripted_answer(payload)

    async def run():
        api.set_context(RolloutContext(args=args, tokenizer=None, engines=None, base_url="",
                                       models={"teacher": RecordingPool(answer=answer)}))
        try:
            groups = [[Sample(prompt="p", tokens=[5, 9], index=j, group_index=0) for j in range(3)]]
            runner = GroupRunner(args, InstantPolicy(), RewardFunction(lambda a, x: 1.0))
            return await generate_groups(runner, groups, 0, evaluation=False)
        finally:
            api.set_context(None)

    (group,) = asyncio.run(run())
    assert sorted(s.status.value for s in group) == ["completed", "completed", "failed"]
    batch = to_train_batch(args, group, None)
    failed = next(i for i, s in enumerate(group) if s.status == SampleStatus.FAILED)
    assert batch.loss_masks[failed] == [0, 0] and batch.teacher_log_probs[failed] is None


# ---- the data path -------------------------------------------------------------------------------


def test_teacher_log_probs_round_trip_through_dicts_and_debug_dumps(tmp_path):
    s = finished([5, 9, 21, 22], 2, index=3)
    s.teacher_log_probs = [-0.123456789012345, -2.5]
    assert Sample.from_dict(s.to_dict()) == s and s.to_dict()["teacher_log_probs"] == s.teacher_log_probs
    old = s.to_dict()
    del old["teacher_log_probs"]  # written before the field existed
    assert Sample.from_dict(old).teacher_log_probs is None
    path = str(tmp_path / "rollout_{rollout_id}.json")
    save_samples(path, 0, [s])
    assert load_samples(path, 0) == [s]


def test_a_changed_response_drops_the_teacher_log_probs():
    s = finished([5, 9, 21], 1)
    s.teacher_log_probs = [-0.5]
    s.append_model_tokens([30], [-0.1])
    assert s.teacher_log_probs is None
    s.teacher_log_probs = [-0.5, -0.5]
    s.reset_response()
    assert s.teacher_log_probs is None and s.tokens == [5, 9]


@pytest.mark.parametrize("balance", [False, True])
def test_the_train_batch_carries_them_through_rank_splits(tiny_model_dir, teacher_dir, tmp_path, balance):
    args = served_args(tiny_model_dir, teacher_dir, tmp_path, "--rollout-batch-size", 4)
    samples = []
    for i in range(8):
        r = 1 + (i * 3) % 5
        s = finished([4 + i] * (2 + i % 3) + [50 + i] * r, r, index=i)
        s.group_index = i // 2
        s.teacher_log_probs = [-float(i) - k / 10 for k in range(r)]
        samples.append(s)
    samples[5].status, samples[5].reward, samples[5].teacher_log_probs = SampleStatus.FAILED, None, None
    batch = to_train_batch(args, samples, None)
    assert batch.teacher_log_probs == [s.teacher_log_probs for s in samples]
    parts = batch.split_for_ranks(2, 4, balance=balance)
    for part, idx in zip(parts, batch.rank_indices(2, 4, balance=balance)):
        assert part.tokens == [batch.tokens[i] for i in idx]
        assert part.teacher_log_probs == [batch.teacher_log_probs[i] for i in idx]
        for toks, r, t in zip(part.tokens, part.response_lengths, part.teacher_log_probs):
            assert t is None or (len(t) == r and t[0] == -float(toks[-1] - 50))


def test_a_batch_without_the_column_keeps_it_none():
    b = RolloutBatch(tokens=[[1, 2], [3, 4]], response_lengths=[1, 1], loss_masks=[[1], [1]], rewards=[0.0, 1.0],
                     raw_rewards=[0.0, 1.0], rollout_log_probs=[[-1.0], [-2.0]], group_indices=[0, 0])
    assert b.teacher_log_probs is None
    (part,) = b.split_for_ranks(1, 2)
    assert part.teacher_log_probs is None and part.tokens == b.tokens


def test_a_trained_sample_without_teacher_log_probs_is_an_error(tiny_model_dir, teacher_dir, tmp_path):
    args = served_args(tiny_model_dir, teacher_dir, tmp_path, "--rollout-batch-size", 1)
    samples = [finished([5, 9, 21], 1, index=0), finished([5, 9, 22], 1, index=1)]
    samples[0].teacher_log_probs = [-0.5]
    with pytest.raises(ValueError, match="--opd-type sglang: sample 1 trains on its response but has no teacher "
                                         "log-probs for 1 tokens; a --rollout-function-path rollout scores them"):
        to_train_batch(args, samples, None)
