"""An agent episode written against the `openai` client becomes Samples whose loss mask covers exactly the
model's tokens (slime.rollout.openai_agent), against a real native engine server on the tiny model."""

from __future__ import annotations

import asyncio

import pytest

from slime.rollout.openai_agent import RecordedCall, RecorderError, TrajectoryRecorder, run_agent
from slime.types import Sample, SampleStatus
from tests.helpers.args import make_args
from tests.helpers.native_server import native_server

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with native_server(tiny_model_dir, tmp_path_factory.mktemp("agent") / "log.txt", "--max-total-tokens", "512") as s:
        yield s


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


# With this seed the tiny model's 3 answers hold no special token, and its second answer ends on EOS (the
# other two on max_tokens). Other seeds may sample `<unk>` or `<|endoftext|>`, which the server leaves out
# of the message text, so the next chat rendering differs from what the model saw: a new Sample
# (test_dropped_special_token_splits_the_episode).
PARAMS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 6, "sampling_seed": 0}


async def three_turn_agent(client, model, sample):
    """Ask, get an answer, feed back a tool result and a user turn, ask again (3 model calls)."""
    messages = list(sample.prompt)
    outs = []
    for turn in range(3):
        r = await client.chat.completions.create(model=model, messages=messages)
        text = r.choices[0].message.content
        outs.append(r)
        messages.append({"role": "assistant", "content": text})
        messages.append({"role": "user", "content": f"result {turn} equals {turn + 1} . what is the answer ?"})
    return [o.choices[0].message.content for o in outs]


def _recorded_outputs(recorder):
    return [(c.output_ids, c.log_probs) for c in recorder.calls]


def test_episode_becomes_one_sample_masking_exactly_the_model_tokens(server, tokenizer):
    url, _ = server
    sample = Sample(prompt=[{"role": "user", "content": "what is 3 plus 4 ?"}], label="7", index=5, group_index=2,
                    metadata={"k": 1})

    async def main():
        async with TrajectoryRecorder(url + "/v1", PARAMS, model="m", max_response_len=200) as rec:
            texts = await three_turn_agent(rec.client, rec.model, sample)
        return rec, texts

    rec, texts = asyncio.run(main())
    assert len(rec.calls) == 3
    # the client saw the same text the recorder recorded; every call was sampled with our parameters
    assert [c.text for c in rec.calls] == texts
    first_prompt = tokenizer.apply_chat_template(sample.prompt, tokenize=True, add_generation_prompt=True,
                                                 return_dict=False)
    assert rec.calls[0].prompt_ids == list(first_prompt)
    samples = rec.to_samples(sample, tokenizer)
    assert len(samples) == 1
    s = samples[0]
    assert (s.index, s.group_index, s.label, s.metadata["k"], s.metadata["calls"]) == (5, 2, "7", 1, 3)
    assert s.tokens[: s.prompt_length] == list(first_prompt)
    assert len(s.loss_mask) == len(s.rollout_log_probs) == s.response_length == len(s.tokens) - len(first_prompt)
    # walk the response token by token: each call's prompt extension is mask 0 (log-prob 0.0), each call's
    # output is mask 1 with its recorded log-probs, in order, and nothing else is in the sample
    pos = s.prompt_length
    resp = s.response_length
    for i, call in enumerate(rec.calls):
        env = call.prompt_ids[pos:]
        assert call.prompt_ids[:pos] == s.tokens[:pos]  # the prompt extends everything before it
        if i > 0:
            assert env, "the tool/user turn must add environment tokens"
        for t in env:
            j = pos - s.prompt_length
            assert (s.tokens[pos], s.loss_mask[j], s.rollout_log_probs[j]) == (t, 0, 0.0)
            pos += 1
        assert 1 <= len(call.output_ids) <= PARAMS["max_new_tokens"]
        for t, lp in zip(call.output_ids, call.log_probs):
            j = pos - s.prompt_length
            assert (s.tokens[pos], s.loss_mask[j], s.rollout_log_probs[j]) == (t, 1, lp)
            assert lp <= 0.0
            pos += 1
    assert pos == len(s.tokens) and resp == pos - s.prompt_length
    assert sum(s.loss_mask) == sum(len(c.output_ids) for c in rec.calls)
    # the environment tokens are exactly the chat template's rendering of the added turns, after the
    # end-of-turn token when the model's turn stopped on max_tokens instead of EOS
    eos = tokenizer.eos_token_id
    assert [c.finish_reason for c in rec.calls] == ["length", "stop", "length"]
    for i, (prev, call) in enumerate(zip(rec.calls, rec.calls[1:])):
        turn = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"result {i} equals {i + 1} . what is the answer ?"}], tokenize=True,
            add_generation_prompt=True, return_dict=False)
        env = call.prompt_ids[len(prev.prompt_ids) + len(prev.output_ids):]
        assert env == ([] if prev.finish_reason == "stop" else [eos]) + list(turn)
    assert rec.calls[1].output_ids[-1] == eos
    last = rec.calls[-1]
    assert s.status == (SampleStatus.TRUNCATED if last.finish_reason == "length" else SampleStatus.COMPLETED)
    assert s.weight_version == 0 and s.weight_versions == [0]

    # the same seeds give the same episode: the recorder passes sampling_seed + call number as the seed
    rec2, _ = asyncio.run(main())
    assert _recorded_outputs(rec2) == _recorded_outputs(rec)


