"""Contract tests of the algorithm extension points (docs/algorithms.md): every hook is a user
function loaded by dotted path from a temporary module, called with the documented signature."""

import sys

import pytest
import torch

from slime.rollout.metrics import rollout_metrics
from slime.rollout.train_data import to_train_batch
from slime.types import Sample, SampleStatus
from slime.utils.errors import SlimeConfigError
from slime.utils.hooks import load_function

HOOKS = '''
import torch
from slime.algorithms.losses import ppo_policy_loss
from slime.rollout.filters import DynamicFilterOutput

CALLS = []

def double_ppo(args, inputs):
    assert args.loss_type == "custom_loss"  # the run's args, bound first by the trainer
    CALLS.append(("loss", len(inputs.response_lengths), int(inputs.loss_mask.sum())))
    loss, clipfrac = ppo_policy_loss(inputs)
    return 2 * loss, clipfrac

def doubled_rewards(args, rewards, response_lengths, *, loss_masks, kl, values, group_indices, raw_rewards,
                    **_):
    CALLS.append(("advantage", len(response_lengths)))
    return [torch.full((n,), 2 * float(r)) for r, n in zip(rewards, response_lengths)]

def keep_if_any_correct(args, samples):
    return DynamicFilterOutput(keep=any(s.reward == 1.0 for s in samples), reason="all_wrong")

def keep_bool(args, samples):
    return True

def reward_is_length(args, samples):
    return [float(s.response_length) for s in samples]

not_callable = 3
'''


@pytest.fixture
def hook_module(tmp_path, monkeypatch):
    name = f"user_hooks_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(HOOKS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


# ---------------------------------------------------------------- loading


def test_load_function_by_dotted_path_and_by_file(hook_module, tmp_path):
    fn = load_function(f"{hook_module}.keep_bool", "--dynamic-sampling-filter-path")
    assert fn(None, []) is True
    fn2 = load_function(f"{tmp_path / (hook_module + '.py')}:reward_is_length", "--custom-reward-post-process-path")
    assert fn2(None, [Sample(response_length=3)]) == [3.0]
    # cached: loaded once per path
    assert load_function(f"{hook_module}.keep_bool", "--dynamic-sampling-filter-path") is fn


@pytest.mark.parametrize("path, message", [
    ("no_such_module_xyz.fn", "cannot import module 'no_such_module_xyz'"),
    ("{mod}.missing", "has no attribute 'missing'"),
    ("{mod}.not_callable", "is not callable"),
    ("nodots", "expected a dotted path"),
    ("/no/such/file.py:fn", "file /no/such/file.py does not exist"),
])
def test_load_function_errors_name_the_flag(hook_module, path, message):
    with pytest.raises(SlimeConfigError) as e:
        load_function(path.format(mod=hook_module), "--custom-loss-function-path")
    assert str(e.value).startswith("--custom-loss-function-path ")
    assert message in str(e.value)


def test_bad_hook_path_fails_at_parse_time(tiny_model_dir, tmp_path):
    from tests.helpers.training import make_args

    with pytest.raises(SlimeConfigError, match="--dynamic-sampling-filter-path nope.fn"):
        make_args(tiny_model_dir, tmp_path, "--rollout-batch-size", 2, "--dynamic-sampling-filter-path", "nope.fn")


# ---------------------------------------------------------------- trainer hooks


