"""The three data-generation examples: tool use (calculator, sandboxed Python), a Search-R1 style search
agent over a local BM25 corpus, and an agent written against the OpenAI client.

The fast tests check the examples' parts (tools, retriever, parsers, rewards). The e2e tests run each
example's train.py on the tiny model, check its metrics and the saved Samples' loss masks token by
token, and show the tool-use example's reward rising."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))

from slime.types import Sample  # noqa: E402
from tests.helpers.args import make_args  # noqa: E402
from tests.helpers.e2e import records, run  # noqa: E402
from tests.helpers.rollout import ScriptedFleet  # noqa: E402


def example_args(tiny, tmp_path, **config):
    """Real args whose --custom-config-path YAML holds `config` (the examples read their settings there);
    `max_turns` and `rollout_max_response_len` are slime flags and go on the command line."""
    import yaml

    flags = []
    for key in ("max_turns", "rollout_max_response_len"):
        if key in config:
            flags += ["--" + key.replace("_", "-"), config.pop(key)]
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "example.yaml").write_text(yaml.safe_dump(config))
    return make_args(tiny["model"], tmp_path, "--custom-config-path", tmp_path / "example.yaml", *flags)


def load(example: str, name: str):
    """An example's module by file (the examples share module names such as make_data)."""
    path = EXAMPLES / example / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"example_{example}_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------- the examples' parts (fast)


def test_calculator_and_plain_calls():
    tools = load("tool_use", "tools")
    assert [tools.calculate(e) for e in ("3 plus 4", "(2 + 3) * 4 =", "7 divided by 2", "2 ** 10", "-3 times 3")] == [
        "7", "20", "3.5", "1024", "-9"]
    for bad, msg in [("1/0", "division by zero"), ("2 ** 99", "cannot evaluate"), ("__import__('os')", "cannot"),
                     ("", "empty expression"), ("x + 1", "cannot evaluate")]:
        assert msg in tools.calculate(bad)
    assert tools.last_expression("user what is 3 plus 4 ? assistant") == "3 plus 4"
    assert tools.last_expression("12 * ( 3 + 4 ) and then 5 - 2 =") == "5 - 2"
    assert tools.last_expression("no math here") == ""
    gen = load("tool_use", "generate")
    assert [(c.name, c.arguments) for c in gen.parse_plain("the compute 2 plus 2")] == [
        ("calculator", {"expression": "2 plus 2"})]
    assert gen.parse_plain("the answer is 4") == []


def _python_tool_runs(tools, monkeypatch):
    """The Python tool runs sandboxed where bwrap works (scripts/test.sh installs it), else with the unsafe
    switch (tests/unit/examples/test_tool_sandbox.py tests the sandbox and the refusal). True: sandboxed."""
    if tools._sandbox.unavailable() is None:
        return True
    monkeypatch.setenv(tools.SANDBOX_ENV, "unsafe")
    return False


def test_python_tool_limits(monkeypatch):
    tools = load("tool_use", "tools")
    sandboxed = _python_tool_runs(tools, monkeypatch)
    assert asyncio.run(tools.run_python("print(sum(range(10)))")) == "45"
    cwd = asyncio.run(tools.run_python("import os; print(os.getcwd())"))  # a fresh, private working directory
    assert (cwd == "/work") if sandboxed else ("slime_py_" in cwd)
    assert asyncio.run(tools.run_python("x = bytearray(1 << 30)", memory_mb=128)) == "error: exit status 1: MemoryError"
    cpu = asyncio.run(tools.run_python("while True: pass", timeout=20, cpu_seconds=1))
    assert cpu.startswith("error: killed by signal")  # RLIMIT_CPU, long before the wall timeout
    assert asyncio.run(tools.run_python("import time; time.sleep(10)", timeout=0.5)) == "error: timed out after 0.5 s"
    assert asyncio.run(tools.run_python("raise ValueError('no')")) == "error: exit status 1: ValueError: no"
    assert asyncio.run(tools.run_python("print('x' * 5000)", max_output=10)) == "x" * 10


