"""Several rewards (`--reward-functions`, `--reward-weights`, `--reward-aggregation`): the weighted
sum, GDPO's per-reward group normalization on a hand-computed example, per-reward metrics, a failing
component, and each refused flag combination. No engines, no Ray."""

import asyncio
import math
from types import SimpleNamespace

import pytest

from slime.rollout.generate import score
from slime.rollout.metrics import rollout_metrics
from slime.rollout.rewards import RewardFunction, RewardMix, build_reward
from slime.rollout.rewards.mix import gdpo_rewards
from slime.rollout.train_data import train_rewards
from slime.types import Sample, SampleStatus
from slime.utils.errors import SlimeConfigError
from tests.helpers.args import make_args

RM_FILE = '''
def length_bonus(args, sample):
    return len(sample.response) / 10

async def shouts(args, sample):
    return 1.0 if sample.response.isupper() else 0.0

def broken(args, sample):
    raise RuntimeError("judge down")
'''


@pytest.fixture
def rm_file(tmp_path):
    path = tmp_path / "rm.py"
    path.write_text(RM_FILE)
    return str(path)


def _args(reward_key=None):
    return SimpleNamespace(rm_timeout=5.0, reward_key=reward_key)


def _score(mix, sample, reward_key=None):
    return asyncio.run(score(mix, _args(reward_key), sample))


# ------------------------------------------------------------------ weighted sum


def test_weighted_sum_from_the_flags(tiny_model_dir, tmp_path, rm_file):
    args = make_args(tiny_model_dir, tmp_path, "--reward-functions", "exact", f"{rm_file}:length_bonus",
                     f"{rm_file}:shouts", "--reward-weights", "2", "0.5", "-1")
    assert args.rm_type is None and args.reward_aggregation == "sum"
    mix = build_reward(args)
    assert isinstance(mix, RewardMix) and mix.names == ["exact", "length_bonus", "shouts"]
    s = asyncio.run(score(mix, args, Sample(response="YES", label="YES")))
    # 2 * 1 + 0.5 * 0.3 - 1 * 1
    assert s.reward == pytest.approx(1.15)
    assert s.reward_dict == pytest.approx({"exact": 1.0, "length_bonus": 0.3, "shouts": 1.0})
    assert s.status != SampleStatus.FAILED
    s = asyncio.run(score(mix, args, Sample(response="no", label="YES")))
    assert s.reward == pytest.approx(0.1) and s.reward_dict == pytest.approx(
        {"exact": 0.0, "length_bonus": 0.2, "shouts": 0.0})


def test_weights_default_to_one(tiny_model_dir, tmp_path, rm_file):
    args = make_args(tiny_model_dir, tmp_path, "--reward-functions", "exact", f"{rm_file}:length_bonus")
    assert args.reward_weights == [1.0, 1.0]
    s = asyncio.run(score(build_reward(args), args, Sample(response="2", label="2")))
    assert s.reward == pytest.approx(1.1)


def test_dict_component_uses_reward_key():
    mix = RewardMix([("judge", RewardFunction(lambda a, s: {"score": 0.8, "format": 1.0})),
                     ("acc", RewardFunction(lambda a, s: 1.0))], [1.0, 2.0])
    s = _score(mix, Sample(), reward_key="score")
    assert s.reward == pytest.approx(2.8)
    assert s.reward_dict == pytest.approx({"judge": 0.8, "judge/format": 1.0, "acc": 1.0})
    with pytest.raises(SlimeConfigError, match=r"--reward-functions: judge returned a dict \(keys \['format', "
                                               r"'score'\]\); pass --reward-key KEY"):
        _score(mix, Sample())
    with pytest.raises(SlimeConfigError, match="--reward-key 'acc': --reward-functions judge returned a dict "
                                               "without it"):
        _score(mix, Sample(), reward_key="acc")


# ------------------------------------------------------------------ failures


@pytest.mark.parametrize("bad,expected_dict", [
    (lambda a, s: (_ for _ in ()).throw(RuntimeError("judge down")), None),  # raises
    (lambda a, s: math.nan, {"acc": 1.0}),
    (lambda a, s: math.inf, {"acc": 1.0}),
    (lambda a, s: "high", {"acc": 1.0}),
])
def test_a_failing_component_fails_the_sample(bad, expected_dict):
    mix = RewardMix([("acc", RewardFunction(lambda a, s: 1.0)), ("judge", RewardFunction(bad))])
    s = _score(mix, Sample(index=3))
    assert s.status == SampleStatus.FAILED and s.reward is None
    assert s.reward_dict == expected_dict  # the components that did give a number stay logged


def test_a_slow_component_times_out():
    async def slow(args, sample):
        await asyncio.sleep(5)
        return 1.0

    mix = RewardMix([("acc", RewardFunction(lambda a, s: 1.0)), ("slow", RewardFunction(slow))])
    s = asyncio.run(score(mix, SimpleNamespace(rm_timeout=0.05, reward_key=None), Sample()))
    assert s.status == SampleStatus.FAILED and s.reward is None