def test_custom_loss_and_custom_advantage_are_used_by_the_trainer(tiny_model_dir, tmp_path, hook_module):
    from tests.helpers.training import grads_after_train, make_args, synthetic_batch

    batch = synthetic_batch(tiny_model_dir, 6, seed=4)
    common = ["--rollout-batch-size", 3, "--n-samples-per-prompt", 2, "--micro-batch-size", 4, "--clip-grad", 0]
    base, _ = grads_after_train(make_args(tiny_model_dir, tmp_path, *common), batch)
    calls = sys.modules.setdefault(hook_module, __import__(hook_module)).CALLS
    calls.clear()
    loss_args = make_args(tiny_model_dir, tmp_path, *common, "--custom-loss-function-path", f"{hook_module}.double_ppo")
    doubled_loss, _ = grads_after_train(loss_args, batch)
    adv_args = make_args(tiny_model_dir, tmp_path, *common,
                         "--custom-advantage-function-path", f"{hook_module}.doubled_rewards")
    doubled_adv, _ = grads_after_train(adv_args, batch)
    for k in base:
        torch.testing.assert_close(doubled_loss[k], 2 * base[k], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(doubled_adv[k], 2 * base[k], atol=1e-6, rtol=1e-5)
    # micro-batches of 4 and 2 samples; the advantage function sees the rank's 6 samples once
    assert [c for c in calls if c[0] == "loss"] == [("loss", 4, sum(map(sum, batch.loss_masks[:4]))),
                                                    ("loss", 2, sum(map(sum, batch.loss_masks[4:])))]
    assert [c for c in calls if c[0] == "advantage"] == [("advantage", 6)]


# ---------------------------------------------------------------- rollout hooks


ROLLOUT = '''
from slime.types import Sample

class Source:
    """A data source (the get_samples contract) whose prompt p has label p and ends in token 10 + p."""
    def __init__(self, args):
        self.args, self.next = args, 0
    def get_samples(self, num_groups):
        out = [[Sample(prompt=f"p{self.next + i}", label=self.next + i, tokens=[1, 2, 10 + self.next + i])
                for _ in range(self.args.n_samples_per_prompt)] for i in range(num_groups)]
        self.next += num_groups
        return out
    def add_samples(self, groups):
        pass
    def state_dict(self):
        return {"next": self.next}
    def load_state_dict(self, state):
        self.next = state["next"]

def label_rule(args, sample):
    """1 when p is even, else 0 (1 for the first sample of the group when p % 4 == 1)."""
    p = sample.label
    return 1.0 if p % 2 == 0 or (p % 4 == 1 and sample.index % args.n_samples_per_prompt == 0) else 0.0
'''


def _answer(payload):
    """Prompt p (its last token is 10 + p) gets a response of p % 3 + 1 tokens."""
    p = payload["input_ids"][-1] - 10
    return "x", [5] * (p % 3 + 1), "stop", None


def _manager(tiny_model_dir, tmp_path, monkeypatch, *extra):
    """A RolloutManager with scripted engines (see `_answer`), the data source and reward of ROLLOUT."""
    from slime.rollout.manager import RolloutManager
    from tests.helpers.args import make_args
    from tests.helpers.rollout import ScriptedFleet

    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "rollout_hooks.py").write_text(ROLLOUT)
    args = make_args(tiny_model_dir, tmp_path, "--n-samples-per-prompt", 2,
                     "--data-source-path", f"{tmp_path / 'rollout_hooks.py'}:Source",
                     "--custom-rm-path", f"{tmp_path / 'rollout_hooks.py'}:label_rule", *extra)
    m = RolloutManager(args, fleet=ScriptedFleet(_answer))
    m.init()
    return m


def test_dynamic_sampling_over_samples_until_enough_groups_are_kept(tiny_model_dir, tmp_path, monkeypatch,
                                                                   hook_module):
    m = _manager(tiny_model_dir, tmp_path, monkeypatch, "--rollout-batch-size", 4, "--over-sampling-batch-size", 6,
                 "--global-batch-size", 8, "--dynamic-sampling-filter-path", f"{hook_module}.keep_if_any_correct")
    rollout = m.sampler.sample(0)
    samples, generated, metrics = rollout.samples, rollout.generated, rollout.metrics
    # prompts 0..5 keep 0, 1, 2, 4, 5 (3 is all wrong) -> 5 >= 4 in one round; the first 4 kept are 0, 1, 2, 4
    assert [s.label for s in samples] == [0, 0, 1, 1, 2, 2, 4, 4]
    assert len(generated) == 12
    assert metrics["rollout/dynamic_filter/drop_all_wrong"] == 1.0
    assert metrics["rollout/dynamic_filter/rounds"] == 1.0
    assert metrics["rollout/dynamic_filter/fallback_groups"] == 0.0
    assert len({s.index for s in generated}) == 12  # unique sample indices (and sampling seeds)


