"""End-to-end: the reward rises on the tiny parity task for every advantage estimator (and DAPO).

Each case runs train.py with the quickstart's tiny shape (8 prompts x 8 samples, two optimizer
steps per rollout, lr 3e-3) for 8 rollouts, about 70-90 s each on 2 CPU cores.
"""

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from test_e2e import run  # noqa: E402

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
    train = [json.loads(line) for line in open(out / "metrics.jsonl")]
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
    if case == "dapo":
        assert all(r["rollout/zero_std_group_ratio"] == 0.0 or r["rollout/dynamic_filter/fallback_groups"] > 0
                   for r in train)
        assert sum(r.get("rollout/dynamic_filter/drop_zero_std", 0) for r in train) > 0