def test_broken_custom_component_from_the_flags(tiny_model_dir, tmp_path, rm_file):
    args = make_args(tiny_model_dir, tmp_path, "--reward-functions", "exact", f"{rm_file}:broken")
    s = asyncio.run(score(build_reward(args), args, Sample(response="2", label="2")))
    assert s.status == SampleStatus.FAILED and s.reward is None


# ------------------------------------------------------------------ metrics


def test_each_reward_is_logged_raw():
    mix = RewardMix([("acc", RewardFunction(lambda a, s: float(s.response == s.label))),
                     ("short", RewardFunction(lambda a, s: -len(s.response) / 4))], [1.0, 0.5])
    samples = [_score(mix, Sample(response=r, label="ab", group_index=0, response_length=len(r),
                                  status=SampleStatus.COMPLETED)) for r in ("ab", "abcd", "x", "abab")]
    args = SimpleNamespace(overlong_buffer_len=0, mask_truncated_samples=False)
    m = rollout_metrics(args, samples, samples, elapsed=1.0, sample_filter=False)
    assert m["rollout/reward/acc"] == pytest.approx(0.25)  # raw, not weighted
    assert m["rollout/reward/short"] == pytest.approx(-(2 + 4 + 1 + 4) / 16)
    # the combined reward: acc + 0.5 * short = [0.75, -0.5, -0.125, -0.5]
    assert m["rollout/raw_reward"] == pytest.approx((0.75 - 0.5 - 0.125 - 0.5) / 4)
    assert m["rollout/reward_failures"] == 0.0


# ------------------------------------------------------------------ GDPO


def _scored(g, acc, fmt, failed=False):
    return Sample(group_index=g, reward_dict={"acc": acc, "fmt": fmt},
                  status=SampleStatus.FAILED if failed else SampleStatus.COMPLETED)


def test_gdpo_hand_computed():
    """Group 0: acc [1, 0, 0] (mean 1/3, unbiased std sqrt(1/3)), fmt constant -> contributes 0:
    A = [ (2/3)/(0.57735+1e-4), -(1/3)/(...), -(1/3)/(...) ] = [1.15450, -0.57725, -0.57725].
    Group 1: acc [1, 1, 0] -> [0.57725, 0.57725, -1.15450]; fmt [0, 1, 1] -> [-1.15450, 0.57725,
    0.57725], weight 0.5: A = [0, 0.86588, -0.86588]; its fourth sample failed (left out, gets 0).
    Group 2: both rewards constant -> [0, 0].
    Batch over the 8 valid: mean 0, unbiased std 0.706984; A / (0.706984 + 1e-4)."""
    samples = [_scored(0, 1, 1), _scored(0, 0, 1), _scored(0, 0, 1),
               _scored(1, 1, 0), _scored(1, 1, 1), _scored(1, 0, 1), _scored(1, 0, 0, failed=True),
               _scored(2, 1, 1), _scored(2, 1, 1)]
    out = gdpo_rewards(samples, ["acc", "fmt"], [1.0, 0.5])
    assert out == pytest.approx([1.632762, -0.816381, -0.816381, 0.0, 1.224572, -1.224572, 0.0, 0.0, 0.0],
                                abs=1e-5)
    assert all(math.isfinite(x) for x in out)


def test_gdpo_keeps_combinations_grpo_collapses(tiny_model_dir, tmp_path):
    """The paper's example: (acc, fmt) = [(0,0), (1,0)] and [(0,0), (1,1)] sum to [0, 1] and [0, 2];
    GRPO's normalization of the sum gives both groups the same advantages, GDPO does not."""
    def batch():
        return [_scored(0, 0, 0), _scored(0, 1, 0), _scored(1, 0, 0), _scored(1, 1, 1)]

    def with_sum(samples):
        for s in samples:
            s.reward = s.reward_dict["acc"] + s.reward_dict["fmt"]
        return samples

    flags = ("--reward-functions", "exact", "f1", "--n-samples-per-prompt", "2", "--rollout-batch-size", "2")
    grpo = train_rewards(make_args(tiny_model_dir, tmp_path, *flags), with_sum(batch()), None)
    assert grpo[:2] == pytest.approx(grpo[2:])  # collapsed: +-0.7071 both
    args = make_args(tiny_model_dir, tmp_path, *flags, "--reward-aggregation", "gdpo")
    for s in (samples := batch()):
        s.reward_dict = {"exact": s.reward_dict["acc"], "f1": s.reward_dict["fmt"]}
    gdpo = train_rewards(args, samples, None)
    # each reward of a 2-sample group with values {0, 1}: +-0.5 / (sqrt(0.5) + 1e-4) = +-0.707007
    # pre-batch: group 0 [-0.707007, 0.707007], group 1 twice that (both rewards differ);
    # batch: mean 0, unbiased std sqrt((2 * 0.707007^2 + 2 * 1.414014^2) / 3) = 1.290812
    assert gdpo == pytest.approx([-0.547680, 0.547680, -1.095360, 1.095360], abs=1e-5)