def test_dynamic_sampling_launches_more_rounds_and_falls_back(tiny_model_dir, tmp_path, monkeypatch):
    flt = "slime.rollout.filters.check_reward_nonzero_std"
    m = _manager(tiny_model_dir, tmp_path, monkeypatch, "--rollout-batch-size", 2, "--global-batch-size", 4,
                 "--dynamic-sampling-filter-path", flt)
    rollout = m.sampler.sample(0)
    samples, generated, metrics = rollout.samples, rollout.generated, rollout.metrics
    # only p % 4 == 1 groups have nonzero std: rounds of 2 prompts -> p=1 in round 1, p=5 in round 3
    assert [s.label for s in samples] == [1, 1, 5, 5]
    assert metrics["rollout/dynamic_filter/rounds"] == 3.0
    assert metrics["rollout/dynamic_filter/drop_zero_std"] == 4.0
    assert len({s.group_index for s in generated}) == 6
    m2 = _manager(tiny_model_dir, tmp_path / "b", monkeypatch, "--rollout-batch-size", 2, "--global-batch-size", 4,
                  "--dynamic-sampling-filter-path", flt, "--dynamic-sampling-max-rounds", 1)
    rollout = m2.sampler.sample(0)
    samples, metrics = rollout.samples, rollout.metrics
    assert [s.label for s in samples] == [0, 0, 1, 1]  # one kept (p=1), one rejected group fills the batch
    assert metrics["rollout/dynamic_filter/fallback_groups"] == 1.0


def test_reward_post_process_hook_and_overlong_penalty(tiny_model_dir, tmp_path, monkeypatch, hook_module):
    m = _manager(tiny_model_dir, tmp_path, monkeypatch, "--rollout-batch-size", 3, "--global-batch-size", 6,
                 "--custom-reward-post-process-path", f"{hook_module}.reward_is_length")
    samples = m.sampler.sample(0).samples
    batch = to_train_batch(m.args, samples, m.ext.reward_post_process)
    assert batch.rewards == [1.0, 1.0, 2.0, 2.0, 3.0, 3.0]
    assert batch.raw_rewards == [1.0, 1.0, 1.0, 0.0, 1.0, 1.0]

    # default path, reinforce_plus_plus (raw rewards) + overlong penalty: max 3, buffer 2 -> lengths 1, 2, 3
    # get 0, -0.5, -1 (factor 1)
    m = _manager(tiny_model_dir, tmp_path / "b", monkeypatch, "--rollout-batch-size", 3, "--global-batch-size", 6,
                 "--advantage-estimator", "reinforce_plus_plus", "--rollout-max-response-len", 3,
                 "--overlong-buffer-len", 2)
    batch = to_train_batch(m.args, m.sampler.sample(0).samples, m.ext.reward_post_process)
    assert batch.rewards == [1.0, 1.0, 0.5, -0.5, 0.0, 0.0]


# ---------------------------------------------------------------- algorithm flags


def test_algorithm_flags_derived_values_and_errors(tiny_model_dir, tmp_path):
    from tests.helpers.training import make_args

    base = ["--rollout-batch-size", 2, "--n-samples-per-prompt", 2]
    args = make_args(tiny_model_dir, tmp_path, *base, "--advantage-estimator", "ppo", "--lr", 2e-5)
    assert args.use_critic and args.critic_lr == 2e-5 and args.policy_loss_type == "ppo"
    assert args.over_sampling_batch_size == 2 and args.rewards_normalization and args.grpo_std_normalization
    args = make_args(tiny_model_dir, tmp_path, *base, "--advantage-estimator", "gspo",
                     "--disable-grpo-std-normalization")
    assert not args.use_critic and args.policy_loss_type == "gspo" and not args.grpo_std_normalization
    for extra, message in [
        (["--kl-coef", 0.1], "--kl-coef (KL in the reward) has no effect with --advantage-estimator grpo"),
        (["--over-sampling-batch-size", 1], "--over-sampling-batch-size 1 must be >= --rollout-batch-size 2"),
        (["--eps-clip-c", 1.0], "--eps-clip-c must be > 1"),
        (["--gamma", 1.5], "--gamma must be in [0, 1]"),
        (["--overlong-buffer-len", 1024], "--overlong-buffer-len must be in [0, --rollout-max-response-len 1024)"),
    ]:
        with pytest.raises(SlimeConfigError) as e:
            make_args(tiny_model_dir, tmp_path, *base, *extra)
        assert message in str(e.value)


def test_overlong_filtering_masks_truncated_samples_and_counts_them(tiny_model_dir, tmp_path, monkeypatch):
    m = _manager(tiny_model_dir, tmp_path, monkeypatch, "--rollout-batch-size", 3, "--global-batch-size", 6,
                 "--mask-truncated-samples")
    samples = m.sampler.sample(0).samples
    samples[1].status = samples[3].status = SampleStatus.TRUNCATED
    batch = to_train_batch(m.args, samples, None)
    assert [sum(x) for x in batch.loss_masks] == [1, 0, 2, 0, 3, 3]
    # still rewarded (and normalized with its group); only its loss is dropped
    assert batch.rewards[3] == pytest.approx(-0.7071, abs=1e-4)
    m2 = _manager(tiny_model_dir, tmp_path / "b", monkeypatch, "--rollout-batch-size", 3, "--global-batch-size", 6)
    assert [sum(x) for x in to_train_batch(m2.args, samples, None).loss_masks] == [1, 1, 2, 2, 3, 3]
    assert rollout_metrics(m.args, samples, samples, 1.0, False)["rollout/overlong_filtered"] == 2.0


