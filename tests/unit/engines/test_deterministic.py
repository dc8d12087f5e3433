"""`--deterministic-mode` on the engine side: the native engine's batch-invariant numerics
(`--enable-deterministic-inference`, slime.engines.native.batch_invariant) and the per-kind
server flags slime passes (slime.engines.kinds).

Every comparison is bitwise (list equality of floats / torch.equal), not closeness."""

from __future__ import annotations

import threading

import pytest
import torch

from slime.engines.kinds import KINDS
from slime.engines.native.cli import build_parser
from slime.engines.native.engine import NativeEngine
from tests.helpers.args import make_args

TARGET = "what is 3 plus 4 ? the answer is"
NEIGHBOURS = ["1", "hello world test hello world test 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5", "copy 7 7 7",
              "yes no yes no parity odd even sum", "say the final result"]
SAMPLED = {"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True}


def _engine(model_dir, deterministic):
    return NativeEngine(model_dir, num_threads=1, random_seed=0, deterministic=deterministic).start()


def _batched(eng, requests):
    """Run `requests` [(input_ids, sampling_params, rid)] as one batch (queued while the engine is
    paused, so they are admitted together); returns their results in order."""
    out = [None] * len(requests)

    def run(i, ids, sp, rid):
        out[i] = eng.generate(ids, sp, rid=rid, timeout=300)

    eng.pause()
    threads = [threading.Thread(target=run, args=(i, *req)) for i, req in enumerate(requests)]
    for t in threads:
        t.start()
    deadline = 200
    while eng.stats()["num_waiting_requests"] < len(requests) and deadline:
        threading.Event().wait(0.05)
        deadline -= 1
    eng.resume()
    for t in threads:
        t.join(300)
    assert all(r is not None for r in out)
    return out


def _neighbours(eng, k):
    ids = [eng.tokenizer.encode(t) for t in NEIGHBOURS]
    return [(ids[i % len(ids)], dict(SAMPLED, seed=100 + i), f"n{i}") for i in range(k)]


@pytest.fixture(scope="module")
def plain(sharp_model_dir):
    eng = _engine(sharp_model_dir, deterministic=False)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def det(sharp_model_dir):
    eng = _engine(sharp_model_dir, deterministic=True)
    yield eng
    eng.shutdown()


def test_without_deterministic_mode_logprobs_depend_on_batch_neighbours(plain):
    """The bug: today's batched forward gives a sequence other log-probs (by ~1e-7, not bit for
    bit) when other requests share its prefill and decode steps (on this CPU: MKL's 1-row and
    n-row matrix products round differently; padded attention spans more columns)."""
    target = plain.tokenizer.encode(TARGET)
    sp = dict(SAMPLED, seed=7)
    alone = plain.generate(target, sp, rid="t")
    batched = _batched(plain, [(target, sp, "t"), *_neighbours(plain, 12)])[0]
    assert batched.output_token_logprobs != alone.output_token_logprobs


def test_deterministic_mode_same_prompt_alone_or_batched_is_bitwise_equal(det):
    target = det.tokenizer.encode(TARGET)
    sp = dict(SAMPLED, seed=7)
    alone = det.generate(target, sp, rid="t")
    first = _batched(det, [(target, sp, "t"), *_neighbours(det, 12)])[0]
    last = _batched(det, [*_neighbours(det, 7), (target, sp, "t")])[-1]
    # admitted into a running batch mid-way: its neighbours are already decoding
    eng_threads = [threading.Thread(target=det.generate, args=(ids, p), kwargs={"rid": rid, "timeout": 300})
                   for ids, p, rid in _neighbours(det, 6)]
    for t in eng_threads:
        t.start()
    threading.Event().wait(0.3)
    mid = det.generate(target, sp, rid="t", timeout=300)
    for t in eng_threads:
        t.join(300)
    for res in (first, last, mid):
        assert res.output_ids == alone.output_ids
        assert torch.equal(torch.tensor(res.output_token_logprobs), torch.tensor(alone.output_token_logprobs))
    assert det.stats()["max_running_batch_size"] > 1 and det.stats()["deterministic"]


def test_deterministic_mode_n_samples_of_one_prompt_and_greedy(det):
    """The n samples of one prompt share one prefill (its cache copied per row); each sample
    equals the same request run alone, and so does a greedy one."""
    target = det.tokenizer.encode(TARGET)
    reqs = [(target, dict(SAMPLED, seed=20 + j), f"s{j}") for j in range(4)]
    reqs.append((target, {"max_new_tokens": 12, "temperature": 0.0}, "g"))
    batched = _batched(det, reqs + _neighbours(det, 3))
    assert det.stats()["shared_prefix_rows"] > 0
    for (ids, sp, rid), res in zip(reqs, batched):
        alone = det.generate(ids, sp, rid=rid)
        assert res.output_ids == alone.output_ids
        assert res.output_token_logprobs == alone.output_token_logprobs


def test_deterministic_mode_unseeded_requests_sample_from_their_rid(det):
    """A sampled request without a seed draws from a generator seeded by (engine seed, rid), never
    the engine's shared one: its tokens do not depend on the requests admitted before it."""
    target = det.tokenizer.encode(TARGET)
    sp = dict(SAMPLED)
    alone = det.generate(target, sp, rid="unseeded")
    after_others = _batched(det, [*_neighbours(det, 5), (target, sp, "unseeded")])[-1]
    assert after_others.output_ids == alone.output_ids
    assert after_others.output_token_logprobs == alone.output_token_logprobs
    other = det.generate(target, sp, rid="another-rid")
    assert other.output_ids != alone.output_ids  # the rid seeds it: another rid, other samples


def test_deterministic_engines_agree_across_restarts(sharp_model_dir, det):
    """A fresh engine (a new run, or one restarted on resume) gives the same bits."""
    target = det.tokenizer.encode(TARGET)
    reqs = [(target, dict(SAMPLED, seed=3), "r"), *_neighbours(det, 4)]
    a = _batched(det, reqs)
    fresh = _engine(sharp_model_dir, deterministic=True)
    try:
        b = _batched(fresh, list(reversed(reqs)))[::-1]
    finally:
        fresh.shutdown()
    assert [r.output_ids for r in a] == [r.output_ids for r in b]
    assert [r.output_token_logprobs for r in a] == [r.output_token_logprobs for r in b]


# ---------------------------------------------------------------- the flag, per engine kind


def test_deterministic_mode_flag_per_engine_kind(tiny_model_dir, tmp_path):
    on = make_args(tiny_model_dir, tmp_path, "--deterministic-mode")
    off = make_args(tiny_model_dir, tmp_path)
    assert on.deterministic_mode and not off.deterministic_mode
    native = KINDS["native"]
    cmd = native.launch_command(on, 0, "127.0.0.1", 4321, ["127.0.0.1"])
    assert "--enable-deterministic-inference" in cmd
    assert "--enable-deterministic-inference" not in native.launch_command(off, 0, "127.0.0.1", 4321, ["127.0.0.1"])
    assert build_parser().parse_args(cmd[3:]).enable_deterministic_inference  # the engine's own parser
    assert native.launch_env(on) == {}
    # SGLang: its own flag; vLLM: its environment variable
    assert KINDS["sglang"].deterministic_flags(on) == ["--enable-deterministic-inference"]
    assert KINDS["sglang"].deterministic_flags(off) == []
    assert KINDS["vllm"].deterministic_flags(on) == []
    assert KINDS["vllm"].launch_env(on) == {"VLLM_BATCH_INVARIANT": "1"}
    assert KINDS["vllm"].launch_env(off) == {}
