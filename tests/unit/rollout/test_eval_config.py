"""`--eval-config` (slime.eval_flags, slime.rollout.evaluation): original slime's per-dataset eval file.
Which value wins (dataset > eval.defaults > --eval-* flags > --rollout-* flags), one-line errors naming
the file, line and field, and an evaluation against a scripted engine where every set is generated and
scored with its own settings."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from slime.rollout.evaluation import evaluate, load_eval_sets
from slime.rollout.group_generation import GroupRunner
from slime.rollout.rewards import build_reward
from slime.utils.errors import SlimeConfigError
from tests.helpers.args import make_args
from tests.helpers.rollout import ScriptedFleet


def rows(path: Path, items: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in items))
    return str(path)


@pytest.fixture
def files(tmp_path):
    a = rows(tmp_path / "a.jsonl", [{"input": "1 + 1", "label": "2"}, {"input": "2 + 2", "label": "4"}])
    b = rows(tmp_path / "b.jsonl", [{"question": "3 + 3", "answer": "6"}])
    return a, b


def config(tmp_path, text: str) -> str:
    path = tmp_path / "evals.yaml"
    path.write_text(text)
    return str(path)


def test_precedence_dataset_then_defaults_then_flags_then_rollout(tiny_model_dir, tmp_path, files):
    a, b = files
    cfg = config(tmp_path, f"""\
eval:
  defaults:
    top_p: 0.5
    n_samples_per_eval_prompt: 3
  datasets:
    - name: a
      path: {a}
      temperature: 0.9
      n_samples_per_eval_prompt: 4
      stop: "###"
    - name: b
      path: {b}
      input_key: question
      label_key: answer
      top_p: 0.25
      rm_type: exact
      metadata_overrides: {{split: test}}
""")
    args = make_args(tiny_model_dir, tmp_path, "--eval-config", cfg, "--eval-temperature", 0.3,
                     "--rollout-max-response-len", 50, "--rollout-top-k", 5, "--eval-max-response-len", 40,
                     "--n-samples-per-eval-prompt", 2)
    da, db = args.eval_datasets
    assert args.eval_sets == {"a": a, "b": b}
    assert (da.temperature, da.top_p, da.top_k, da.max_response_len, da.n_samples_per_eval_prompt, da.stop) == \
        (0.9, 0.5, 5, 40, 4, ("###",))  # own, defaults, --rollout-top-k, --eval-max-response-len, own, own
    assert (db.temperature, db.top_p, db.n_samples_per_eval_prompt, db.stop) == (0.3, 0.25, 3, None)
    assert (da.input_key, da.label_key, db.input_key, db.label_key) == ("input", None, "question", "answer")
    assert (da.rm_type, db.rm_type, db.metadata_overrides) == (None, "exact", {"split": "test"})
    # the datasets as a mapping keyed by name, with no top-level `eval:`
    cfg = config(tmp_path, f"datasets:\n  a: {{path: {a}}}\n")
    args = make_args(tiny_model_dir, tmp_path, "--eval-config", cfg, "--rollout-temperature", 0.7)
    (d,) = args.eval_datasets
    assert (d.name, d.path, d.temperature, d.n_samples_per_eval_prompt) == ("a", a, 0.7, 1)
    # --eval-prompt-data gives the same records, every field from the flags
    args = make_args(tiny_model_dir, tmp_path, "--eval-prompt-data", "x", a, "--eval-top-p", 0.8)
    (d,) = args.eval_datasets
    assert (d.name, d.top_p, d.input_key) == ("x", 0.8, "input") and args.eval_interval == 1 << 30


@pytest.mark.parametrize("body, message", [
    ("eval:\n  datasets:\n    - name: a\n      path: {a}\n      temprature: 0.5\n",
     r":5: eval.datasets\[0\].temprature: unknown field \(did you mean temperature\?\)"),
    ("eval:\n  defaults:\n    top_pp: 0.5\n  datasets: [{{name: a, path: {a}}}]\n",
     r":3: eval.defaults.top_pp: unknown field \(did you mean top_p\?\)"),
    ("eval:\n  datasets:\n    - name: a\n      path: {a}\n      temperature: -1\n",
     r":5: eval.datasets\[0\].temperature: must be >= 0, got -1"),
    ("eval:\n  datasets:\n    - name: a\n      path: {a}\n      n_samples_per_eval_prompt: two\n",
     r":5: eval.datasets\[0\].n_samples_per_eval_prompt: must be an integer >= 1, got 'two'"),
    ("eval:\n  datasets:\n    - name: a\n      path: nowhere.jsonl\n",
     r":4: eval.datasets\[0\].path: file nowhere.jsonl does not exist"),
    ("eval:\n  datasets:\n    - path: {a}\n", r":3: eval.datasets\[0\].name: required"),
    ("eval:\n  datasets:\n    - {{name: a, path: {a}}}\n    - {{name: a, path: {a}}}\n",
     r":4: eval.datasets\[1\].name: 'a' is used twice"),
    ("eval:\n  datasets:\n    - {{name: a, path: {a}, rm_type: maths}}\n",
     r":3: eval.datasets\[0\].rm_type: 'maths' is not a reward type"),
    ("eval:\n  datasets:\n    - {{name: a, path: {a}, rm_type: remote_rm}}\n",
     r":3: eval.datasets\[0\].rm_type: remote_rm needs --rm-url"),
    ("eval:\n  datasets:\n    - {{name: a, path: {a}, custom_rm_path: nowhere.py:rm}}\n",
     r":3: eval.datasets\[0\].custom_rm_path: custom_rm_path nowhere.py:rm: file nowhere.py does not exist"),
    ("eval:\n  datasets:\n    - {{name: a, path: {a}, app_service: 'http://x'}}\n",
     r":3: eval.datasets\[0\].app_service: original slime's field, not built here"),
    ("eval:\n  datasets: []\n", r":2: eval.datasets: required"),
    ("evals:\n  datasets: []\n", r":1: evals: unknown field \(did you mean eval\?\)"),
    ("eval:\n  datasets: [\n", r": not valid YAML \(line \d+\)"),
])
def test_bad_eval_config_is_one_line_naming_file_line_and_field(tiny_model_dir, tmp_path, files, body, message):
    cfg = config(tmp_path, body.format(a=files[0]))
    with pytest.raises(SlimeConfigError, match=rf"^--eval-config {cfg}{message}") as ei:
        make_args(tiny_model_dir, tmp_path, "--eval-config", cfg)
    assert "\n" not in str(ei.value)


def test_eval_config_and_eval_prompt_data_are_not_both_given(tiny_model_dir, tmp_path, files):
    cfg = config(tmp_path, f"eval:\n  datasets: [{{name: a, path: {files[0]}}}]\n")
    with pytest.raises(SlimeConfigError, match="--eval-config and --eval-prompt-data both name eval sets"):
        make_args(tiny_model_dir, tmp_path, "--eval-config", cfg, "--eval-prompt-data", files[0])
    with pytest.raises(SlimeConfigError, match=r"^--eval-config: file .*none.yaml does not exist$"):
        make_args(tiny_model_dir, tmp_path, "--eval-config", tmp_path / "none.yaml")


def test_evaluation_generates_and_scores_each_set_with_its_own_settings(tiny_model_dir, tmp_path, files):
    from transformers import AutoTokenizer

    a, b = files
    (tmp_path / "rm.py").write_text("def quarter(args, sample):\n    return 0.25\n")
    cfg = config(tmp_path, f"""\