def test_dict_rewards_need_reward_key_and_log_every_entry(tiny_model_dir, tmp_path):
    import asyncio

    from slime.rollout.generate import score
    from slime.rollout.rewards import RewardFunction
    from tests.helpers.args import make_args

    rm = RewardFunction(lambda args, s: {"acc": float(s.response == s.label), "format": 0.5})

    def args(key=None):
        return make_args(tiny_model_dir, tmp_path, "--rm-timeout", 5, *(["--reward-key", key] if key else []))

    def sample(response, label):
        return Sample(response=response, label=label, index=0, status=SampleStatus.COMPLETED)

    s = asyncio.run(score(rm, args("acc"), sample("1", "1")))
    assert s.reward == 1.0 and s.reward_dict == {"acc": 1.0, "format": 0.5} and s.status == SampleStatus.COMPLETED
    with pytest.raises(SlimeConfigError, match=r"returned a dict \(keys \['acc', 'format'\]\); pass --reward-key"):
        asyncio.run(score(rm, args(), sample("1", "1")))
    with pytest.raises(SlimeConfigError, match="--reward-key 'score': the reward function returned a dict without it"):
        asyncio.run(score(rm, args("score"), sample("1", "1")))
    plain = asyncio.run(score(RewardFunction(lambda a, s: 1), args("acc"), sample("1", "1")))  # a float ignores the key
    assert plain.reward == 1.0 and plain.reward_dict is None
    samples = [asyncio.run(score(rm, args("acc"), sample(r, "1"))) for r in ("1", "2", "1", "0")]
    for i, x in enumerate(samples):
        x.group_index, x.response_length = i // 2, 1
    metrics = rollout_metrics(args(), samples, samples, 1.0, False)
    assert metrics["rollout/raw_reward"] == 0.5
    assert metrics["rollout/reward/acc"] == 0.5 and metrics["rollout/reward/format"] == 0.5


def test_loss_type_tis_and_kl_flags(tiny_model_dir, tmp_path, hook_module):
    from tests.helpers.training import make_args

    base = ["--rollout-batch-size", 2, "--n-samples-per-prompt", 2]
    assert make_args(tiny_model_dir, tmp_path, *base).loss_type == "policy_loss"
    custom = make_args(tiny_model_dir, tmp_path, *base, "--custom-loss-function-path", f"{hook_module}.double_ppo")
    assert custom.loss_type == "custom_loss"
    args = make_args(tiny_model_dir, tmp_path, *base, "--use-tis")
    assert (args.tis_clip, args.tis_clip_low, args.tis_level) == (2.0, 0.0, "token")
    assert make_args(tiny_model_dir, tmp_path, *base, "--advantage-estimator", "rloo").policy_loss_type == "ppo"
    for extra, message in [
        (["--loss-type", "custom_loss"], "--loss-type custom_loss needs --custom-loss-function-path"),
        (["--loss-type", "policy_loss", "--custom-loss-function-path", f"{hook_module}.double_ppo"],
         "--custom-loss-function-path is only used with --loss-type custom_loss, not policy_loss"),
        (["--use-unbiased-kl"], "--use-unbiased-kl has no effect without --use-kl-loss"),
        (["--use-tis", "--tis-clip-low", 3], "--tis-clip-low must be in [0, --tis-clip 2.0), got 3.0"),
        (["--custom-tis-function-path", f"{hook_module}.double_ppo"],
         "--custom-tis-function-path has no effect without --use-tis"),
        (["--use-tis", "--custom-tis-function-path", f"{hook_module}.nope"],
         "--custom-tis-function-path"),
        (["--advantage-estimator", "rloo", "--n-samples-per-prompt", 1, "--global-batch-size", 2],
         "--advantage-estimator rloo needs --n-samples-per-prompt >= 2"),
        (["--advantage-estimator", "rloo", "--kl-coef", 0.1], "--kl-coef (KL in the reward) has no effect"),
    ]:
        with pytest.raises(SlimeConfigError) as e:
            make_args(tiny_model_dir, tmp_path, *base, *extra)
        assert message in str(e.value)
