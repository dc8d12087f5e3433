"""End-to-end runs of train.py and the quickstart on the tiny model (Ray + engine + trainer)."""

import importlib.util
import json
import statistics
import sys
from pathlib import Path

import pytest

from slime.observability.spans import coverage, read_rollout
from slime.timeline import write_timeline
from tests.helpers.e2e import REFERENCE_FLAGS, records, run, shape_cmd

pytestmark = pytest.mark.e2e

TRAIN_KEYS = [
    "rollout/raw_reward", "rollout/response_len/mean", "train/loss", "train/pg_loss", "train/kl_loss",
    "train/entropy_loss", "train/pg_clipfrac", "train/grad_norm", "train/train_rollout_logprob_abs_diff",
    "perf/rollout_time", "perf/train_time", "perf/update_weights_time",
]


def test_quickstart_tiny_reward_rises(tmp_path):
    out = tmp_path / "qs"
    proc = run([sys.executable, "examples/quickstart.py", "--tiny", "--output-dir", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    train = [r for r in records(out) if "rollout/raw_reward" in r]
    rewards = [r["rollout/raw_reward"] for r in train]
    first, last = statistics.fmean(rewards[:3]), statistics.fmean(rewards[-3:])
    assert last >= 1.5 * first and last > first + 0.1, rewards
    assert all(r["train/train_rollout_logprob_abs_diff"] < 1e-3 for r in train)
    evals = [r for r in records(out) if "trained_rollouts" in r]
    assert [e["trained_rollouts"] for e in evals][0] == 0 and evals[-1]["trained_rollouts"] == len(train)
    assert "eval/parity:" in proc.stdout
    # the rollout timeline (docs/timeline.md): through the router, every call split by the native engine
    # that served it; the spans cover each sample's wall time; the page and summary render
    header, rows = read_rollout(out / "timeline" / f"rollout_{len(train) - 1}.jsonl")
    calls = [s for r in rows for s in r["spans"] if s["kind"] in ("prefill", "decode")]
    assert rows and calls and all(s["engine"] in header["engines"] for s in calls), header
    for r in rows:
        a, b = min(s["start"] for s in r["spans"]), max(s["end"] for s in r["spans"])
        assert sum(coverage(r["spans"], a, b)) < 0.01 and header["start"] <= a <= b <= header["end"]
    page, summary = write_timeline(out, len(train) - 1)
    assert page.is_file() and header["engines"][0] in summary
    assert "rollout/pass@1" in train[-1] and "rollout/response_len/p90" in train[-1]


def test_quickstart_tiny_learns_with_every_trainer_feature_on(tmp_path):
    """The tiny quickstart with --bf16, recompute, a warm-up + cosine schedule, 16-token log-prob
    chunks, optimizer offload (a no-op on a CPU) and TIS: the reward still rises, every step's
    learning rate follows the schedule, and the bf16 trainer and engine agree within 5e-3.
    --bf16 on FSDP: bf16 compute with fp32 master weights (FSDP2's mixed precision); the native engine
    serves bf16, each push is half the bytes of the fp32 weights (2 per parameter) and is checked bit
    for bit in the engine's dtype; the train-vs-rollout log-prob gap stays logged and TIS runs on it."""
    out = tmp_path / "qs"
    proc = run([sys.executable, "examples/quickstart.py", "--tiny", "--output-dir", str(out), "--", "--bf16",
                "--gradient-checkpointing", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--min-lr", "1e-4",
                "--log-probs-chunk-size", "16", "--optimizer-cpu-offload", "--use-tis", "--check-weight-update-equal"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    train = [r for r in records(out) if "rollout/raw_reward" in r]
    rewards = [r["rollout/raw_reward"] for r in train]
    first, last = statistics.fmean(rewards[:3]), statistics.fmean(rewards[-3:])
    assert last >= 1.5 * first and last > first + 0.1, rewards
    lrs = [r["train/lr"] for r in train]
    assert lrs[1] == max(lrs) and lrs[1:] == sorted(lrs[1:], reverse=True) and lrs[-1] < 0.1 * lrs[1]
    # bf16 trainer vs bf16 engine: logged every rollout (on this tiny model they agree exactly: 0.0 in all 12
    # rollouts on 2026-11-28; the megatron run below, with 8-token responses, differs by more than 0)
    assert all(r["train/train_rollout_logprob_abs_diff"] < 5e-3 for r in train)
    from safetensors import safe_open

    with safe_open(str(out / "model" / "model.safetensors"), "pt") as f:  # the fp32 weights the run started from
        fp32_bytes = sum(f.get_tensor(k).numel() * 4 for k in f.keys())
    assert [r["weights/bytes"] for r in train] == [fp32_bytes / 2] * len(train)


def test_quickstart_shape_metrics_and_determinism(task, reference_run, tmp_path):
    b = tmp_path / "b"
    proc = run(shape_cmd(task, b, *REFERENCE_FLAGS))
    assert proc.returncode == 0, proc.stderr[-3000:]
    a = reference_run["out"]
    ra, rb = records(a), records(b)
    assert [r["rollout_id"] for r in ra] == [0, 1, 2, 3]
    for r in ra:
        for key in TRAIN_KEYS:
            assert key in r, key
        assert r["train/train_rollout_logprob_abs_diff"] < 1e-3
        assert r["train/pg_clipfrac"] == 0.0  # one step per rollout: ratio is exactly 1
    # Same seed: identical samples, rewards and training metrics. The one exception is the engine's
    # own log-probs, whose last bits depend on which requests happened to share a batch (fp32 matmul
    # blocking varies with batch size), so their distance to the trainer's agrees only to ~1e-8.
    lp = "train/train_rollout_logprob_abs_diff"
    strip = lambda rs: [{k: v for k, v in r.items() if not k.startswith("perf/") and k != lp} for r in rs]
    assert strip(ra) == strip(rb)
    assert [r[lp] for r in ra] == pytest.approx([r[lp] for r in rb], abs=1e-7)
    assert (a / "tensorboard").is_dir()


@pytest.mark.parametrize("case", ["malformed_jsonl", "missing_label", "batch_rule", "unknown_flag", "missing_checkpoint"])
def test_bad_input_one_clear_line(task, tmp_path, case):
    data = Path(task["train"])
    cmd = shape_cmd(task, tmp_path / "out")
    if case == "malformed_jsonl":
        bad = tmp_path / "bad.jsonl"
        lines = data.read_text().splitlines()
        bad.write_text("\n".join(lines[:2] + ['{"prompt": [}'] + lines[2:]) + "\n")
        cmd[cmd.index(str(data))] = str(bad)
        expected = f"{bad}:3: malformed JSON"
    elif case == "missing_label":
        bad = tmp_path / "bad.jsonl"
        rows = [json.loads(line) for line in data.read_text().splitlines()]
        del rows[4]["label"]
        bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
        cmd[cmd.index(str(data))] = str(bad)
        expected = f"{bad}:5: missing field 'label' (--label-key)"
    elif case == "batch_rule":
        cmd[cmd.index("--global-batch-size") + 1] = "12"
        expected = "rollout_batch_size * n_samples_per_prompt (4 * 4 = 16)"
    elif case == "unknown_flag":
        cmd.append("--kl-los-coef")
        expected = "unknown flag --kl-los-coef (did you mean --kl-loss-coef?)"
    else:
        cmd[cmd.index(task["model"])] = str(tmp_path / "no_model")
        expected = f"--hf-checkpoint: directory {tmp_path / 'no_model'} does not exist"
    proc = run(cmd, timeout=300)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    error_lines = [line for line in proc.stderr.splitlines() if line.startswith("slime: error:")]
    assert len(error_lines) == 1, proc.stderr[-3000:]
    assert expected in error_lines[0]


def test_two_train_ranks_and_two_engines(task, tmp_path):
    out = tmp_path / "out"
    cmd = shape_cmd(task, out, "--num-rollout", "2")
    cmd[cmd.index("--actor-num-gpus-per-node") + 1] = "2"
    cmd[cmd.index("--rollout-num-gpus") + 1] = "2"
    proc = run(cmd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 engine(s) at" in proc.stdout and "2 train rank(s)" in proc.stdout
    logs = sorted(p.name for p in (out / "logs").iterdir())
    assert logs == ["engine_0.log", "engine_1.log", "router.log"]
    for rec in records(out):
        assert rec["train/train_rollout_logprob_abs_diff"] < 1e-3


MEGATRON_PP2 = ["--train-backend", "megatron", "--pipeline-model-parallel-size", "2", "--actor-num-gpus-per-node", "2"]


NEEDS_MEGATRON = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")


@NEEDS_MEGATRON
def test_bf16_trains_and_pushes_half_the_bytes_on_megatron(task, reference_run, tmp_path):
    """--bf16 on megatron: bf16 parameters with fp32 main copies, two pipeline stages sending bf16
    activations; the native engine serves bf16, each push is half the fp32 reference run's bytes and is
    checked bit for bit in the engine's dtype; the train-vs-rollout log-prob gap stays logged (and
    small) and TIS runs on it. (FSDP's --bf16 is checked the same way in the quickstart run above with
    every trainer feature on.)"""
    out = tmp_path / "out"
    reward = tmp_path / "reward.py"  # a reward that varies within a group, so every rollout trains
    reward.write_text("def reward(args, sample):\n    text = sample.response or ''\n"
                      "    return sum(c.isdigit() for c in text) / max(1, len(text))\n")
    proc = run(shape_cmd(task, out, "--seed", "7", "--num-rollout", "2", "--bf16", "--use-tis",
                         "--check-weight-update-equal", "--custom-rm-path", f"{reward}:reward",
                         "--rollout-max-response-len", "8", *MEGATRON_PP2))
    assert proc.returncode == 0, proc.stderr[-3000:]
    bf16, fp32 = records(out), records(reference_run["out"])
    assert [r["weights/bytes"] for r in bf16] == [fp32[0]["weights/bytes"] / 2] * 2
    assert all(0 < r["train/train_rollout_logprob_abs_diff"] < 5e-3 for r in bf16)  # bf16 trainer vs bf16 engine
    assert all(r["train/grad_norm"] > 0 for r in bf16)