def test_tool_reward(tiny, tmp_path):
    reward = load("tool_use", "reward").reward
    args = example_args(tiny, tmp_path, tool_bonus=0.5)

    def sample(last, label="7", tool_ok=1, answered=True):
        return Sample(label=label, metadata={"last_turn": last, "tool_ok": tool_ok, "answered": answered, "turns": 2})

    assert reward(args, sample("7 and 8")) == {"score": 1.5, "correct": 1.0, "tool_calls": 1.0, "turns": 2.0}
    assert reward(args, sample("8 7"))["score"] == 0.5
    assert reward(args, sample("7", tool_ok=0))["score"] == 1.0
    assert reward(args, sample("7 compute", answered=False))["correct"] == 0.0  # a call is no answer
    assert reward(args, sample("7 compute", answered=False))["score"] == 0.5
    assert reward(example_args(tiny, tmp_path / "plain"), sample("7"))["score"] == 1.0  # no bonus by default


def test_bm25_finds_the_supporting_passage():
    retriever = load("search_r1", "retriever")
    bm25 = retriever.BM25(retriever.load_corpus())
    questions = [json.loads(line) for line in open(EXAMPLES / "search_r1" / "questions.jsonl")]
    assert len(bm25.passages) == 36 and len(questions) == 36
    top1 = sum(bm25.search(q["question"], 1)[0]["id"] == q["doc"] for q in questions)
    top3 = sum(q["doc"] in [p["id"] for p in bm25.search(q["question"], 3)] for q in questions)
    assert (top1, top3) == (35, 36)
    assert bm25.search("zzz qqq", 3) == []
    # every accepted answer is written in its supporting passage (the corpus holds the facts)
    corpus = {p["id"]: p["text"].lower() for p in bm25.passages}
    for q in questions:
        assert any(a.lower() in corpus[q["doc"]] for a in q["answer"]), q
    assert retriever.format_passages(bm25.search("Orrin Vale retire", 1)).startswith("Doc 1(Title: Orrin Vale)")


def test_search_parsing_and_reward(tiny, tmp_path):
    gen = load("search_r1", "generate")
    reward = load("search_r1", "reward")
    assert gen.search_query("tags", "<think>x</think> <search> Velmora river </search>") == "Velmora river"
    assert gen.search_query("tags", "<answer> Brisk </answer>") is None
    assert gen.search_query("plain", "say question the number of yes ?") == "the number of yes"
    assert gen.search_query("plain", "the answer ?") is None
    assert gen.information("plain", [{"title": "t", "text": "a b"}]) == " result a b . "
    args = example_args(tiny, tmp_path / "em", call_format="tags", reward_metric="em")
    s = Sample(label=["Quillan River", "the Quillan River"], response="... <answer> the quillan river. </answer>",
               metadata={"searches": 2})
    assert reward.reward(args, s) == {"score": 1.0, "em": 1.0, "f1": 1.0, "searches": 2.0}
    s.response = "<answer>Quillan</answer>"
    out = reward.reward(example_args(tiny, tmp_path / "f1", call_format="tags", reward_metric="f1"), s)
    assert out["em"] == 0.0 and out["score"] == out["f1"] == pytest.approx(2 / 3)
    s.response = "no answer tags"
    assert reward.reward(args, s)["f1"] == 0.0
    plain = Sample(label=["four", "4"], metadata={"last_turn": "the 4 ?"})  # articles and punctuation go
    assert reward.reward(example_args(tiny, tmp_path / "pe", call_format="plain", reward_metric="em"), plain)["em"] == 1.0
    plain.metadata["last_turn"] = "4 yes"
    out = reward.reward(example_args(tiny, tmp_path / "pf", call_format="plain", reward_metric="f1"), plain)
    assert out["em"] == 0.0 and out["score"] == pytest.approx(2 / 3)


def test_make_data(tmp_path):
    tool = load("tool_use", "make_data")
    train, ev = tool.make_data(tmp_path / "plain", "plain", n_train=50, n_eval=10)
    rows = [json.loads(line) for line in open(train)]
    evals = {json.dumps(json.loads(line)["prompt"]) for line in open(ev)}
    assert len(rows) == 50 and len(evals) == 10 and not evals & {json.dumps(r["prompt"]) for r in rows}
    tools = load("tool_use", "tools")
    for r in rows:
        q = r["prompt"][0]["content"]
        assert tools.calculate(tools.last_expression(q)) == r["label"] and len(r["label"]) == 1
    train, _ = tool.make_data(tmp_path / "hermes", "hermes", n_train=20, n_eval=4)
    row = json.loads(open(train).readline())
    assert row["prompt"][0]["role"] == "system" and "<tool_call>" in row["prompt"][0]["content"]
    assert tools.calculate(row["prompt"][1]["content"].removeprefix("What is ")) == row["label"]
    search = load("search_r1", "make_data")
    train, ev = search.make_data(tmp_path / "search", "tags", n_eval=8)
    assert sum(1 for _ in open(train)) == 28 and sum(1 for _ in open(ev)) == 8
    assert "<search>" in json.loads(open(train).readline())["prompt"][0]["content"]