def test_dropped_special_token_splits_the_episode(server, tokenizer):
    """Seed 28: the tiny model samples special tokens the server drops from the answer text; the agent's
    next prompt then does not extend what the model saw, and the recorder starts a new Sample there."""
    url, _ = server
    sample = Sample(prompt=[{"role": "user", "content": "what is 3 plus 4 ?"}])

    async def main():
        async with TrajectoryRecorder(url + "/v1", dict(PARAMS, sampling_seed=28), max_response_len=200) as rec:
            await three_turn_agent(rec.client, rec.model, sample)
        return rec

    rec = asyncio.run(main())
    samples = rec.to_samples(sample, tokenizer)
    assert [s.metadata["calls"] for s in samples] == [1, 1, 1]
    from slime.utils.tiny_model import SPECIAL_TOKENS

    special = set(tokenizer.convert_tokens_to_ids(["<unk>", *SPECIAL_TOKENS]))
    for prev, s in zip(rec.calls, rec.calls[1:]):
        assert special & set(prev.output_ids[:-1] if prev.finish_reason == "stop" else prev.output_ids)
    for s, call in zip(samples, rec.calls):
        assert s.tokens == call.prompt_ids + call.output_ids and s.loss_mask == [1] * len(call.output_ids)
        assert s.rollout_log_probs == call.log_probs


def test_rewritten_history_starts_a_new_sample(server, tokenizer, tiny_model_dir, tmp_path):
    url, _ = server
    sample = Sample(prompt=[{"role": "user", "content": "what is 2 plus 2 ?"}], index=0, group_index=0)

    async def agent(client, model, sample):
        msgs = list(sample.prompt)
        a = await client.chat.completions.create(model=model, messages=msgs, max_tokens=3)
        msgs += [{"role": "assistant", "content": a.choices[0].message.content},
                 {"role": "user", "content": "say the answer"}]
        b = await client.chat.completions.create(model=model, messages=msgs, max_tokens=3)
        # a summarizing agent: drop the history and start over from a new prompt
        msgs = [{"role": "system", "content": "reply with only the final result"},
                {"role": "user", "content": "what is 2 plus 2 ?"}]
        c = await client.chat.completions.create(model=model, messages=msgs, max_tokens=3)
        return [x.choices[0].message.content for x in (a, b, c)]

    async def main():
        args = make_args(tiny_model_dir, tmp_path, "--rollout-request-timeout", 60)
        return await run_agent(agent, args, sample, dict(PARAMS, max_new_tokens=50), base_url=url + "/v1",
                               tokenizer=tokenizer)

    samples = asyncio.run(main())
    assert len(samples) == 2
    a, b = samples
    assert (a.metadata["calls"], b.metadata["calls"]) == (2, 1)
    assert (a.metadata["segment"], b.metadata["segment"], a.metadata["segments"]) == (0, 1, 2)
    texts = a.metadata["agent_result"]
    assert b.metadata["last_turn"] == texts[2]
    assert b.tokens[: b.prompt_length] == list(tokenizer.apply_chat_template(
        [{"role": "system", "content": "reply with only the final result"},
         {"role": "user", "content": "what is 2 plus 2 ?"}], tokenize=True, add_generation_prompt=True,
        return_dict=False))
    assert b.loss_mask == [1] * b.response_length and 1 <= b.response_length <= 3
    assert a.loss_mask[0] == 1 and a.loss_mask[-1] == 1 and 0 in a.loss_mask
    assert a.response == tokenizer.decode(a.response_tokens, skip_special_tokens=False)