def test_sum_aggregation_trains_grpo_on_the_weighted_sum(tiny_model_dir, tmp_path):
    args = make_args(tiny_model_dir, tmp_path, "--reward-functions", "exact", "f1", "--reward-weights", "1", "3",
                     "--n-samples-per-prompt", "2")
    samples = [Sample(group_index=0, reward=r, status=SampleStatus.COMPLETED) for r in (0.0, 4.0)]
    assert train_rewards(args, samples, None) == pytest.approx([-0.7071, 0.7071], abs=1e-4)


# ------------------------------------------------------------------ refused flags


@pytest.mark.parametrize("flags,message", [
    (["--reward-weights", "1", "2"], "--reward-weights needs --reward-functions (one weight per reward)"),
    (["--reward-aggregation", "gdpo"], "--reward-aggregation gdpo needs --reward-functions (several rewards)"),
    (["--reward-functions", "math", "exact", "--reward-weights", "1"],
     "--reward-weights has 1 weights for 2 --reward-functions; give one weight per reward"),
    (["--reward-functions", "math", "exact", "--reward-weights", "1", "nan"],
     "--reward-weights must be finite numbers, got [1.0, nan]"),
    (["--reward-functions", "math", "--rm-type", "exact"],
     "--reward-functions replaces --rm-type: list exact in --reward-functions"),
    (["--reward-functions", "math", "--custom-rm-path", "slime.rollout.rewards.exact_reward"],
     "--reward-functions replaces --custom-rm-path: list slime.rollout.rewards.exact_reward in --reward-functions"),
    (["--reward-functions", "math", "--group-rm"], "--group-rm does not work with --reward-functions"),
    (["--reward-functions", "math", "math"], "--reward-functions: two entries are named 'math'"),
    (["--reward-functions", "math", "ifbench"], "--reward-functions ifbench: needs AllenAI's IFBench"),
    (["--reward-functions", "math", "no_such_module.fn"], "--reward-functions no_such_module.fn: cannot import"),
    (["--reward-functions", "math", "remote_rm"], "--reward-functions remote_rm needs --rm-url URL"),
    (["--reward-functions", "math", "--rm-url", "http://x"],
     "--rm-url is only used by remote_rm, which --reward-functions does not list"),
    (["--reward-functions", "math", "exact", "--reward-aggregation", "gdpo", "--n-samples-per-prompt", "2",
      "--advantage-estimator", "reinforce_plus_plus"],
     "--reward-aggregation gdpo replaces the group normalization of grpo, gspo, cispo; not "
     "--advantage-estimator reinforce_plus_plus"),
    (["--reward-functions", "math", "exact", "--reward-aggregation", "gdpo"],
     "--reward-aggregation gdpo normalizes each reward within a prompt's samples; it needs --n-samples-per-prompt > 1"),
    (["--reward-functions", "math", "exact", "--reward-aggregation", "gdpo", "--n-samples-per-prompt", "2",
      "--disable-rewards-normalization"], "--reward-aggregation gdpo normalizes the rewards; drop "
                                          "--disable-rewards-normalization"),
    (["--reward-functions", "math", "exact", "--reward-aggregation", "gdpo", "--n-samples-per-prompt", "2",
      "--disable-grpo-std-normalization"], "--reward-aggregation gdpo divides each reward by its group std; drop "
                                           "--disable-grpo-std-normalization"),
    (["--reward-functions", "math", "exact", "--reward-aggregation", "gdpo", "--n-samples-per-prompt", "2",
      "--custom-reward-post-process-path", "slime.rollout.rewards.exact_reward"],
     "--reward-aggregation gdpo and --custom-reward-post-process-path both make the training rewards"),
    (["--reward-functions", "math", "exact", "--reward-aggregation", "gdpo", "--n-samples-per-prompt", "2",
      "--overlong-buffer-len", "8"], "--reward-aggregation gdpo does not add the --overlong-buffer-len penalty"),
])
def test_refused_combinations(tiny_model_dir, tmp_path, flags, message):
    with pytest.raises(SlimeConfigError) as e:
        make_args(tiny_model_dir, tmp_path, *flags)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_remote_rm_component_is_accepted(tiny_model_dir, tmp_path):
    args = make_args(tiny_model_dir, tmp_path, "--reward-functions", "remote_rm", "exact", "--rm-url", "http://x")
    mix = build_reward(args)
    assert mix.names == ["remote_rm", "exact"] and args.rm_type is None
    assert mix.time_limit(args.rm_timeout) >= args.rm_timeout  # the remote one's retries bound the mix