# ---------------------------------------------------------------- end to end on the tiny model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from slime.utils.tiny_model import build_tiny_model

    work = tmp_path_factory.mktemp("examples")
    return {"model": str(build_tiny_model(work / "model", seed=0)), "work": work}


def train(tiny, out: Path, data: Path, example: str, generate: str, config: str, *extra) -> list[dict]:
    cmd = [
        sys.executable, "train.py", "--hf-checkpoint", tiny["model"], "--prompt-data", str(data),
        "--input-key", "prompt", "--label-key", "label", "--apply-chat-template", "--rollout-shuffle", "--seed", "1",
        "--output-dir", str(out), "--advantage-estimator", "grpo", "--rollout-temperature", "1.0",
        "--lr", "3e-3", "--adam-beta2", "0.99", "--eps-clip", "0.2", "--use-kl-loss", "--kl-loss-coef", "0.001",
        "--kl-loss-type", "low_var_kl",
        "--custom-generate-function-path", f"examples/{example}/{generate}",
        "--custom-rm-path", f"examples/{example}/reward.py:reward", "--reward-key", "score",
        "--custom-config-path", f"examples/{example}/{config}",
        "--save-debug-rollout-data", str(out / "rollout_{rollout_id}.pt"), *extra,
    ]
    proc = run(cmd, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [r for r in records(out) if "rollout/raw_reward" in r]
    for r in rows:
        # the rollout log-probs of every model token, and nothing else, line up with the trainer's
        assert r["train/train_rollout_logprob_abs_diff"] < 1e-3, r
    return rows


def saved_samples(out: Path, rollout_id: int) -> list[Sample]:
    from slime.rollout.debug_data import load_samples

    return load_samples(str(out / "rollout_{rollout_id}.pt"), rollout_id)


def spans(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) runs of a loss mask."""
    out = []
    for i, v in enumerate(mask):
        if out and out[-1][0] == v:
            out[-1] = (v, out[-1][1], i + 1)
        else:
            out.append((v, i, i + 1))
    return out


@pytest.fixture(scope="module")
def tokenizer(tiny):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny["model"])


@pytest.mark.e2e
def test_tool_use_reward_rises(tiny, tmp_path, tokenizer):
    """The calculator example (plain calls, answers 0..2) on the tiny model: over 16 rollouts the model
    learns to call the tool, then to answer, and the reward rises (measured: first 3 rollouts 0.195, last 3
    0.386); every tool result is environment tokens (mask 0)."""
    from slime.rollout.multiturn import env_message_tokens

    data, _ = load("tool_use", "make_data").make_data(tmp_path / "data", "plain", n_train=256, n_eval=16,
                                                      max_result=2)
    n = 16
    rows = train(tiny, tmp_path / "out", data, "tool_use", "generate.py:generate", "config_tiny.yaml",
                 "--rollout-batch-size", "8", "--n-samples-per-prompt", "8", "--global-batch-size", "32",
                 "--num-rollout", str(n), "--rollout-max-response-len", "24", "--micro-batch-size", "32")
    assert len(rows) == n
    for key in ("rollout/reward/correct", "rollout/reward/tool_calls", "rollout/reward/turns"):
        assert all(key in r for r in rows), key
    rewards = [r["rollout/raw_reward"] for r in rows]
    calls = [r["rollout/reward/tool_calls"] for r in rows]
    first, last = statistics.fmean(rewards[:3]), statistics.fmean(rewards[-3:])
    print(f"tool_use: first3={first:.3f} last3={last:.3f} rewards={[round(x, 3) for x in rewards]} "
          f"tool_calls={[round(x, 2) for x in calls]} correct={[round(r['rollout/reward/correct'], 3) for r in rows]}")
    assert last >= 1.5 * first and last > first + 0.1, rewards
    assert statistics.fmean(calls[-3:]) > statistics.fmean(calls[:3]) + 0.2, calls

    tools = load("tool_use", "tools")
    eos = tokenizer.eos_token_id
    checked = 0
    for s in saved_samples(tmp_path / "out", n - 1):
        assert len(s.loss_mask) == len(s.rollout_log_probs) == s.response_length
        resp = s.response_tokens
        for value, a, b in spans(s.loss_mask):
            if value == 1:
                assert all(lp <= 0 for lp in s.rollout_log_probs[a:b])
                continue
            # an environment span is exactly the calculator's answer to the question, as a chat turn
            question = tokenizer.decode(s.tokens[: s.prompt_length], skip_special_tokens=True)
            result = tools.calculate(tools.last_expression(question))
            assert result == s.label
            env = env_message_tokens(tokenizer, [{"role": "user", "content": f"result {result}"}],
                                     turn_ended=resp[a - 1] == eos)
            assert resp[a:b] == env and s.rollout_log_probs[a:b] == [0.0] * (b - a)
            checked += 1
    assert checked >= 8


@pytest.mark.e2e
def test_search_r1_runs_and_masks_the_retrieved_passages(tiny, tmp_path, tokenizer):
    search = load("search_r1", "generate")
    data, _ = load("search_r1", "make_data").make_data(tmp_path / "data", "plain", n_eval=8)
    n = 3
    rows = train(tiny, tmp_path / "out", data, "search_r1", "generate.py:generate", "config_tiny.yaml",
                 "--rollout-batch-size", "4", "--n-samples-per-prompt", "8", "--global-batch-size", "32",
                 "--num-rollout", str(n), "--rollout-max-response-len", "64", "--micro-batch-size", "32")
    assert len(rows) == n
    for key in ("rollout/reward/em", "rollout/reward/f1", "rollout/reward/searches"):
        assert all(key in r for r in rows), key
    bm25 = search.retriever(str(search.CORPUS))
    searched = 0
    for rid in range(n):
        for s in saved_samples(tmp_path / "out", rid):
            zeros = [(a, b) for v, a, b in spans(s.loss_mask) if v == 0]
            queries = s.metadata["queries"]
            assert s.metadata["searches"] == len(queries) == len(zeros)
            for (a, b), q in zip(zeros, queries):
                want = tokenizer(search.information("plain", bm25.search(q, 1)), add_special_tokens=False)["input_ids"]
                assert s.response_tokens[a:b] == want
                searched += 1
    assert searched > 0
    assert sum(r["rollout/reward/searches"] for r in rows) > 0


@pytest.mark.e2e
def test_openai_agent_episodes_become_samples(tiny, tmp_path, tokenizer):
    data, _ = load("openai_agent", "make_data").make_data(tmp_path / "data", tiny=True, n_train=64, n_eval=8)
    n = 3
    rows = train(tiny, tmp_path / "out", data, "openai_agent", "agent.py:generate", "config_tiny.yaml",
                 "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "16",
                 "--num-rollout", str(n), "--rollout-max-response-len", "24", "--micro-batch-size", "16")
    assert len(rows) == n
    for key in ("rollout/reward/correct", "rollout/reward/calls", "rollout/reward/segments"):
        assert all(key in r for r in rows), key
    check = tokenizer.apply_chat_template([{"role": "user", "content": "reply with only the final result"}],
                                          tokenize=True, add_generation_prompt=True, return_dict=False)
    eos = tokenizer.eos_token_id
    whole = 0
    for rid in range(n):
        for s in saved_samples(tmp_path / "out", rid):
            runs = spans(s.loss_mask)
            if s.metadata["calls"] == 2:
                # model reply, the agent's check request (mask 0), model reply
                assert [v for v, _, _ in runs] == [1, 0, 1]
                _, (_, a, b), _ = runs
                env = s.response_tokens[a:b]
                assert env == ([] if s.response_tokens[a - 1] == eos else [eos]) + list(check)
                assert s.metadata["agent_result"] == tokenizer.decode(s.response_tokens[b:], skip_special_tokens=True)
                whole += 1
            else:  # a segment of an episode the chat template could not continue token for token
                assert s.metadata["calls"] == 1 and s.metadata["segments"] == 2 and runs == [(1, 0, s.response_length)]
    assert whole > 0


# ---------------------------------------------------------------- the real-model formats, on a scripted engine


def _scripted(tokenizer, turns, args, example, sample):
    from slime.rollout import api

    engines = ScriptedFleet(turns)
    api.set_context(api.RolloutContext(args, tokenizer, engines, "http://unused"))
    try:
        gen = load(example, "generate")
        params = {"temperature": 1.0, "max_new_tokens": args.rollout_max_response_len, "sampling_seed": 5}
        return asyncio.run(gen.generate(args, sample, params)), engines
    finally:
        api.set_context(None)


def _prompt_sample(tokenizer, content, label):
    ids = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=True,
                                        add_generation_prompt=True, return_dict=False)
    return Sample(prompt=[{"role": "user", "content": content}], label=label, tokens=list(ids))


def test_tool_use_hermes_calls_python_and_calculator(tiny, tokenizer, tmp_path, monkeypatch):
    from slime.rollout.multiturn import env_message_tokens

    _python_tool_runs(load("tool_use", "tools"), monkeypatch)

    eos = tokenizer.eos_token_id
    t1, t2, t3 = ([tokenizer.convert_tokens_to_ids(w) for w in words] + [eos]
                  for words in (["compute", "6"], ["compute", "4", "0"], ["4", "2"]))
    turns = [('<tool_call>{"name": "python", "arguments": {"code": "print(6 * 7)"}}</tool_call>', t1, "stop", eos),
             ('<tool_call>{"name": "calculator", "arguments": {"expression": "40 + 2"}}</tool_call>', t2, "stop", eos),
             ("42", t3, "stop", eos)]
    args = example_args(tiny, tmp_path, call_format="hermes", python_tool=True, max_turns=4,
                        rollout_max_response_len=200)
    sample = _prompt_sample(tokenizer, "what is 6 times 7 ?", "42")
    prompt = list(sample.tokens)
    s, engines = _scripted(tokenizer, turns, args, "tool_use", sample)
    env = env_message_tokens(tokenizer, [{"role": "tool", "content": "42"}])
    assert s.tokens == prompt + t1 + env + t2 + env + t3
    assert s.loss_mask == [1] * len(t1) + [0] * len(env) + [1] * len(t2) + [0] * len(env) + [1] * len(t3)
    assert s.metadata["tool_ok"] == 2 and s.metadata["answered"] and s.metadata["tool_calls"] == 2
    assert [p["sampling_params"].get("stop") for p in engines.payloads] == [None] * 3  # no plain stop string
    assert load("tool_use", "reward").reward(example_args(tiny, tmp_path / "plain"), s) == {
        "score": 1.0, "correct": 1.0, "tool_calls": 2.0, "turns": 3.0}


def test_search_r1_tags_format_appends_the_passages(tiny, tokenizer, tmp_path):
    search = load("search_r1", "generate")
    eos = tokenizer.eos_token_id
    t1 = [tokenizer.convert_tokens_to_ids(w) for w in ["the", "answer"]]
    t2 = [tokenizer.convert_tokens_to_ids("yes"), eos]
    turns = [("<think> where </think> <search> Orrin Vale retire </search>", t1, "stop", "</search>"),
             ("<answer> Brisk </answer>", t2, "stop", "</answer>")]
    args = example_args(tiny, tmp_path, call_format="tags", search_top_k=2, max_turns=4,
                        rollout_max_response_len=400)
    sample = _prompt_sample(tokenizer, "question", ["Brisk"])
    prompt = list(sample.tokens)
    s, engines = _scripted(tokenizer, turns, args, "search_r1", sample)
    passages = search.retriever(str(search.CORPUS)).search("Orrin Vale retire", 2)
    assert [p["title"] for p in passages] == ["Orrin Vale", "The Gull of Semmet"]
    info = search.information("tags", passages)
    assert info.startswith("\n\n<information>Doc 1(Title: Orrin Vale)") and info.endswith("</information>\n\n")
    env = tokenizer(info, add_special_tokens=False)["input_ids"]
    assert s.tokens == prompt + t1 + env + t2
    assert s.loss_mask == [1] * len(t1) + [0] * len(env) + [1] * len(t2)
    assert s.metadata["queries"] == ["Orrin Vale retire"] and s.metadata["last_turn"] == "<answer> Brisk </answer>"
    stops = engines.payloads[0]["sampling_params"]
    assert stops["stop"] == ["</search>", "</answer>"] and stops["no_stop_trim"] is True
    assert [p["sampling_params"]["sampling_seed"] for p in engines.payloads] == [5, 6]