def test_agent_error_after_a_call_keeps_the_episode(server, tokenizer, tiny_model_dir, tmp_path):
    url, _ = server
    sample = Sample(prompt=[{"role": "user", "content": "what is 2 plus 2 ?"}])

    async def agent(client, model, sample):
        await client.chat.completions.create(model=model, messages=sample.prompt, max_tokens=2)
        raise RuntimeError("tool crashed")

    async def failing_first(client, model, sample):
        raise RuntimeError("no call")

    args = make_args(tiny_model_dir, tmp_path, "--rollout-request-timeout", 60)
    [s] = asyncio.run(run_agent(agent, args, sample, PARAMS, base_url=url + "/v1", tokenizer=tokenizer))
    assert s.metadata["agent_error"] == "RuntimeError: tool crashed" and s.metadata["agent_result"] is None
    assert s.loss_mask == [1] * s.response_length and 1 <= s.response_length <= 2
    with pytest.raises(RuntimeError, match="no call"):
        asyncio.run(run_agent(failing_first, args, sample, PARAMS, base_url=url + "/v1", tokenizer=tokenizer))


def test_budget_caps_max_tokens_and_truncates():
    rec = TrajectoryRecorder("http://127.0.0.1:9/v1", {"max_new_tokens": 8, "sampling_seed": 3}, max_response_len=10)
    body = rec._prepare("chat", {"messages": [], "model": "m", "top_logprobs": 2})
    assert body == {"messages": [], "model": "m", "max_tokens": 8, "logprobs": True, "return_token_ids": True,
                    "seed": 3}
    rec.calls.append(RecordedCall([1, 2], [3, 4, 5, 6], [-0.1] * 4, "stop", "x"))
    # 4 response tokens used: 6 left; the agent's own max_tokens is kept when smaller
    assert rec._prepare("chat", {"max_tokens": 20})["max_tokens"] == 6
    assert rec._prepare("chat", {"max_tokens": 2})["max_tokens"] == 2
    assert rec._prepare("completions", {"prompt": "x"})["logprobs"] == 1
    assert rec._prepare("chat", {"temperature": 0.0})["seed"] == 4  # the call's number is added
    with pytest.raises(RecorderError, match="one choice per call"):
        rec._prepare("chat", {"n": 2})
    rec.calls.append(RecordedCall([1, 2, 3, 4, 5, 6, 7, 8], [9] * 5, [-0.2] * 5, "stop", "y"))
    [s] = rec.to_samples(Sample(prompt="p"))
    assert s.response_length == 10 and s.status == SampleStatus.TRUNCATED
    assert s.loss_mask == [1, 1, 1, 1, 0, 0, 1, 1, 1, 1]
    assert s.rollout_log_probs == [-0.1] * 4 + [0.0, 0.0] + [-0.2] * 4
    assert s.tokens == [1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9]
    with pytest.raises(RecorderError, match="no chat completion calls"):
        TrajectoryRecorder("http://127.0.0.1:9/v1").to_samples(Sample())
