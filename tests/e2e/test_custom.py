"""End-to-end runs of train.py with custom rollout pieces on the tiny model: an eval-only run with
pass@k, a remote reward service, reasoning-gym tasks as the data source, and a verifiers environment
(examples/verifiers_env) as the rollout."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.helpers.e2e import records, run, shape_cmd

pytestmark = pytest.mark.e2e


def test_eval_only_run_reports_pass_at_k(task, tmp_path):  # noqa: F811
    out = tmp_path / "out"
    r = run([*shape_cmd(task, out, "--eval-prompt-data", "parity", task["eval"],
                        "--n-samples-per-eval-prompt", "4"), "--num-rollout", "0"])
    assert r.returncode == 0, r.stderr[-3000:]
    (rec,) = records(out)
    assert rec["trained_rollouts"] == 0
    assert not any(k.startswith("train/") for k in rec)
    for key in ("eval/parity", "eval/parity/pass@1", "eval/parity/pass@2", "eval/parity/pass@4",
                "eval/parity/truncated_ratio"):
        assert 0.0 <= rec[key] <= 1.0, key
    # pass@k never falls as k grows, and pass@1 is the mean reward for 0/1 rewards
    assert rec["eval/parity/pass@1"] <= rec["eval/parity/pass@2"] <= rec["eval/parity/pass@4"]
    assert rec["eval/parity/pass@1"] == pytest.approx(rec["eval/parity"])


class _Scorer(BaseHTTPRequestHandler):
    """Reward 1.0 when the response contains the label, else 0.0; every 5th call fails with 503 once."""

    calls: list = []
    lock = threading.Lock()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.lock:
            self.calls.append(body)
            n = len(self.calls)
        if n % 5 == 0:
            self.send_response(503)
            self.end_headers()
            return
        reward = float(str(body["label"]) in body["response"].split())
        data = json.dumps({"reward": reward}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


def test_remote_reward_service(task, tmp_path):  # noqa: F811
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Scorer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        out = tmp_path / "out"
        url = f"http://127.0.0.1:{server.server_address[1]}/score"
        r = run(shape_cmd(task, out, "--num-rollout", "2", "--rm-url", url))
        assert r.returncode == 0, r.stderr[-3000:]
    finally:
        server.shutdown()
    recs = records(out)
    assert len(recs) == 2
    ok = [c for i, c in enumerate(_Scorer.calls, start=1) if i % 5]
    assert len(ok) == 2 * 16  # every sample scored once; each 503 retried
    assert all(set(c) == {"prompt", "response", "label", "metadata"} for c in ok)
    for rec in recs:
        assert rec["rollout/reward_failures"] == 0.0
    expected = [float(str(c["label"]) in c["response"].split()) for c in ok]
    assert sum(rec["rollout/raw_reward"] for rec in recs) * 16 == pytest.approx(sum(expected))


def test_reasoning_gym_data_source(task, tmp_path):  # noqa: F811
    cfg = tmp_path / "rg.yaml"
    cfg.write_text("reasoning_gym:\n  datasets:\n    chain_sum: {size: 40, seed: 1, min_terms: 2, max_terms: 2, "
                   "min_digits: 1, max_digits: 1}\n")
    out = tmp_path / "out"
    cmd = [a for a in shape_cmd(task, out, "--num-rollout", "2") if a not in ("--prompt-data", task["train"])]
    cmd += ["--data-source-path", "slime.data.reasoning_gym.ReasoningGymDataSource",
            "--custom-config-path", str(cfg), "--rm-type", "reasoning_gym", "--save-debug-rollout-data",
            str(tmp_path / "rollout_{rollout_id}.pt")]
    r = run(cmd)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = records(out)
    assert [rec["rollout_id"] for rec in recs] == [0, 1]
    assert all(rec["rollout/reward_failures"] == 0.0 for rec in recs)
    from slime.rollout.debug_data import load_samples

    samples = load_samples(str(tmp_path / "rollout_{rollout_id}.pt"), 0)
    assert len(samples) == 16
    assert all(s.metadata["reasoning_gym"]["dataset"] == "chain_sum" for s in samples)
    assert all("arithmetic problem" in s.prompt for s in samples)


def test_verifiers_environment(task, tmp_path):  # noqa: F811
    """The example verifiers environment (2 turns: answer, then check) from a --config file: its dataset is the
    data, its rubric the reward; each saved Sample masks exactly the model's two replies."""
    needs = "the verifiers adapter needs `verifiers` 0.3 (pip install 'verifiers>=0.3.1,<0.4')"
    if not hasattr(pytest.importorskip("verifiers", reason=needs), "OpenAIChatCompletionsClient"):
        pytest.skip(needs)
    from transformers import AutoTokenizer

    from slime.rollout.debug_data import load_samples

    cfg = tmp_path / "env.yaml"
    cfg.write_text("custom_generate_function_path: slime.rollout.environments.verifiers_env.generate\n"
                   "env_id: examples/verifiers_env/check_env.py\n"
                   "env_args: {turns: 2, num_examples: 16, max_tokens: 3}\n")
    out = tmp_path / "out"
    cmd = [a for a in shape_cmd(task, out, "--num-rollout", "1", "--rollout-max-response-len", "32")
           if a not in ("--prompt-data", task["train"])]
    r = run([*cmd, "--config", str(cfg), "--save-debug-rollout-data", str(tmp_path / "rollout_{rollout_id}.pt")])
    assert r.returncode == 0, r.stderr[-3000:]
    (rec,) = records(out)
    assert rec["rollout/reward_failures"] == 0.0
    samples = load_samples(str(tmp_path / "rollout_{rollout_id}.pt"), 0)
    assert len(samples) == 16
    tok = AutoTokenizer.from_pretrained(task["model"])
    check = list(tok.apply_chat_template([{"role": "user", "content": "check your answer . what is the answer ?"}],
                                         tokenize=True, add_generation_prompt=True, return_dict=False))
    whole = 0
    for s in samples:
        assert s.reward == s.metadata["env_reward"] in (0.0, 1.0)
        assert "vf_input" in s.metadata and len(s.loss_mask) == len(s.rollout_log_probs) == s.response_length
        runs = []
        for j, m in enumerate(s.loss_mask):
            if not runs or runs[-1][0] != m:
                runs.append([m, j, j])
            runs[-1][2] = j + 1
        if s.metadata["calls"] == 2:  # reply, the environment's check turn (mask 0), reply
            assert [m for m, _, _ in runs] == [1, 0, 1]
            (_, _, a), (_, _, b) = runs[0], runs[1]
            eos = tok.eos_token_id
            assert s.response_tokens[a:b] == ([] if s.response_tokens[a - 1] == eos else [eos]) + check
            whole += 1
        else:  # one reply (a segment the chat template could not continue token for token, or an early stop)
            assert [m for m, _, _ in runs] == [1]
    assert whole > 0
