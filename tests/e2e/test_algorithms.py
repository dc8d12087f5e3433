"""End-to-end: the reward rises on the tiny parity task for every advantage estimator (and DAPO);
SFT then GRPO is one workflow.

Each case runs train.py with the quickstart's tiny shape (8 prompts x 8 samples, two optimizer
steps per rollout, lr 3e-3) for 8 rollouts, about 70-90 s each on 2 CPU cores.
"""

import json
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

from tests.helpers.e2e import records, run  # noqa: E402

pytestmark = pytest.mark.e2e

NUM_ROLLOUT = 8
FILTER = "slime.rollout.filters.check_reward_nonzero_std"
CASES = {
    "gspo": ["--advantage-estimator", "gspo"],
    "cispo": ["--advantage-estimator", "cispo", "--eps-clip-high", "0.28"],
    "reinforce_plus_plus": ["--advantage-estimator", "reinforce_plus_plus", "--normalize-advantages",
                            "--kl-coef", "0.001"],
    "reinforce_plus_plus_baseline": ["--advantage-estimator", "reinforce_plus_plus_baseline",
                                     "--normalize-advantages", "--kl-coef", "0.001"],
    "ppo": ["--advantage-estimator", "ppo", "--gamma", "1.0", "--lambd", "0.95", "--value-clip", "0.2"],
    # RLOO, with the step count spelled out (the second step's ratio is no longer 1) and TIS on
    "rloo": ["--advantage-estimator", "rloo", "--num-steps-per-rollout", "2", "--use-tis"],
    # DAPO: clip-higher, dynamic sampling with over-sampling, token-mean loss
    "dapo": ["--advantage-estimator", "grpo", "--eps-clip-high", "0.28", "--dynamic-sampling-filter-path", FILTER,
             "--over-sampling-batch-size", "12", "--loss-agg-mode", "token-mean"],
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from quickstart import tiny_setup

    work = tmp_path_factory.mktemp("e2e_algorithms")
    model, flags = tiny_setup(work)
    flags[flags.index("--num-rollout") + 1] = str(NUM_ROLLOUT)
    return model, flags


@pytest.mark.parametrize("case", list(CASES))
def test_reward_rises(tiny, tmp_path, case):
    model, flags = tiny
    out = tmp_path / case
    cmd = [
        sys.executable, "train.py", "--hf-checkpoint", str(model), "--input-key", "prompt", "--label-key", "label",
        "--apply-chat-template", "--rollout-shuffle", "--seed", "1", "--output-dir", str(out),
        *flags, *CASES[case],
    ]
    proc = run(cmd, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    train = records(out)
    train = [r for r in train if "rollout/raw_reward" in r]
    assert len(train) == NUM_ROLLOUT
    # with a filter the trained groups are biased; judge the policy on everything it generated
    key = "rollout/dynamic_filter/all_raw_reward" if case == "dapo" else "rollout/raw_reward"
    rewards = [r[key] for r in train]
    first, last = statistics.fmean(rewards[:3]), statistics.fmean(rewards[-3:])
    print(f"{case}: first3={first:.3f} last3={last:.3f} rewards={[round(x, 3) for x in rewards]}")
    assert last >= 1.5 * first and last > first + 0.1, (case, rewards)
    assert all(r["train/train_rollout_logprob_abs_diff"] < 1e-3 for r in train)
    if case == "ppo":
        assert all("critic/value_loss" in r for r in train)
        assert train[-1]["critic/value_loss"] < train[0]["critic/value_loss"]
    if case == "rloo":
        assert all(abs(r["train/tis_weight"] - 1.0) < 1e-3 for r in train)  # engine and trainer agree
        assert any(abs(r["train/ppo_kl"]) > 1e-6 for r in train)  # the second step is off-policy
    if case == "dapo":
        assert all(r["rollout/zero_std_group_ratio"] == 0.0 or r["rollout/dynamic_filter/fallback_groups"] > 0
                   for r in train)
        assert sum(r.get("rollout/dynamic_filter/drop_zero_std", 0) for r in train) > 0


def test_sft_then_grpo_from_the_sft_checkpoint(tiny, tmp_path):
    """SFT on chat conversations of the parity task (single- and multi-turn), then GRPO from the SFT
    checkpoint's hf/ directory: the SFT loss falls, and GRPO starts from a policy that answers in format
    (the base model's first-rollout reward on this task is about 0)."""
    import random

    model, flags = tiny
    prompts = flags[flags.index("--prompt-data") + 1]
    rows = [json.loads(line) for line in open(prompts)]
    rng = random.Random(0)
    sft_data = tmp_path / "sft.jsonl"
    with open(sft_data, "w") as f:
        for i, r in enumerate(rows):
            messages = r["prompt"] + [{"role": "assistant", "content": r["label"]}]
            if i % 2:  # system / user / assistant / user / assistant
                other = rng.choice(rows)
                messages = ([{"role": "system", "content": "reply with only the answer"}] + messages
                            + other["prompt"] + [{"role": "assistant", "content": other["label"]}])
            f.write(json.dumps({"messages": messages}) + "\n")
    ckpt, sft_out, rl_out = tmp_path / "ckpt", tmp_path / "sft", tmp_path / "grpo"
    proc = run([sys.executable, "train.py", "--hf-checkpoint", str(model), "--prompt-data", str(sft_data),
                "--input-key", "messages", "--loss-type", "sft_loss", "--rollout-batch-size", "16",
                "--num-rollout", "8", "--lr", "3e-3", "--adam-beta2", "0.99", "--micro-batch-size", "16",
                "--rollout-shuffle", "--save", str(ckpt), "--output-dir", str(sft_out)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "0 engine(s)" in proc.stdout
    sft = records(sft_out)
    losses = [r["train/sft_loss"] for r in sft]
    print(f"sft loss: {[round(x, 3) for x in losses]}")
    assert len(losses) == 8 and losses[-1] < 0.5 * losses[0], losses

    hf = ckpt / "rollout_000007" / "hf"
    rl_flags = list(flags)
    rl_flags[rl_flags.index("--num-rollout") + 1] = "3"
    proc = run([sys.executable, "train.py", "--hf-checkpoint", str(hf), "--input-key", "prompt", "--label-key",
                "label", "--apply-chat-template", "--rollout-shuffle", "--seed", "1", "--output-dir", str(rl_out),
                *rl_flags], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    train = records(rl_out)
    rewards = [r["rollout/raw_reward"] for r in train if "rollout/raw_reward" in r]
    print(f"grpo after sft: rewards={[round(x, 3) for x in rewards]}")
    assert len(rewards) == 3 and rewards[0] >= 0.25, rewards


def test_masked_tis_and_frozen_parameters(task, tmp_path):
    """--tis-mode mask drops the tokens whose engine/trainer ratio leaves the band (a bf16 engine
    against the fp32 trainer: some always do), and --freeze-params-name-list keeps the matching
    parameters exactly as loaded while the others train."""
    import glob

    import torch
    from safetensors.torch import load_file

    from tests.helpers.e2e import shape_cmd

    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    r = run(shape_cmd(task, out, "--use-tis", "--tis-mode", "mask", "--tis-clip", "1.0005", "--tis-clip-low", "0.9995",
                      "--sglang-dtype", "bfloat16", "--freeze-params-name-list", r"layers\.1\.", "--save", str(ckpt)))
    assert r.returncode == 0, r.stderr[-3000:]
    recs = [x for x in records(out) if "train/tis_masked" in x]
    assert len(recs) == 3 and all(0 < x["train/tis_masked"] < 1 for x in recs), [x.get("train/tis_masked") for x in recs]
    start = load_file(str(Path(task["model"]) / "model.safetensors"))
    (saved,) = glob.glob(str(ckpt / "*" / "hf" / "model.safetensors"))
    end = load_file(saved)
    frozen = [k for k in start if ".layers.1." in k]
    trained = [k for k in start if ".layers.0." in k and k.endswith("proj.weight")]
    assert frozen and all(torch.equal(start[k], end[k]) for k in frozen)
    assert trained and all(not torch.equal(start[k], end[k]) for k in trained)