eval:
  defaults: {{max_response_len: 7}}
  datasets:
    - {{name: a, path: {a}, temperature: 0.9, top_p: 0.5, n_samples_per_eval_prompt: 3, stop: ["##"]}}
    - {{name: b, path: {b}, input_key: question, label_key: answer, rm_type: exact, max_response_len: 5}}
    - {{name: c, path: {a}, custom_rm_path: {tmp_path / 'rm.py'}:quarter, metadata_overrides: {{tag: c}}}}
""")
    args = make_args(tiny_model_dir, tmp_path, "--eval-config", cfg, "--rm-type", "math", "--eval-temperature", 0.2)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    sets = load_eval_sets(args, tok)
    seen = []

    def script(payload):
        seen.append(payload)
        return ("6", tok("6", add_special_tokens=False)["input_ids"] + [tok.eos_token_id], "stop", None)

    runner = GroupRunner(args, ScriptedFleet(script), build_reward(args))
    metrics = evaluate(args, sets, runner, asyncio.run, None, rollout_id=0)
    by_len = {}
    for p in seen:
        by_len.setdefault(tok.decode(p["input_ids"]), []).append(p["sampling_params"])
    a_params = [sp for text, sps in by_len.items() if "1 + 1" in text or "2 + 2" in text for sp in sps]
    b_params = [sp for text, sps in by_len.items() if "3 + 3" in text for sp in sps]
    # a: 2 prompts x 3 samples with its own sampling; c (same prompts) 2 x 1 with the flags' values
    assert len(seen) == 2 * 3 + 1 + 2 * 1 and len(b_params) == 1 and len(a_params) == 8
    got = sorted((sp["temperature"], sp["top_p"], sp["max_new_tokens"], tuple(sp.get("stop", ()))) for sp in a_params)
    assert got == [(0.2, 1.0, 7, ())] * 2 + [(0.9, 0.5, 7, ("##",))] * 6
    assert (b_params[0]["temperature"], b_params[0]["max_new_tokens"]) == (0.2, 5)
    # rewards: a by the run's math reward (its labels 2 and 4, the answer 6: wrong), b by exact match of
    # its own label field (6), c by its own function
    assert metrics["eval/a"] == 0.0 and metrics["eval/b"] == 1.0 and metrics["eval/c"] == 0.25
    assert "eval/a/pass@2" in metrics and "eval/b/pass@2" not in metrics
    assert sets["c"].sample(sets["c"].prompts[0]).metadata == {"tag": "c"}
