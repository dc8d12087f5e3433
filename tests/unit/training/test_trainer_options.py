"""Trainer-level checks of the policy-loss options (TIS, rollout log-probs as old log-probs,
unbiased KL) and of `--loss-type sft_loss`, on the tiny model in-process (world size 1)."""

import math
import sys
from dataclasses import replace

import pytest
import torch

from tests.helpers.training import assert_states_close, grads_after_train, local_actor, make_args, synthetic_batch

COMMON = ["--rollout-batch-size", 3, "--n-samples-per-prompt", 2, "--micro-batch-size", 4, "--clip-grad", 0]


def shifted(batch, delta):
    """The batch with every rollout log-prob moved by `delta` (engine/trainer mismatch exp(-delta))."""
    return replace(batch, rollout_log_probs=[[x + delta for x in lp] for lp in batch.rollout_log_probs])


def scaled(grads, c):
    return {k: c * v for k, v in grads.items()}


@pytest.fixture(scope="module")
def batch(tiny_model_dir):
    return synthetic_batch(tiny_model_dir, 6, seed=5)


@pytest.fixture(scope="module")
def base(tiny_model_dir, batch, tmp_path_factory):
    return grads_after_train(make_args(tiny_model_dir, tmp_path_factory.mktemp("base"), *COMMON), batch)


# ---------------------------------------------------------------- truncated importance sampling


@pytest.mark.parametrize("extra,weight", [
    ([], 1.5),  # token level, upper clip 2 does not bite
    (["--tis-clip", 1.2], 1.2),  # the upper clip bites on every token
    (["--tis-level", "geometric"], 1.5),  # every token has the same ratio: so has every sequence
])
def test_tis_scales_the_policy_gradient_by_the_truncated_weight(tiny_model_dir, tmp_path, batch, base, extra, weight):
    # the engine's log-probs are log(1.5) below the trainer's: every token's ratio is 1.5
    args = make_args(tiny_model_dir, tmp_path, *COMMON, "--use-tis", *extra)
    grads, m = grads_after_train(args, shifted(batch, -math.log(1.5)))
    assert_states_close(grads, scaled(base[0], weight), atol=1e-6, rtol=1e-4)
    assert m["train/tis"] == pytest.approx(1.5, rel=1e-4)
    assert m["train/tis_weight"] == pytest.approx(weight, rel=1e-4)
    assert m["train/tis_clipfrac"] == (1.0 if weight != 1.5 else 0.0)
    assert m["train/pg_clipfrac"] == 0.0  # the PPO ratio is still exactly 1


def test_tis_needs_the_engine_log_probs(tiny_model_dir, tmp_path, batch):
    args = make_args(tiny_model_dir, tmp_path, *COMMON, "--use-tis")
    actor = local_actor(args)
    try:
        broken = replace(batch, rollout_log_probs=[None] * len(batch))
        with pytest.raises(ValueError, match="--use-tis needs the engine's log-probs"):
            actor.train(0, broken)
    finally:
        actor.shutdown()


TIS_HOOK = '''
import torch

CALLS = []

def half_tis(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_mask, response_lengths):
    CALLS.append((tuple(pg_loss.shape), tuple(train_log_probs.shape), tuple(rollout_log_probs.shape),
                  int(loss_mask.sum()), list(response_lengths), args.tis_clip))
    # halve every token's policy loss, reject the tokens of the first sample
    mask = loss_mask.clone()
    mask[: response_lengths[0]] = 0
    return 0.5 * pg_loss, mask, {"my_weight": torch.full_like(pg_loss, 0.5)}
'''


def test_custom_tis_function_contract(tiny_model_dir, tmp_path, monkeypatch, batch):
    name = f"user_tis_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(TIS_HOOK)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        args = make_args(tiny_model_dir, tmp_path, *COMMON, "--micro-batch-size", 6, "--use-tis",
                         "--custom-tis-function-path", f"{name}.half_tis")
        grads, m = grads_after_train(args, batch)
        calls = sys.modules[name].CALLS
        n = sum(batch.response_lengths)
        assert calls == [((n,), (n,), (n,), sum(map(sum, batch.loss_masks)), list(batch.response_lengths), 2.0)]
        assert m["train/my_weight"] == pytest.approx(0.5)
        # the same as the base loss at half the advantage with sample 0's advantage zeroed
        # (rejected tokens keep their place in the token-mean denominator)
        rewards = [0.0] + [0.5 * r for r in batch.rewards[1:]]
        expected, _ = grads_after_train(make_args(tiny_model_dir, tmp_path, *COMMON, "--micro-batch-size", 6),
                                         replace(batch, rewards=rewards))
        assert_states_close(grads, expected, atol=1e-6, rtol=1e-4)
    finally:
        sys.modules.pop(name, None)


# ---------------------------------------------------------------- rollout log-probs as old log-probs


def test_use_rollout_logprobs_is_the_old_policy_without_an_extra_pass(tiny_model_dir, tmp_path, batch, base):
    from slime.training.actor import TrainActor

    passes = []
    orig = TrainActor._no_grad_log_probs
    try:
        TrainActor._no_grad_log_probs = lambda self, b, ref: passes.append(ref) or orig(self, b, ref)
        # two steps per rollout would normally need a no-grad old-log-prob pass
        two = make_args(tiny_model_dir, tmp_path, *COMMON, "--global-batch-size", 3, "--use-rollout-logprobs")
        assert two.num_steps_per_rollout == 2
        _, m = grads_after_train(two, shifted(batch, -0.1))
        assert passes == []
        assert m["train/train_rollout_logprob_abs_diff"] == pytest.approx(0.1, rel=1e-4)
    finally:
        TrainActor._no_grad_log_probs = orig
    # one step: ratio = exp(lp - rollout) = e^0.1 on every token (inside the clip range): e^0.1 x the gradient
    one = make_args(tiny_model_dir, tmp_path, *COMMON, "--use-rollout-logprobs")
    grads, m = grads_after_train(one, shifted(batch, -0.1))
    assert_states_close(grads, scaled(base[0], math.exp(0.1)), atol=1e-6, rtol=1e-4)
    assert m["train/ppo_kl"] == pytest.approx(-0.1, rel=1e-4)


# ---------------------------------------------------------------- unbiased KL


def _second_rollout_grads(args, batch):
    """Grads and metrics of a second `train` on the batch (the first moved the policy off the reference)."""
    actor = local_actor(args)
    captured = {}
    opt = actor.backend.optimizer
    orig_step = opt.step

    def step(*a, **k):
        for name, p in actor.backend.model.named_parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            captured[name] = g.detach().clone()
        return orig_step(*a, **k)

    try:
        actor.train(0, batch)
        opt.step = step
        metrics = actor.train(1, batch)
    finally:
        actor.shutdown()
    return captured, metrics


def test_unbiased_kl_keeps_the_value_and_changes_the_gradient(tiny_model_dir, tmp_path, batch):
    kl_flags = ["--use-kl-loss", "--kl-loss-coef", 0.5, "--kl-loss-type", "k1", "--lr", 0.02]
    plain, mp = _second_rollout_grads(make_args(tiny_model_dir, tmp_path, *COMMON, *kl_flags), batch)
    unbiased, mu = _second_rollout_grads(
        make_args(tiny_model_dir, tmp_path, *COMMON, *kl_flags, "--use-unbiased-kl"), batch)
    # the first rollout had KL 0 (policy = reference), so both runs reach the same policy; on the second
    # the KL is nonzero: the same value (ratio 1 on policy) but the gradient gains coef * kl * dlogp
    assert abs(mp["train/kl_loss"]) > 1e-4
    assert mu["train/kl_loss"] == pytest.approx(mp["train/kl_loss"], rel=1e-5)
    assert mu["train/pg_loss"] == pytest.approx(mp["train/pg_loss"], rel=1e-5)
    assert max(float((unbiased[k] - plain[k]).abs().max()) for k in plain) > 1e-5


# ---------------------------------------------------------------- SFT


def sft_batch(model_dir, n=2):
    from transformers import AutoTokenizer

    from slime.data import sft
    from slime.types import RolloutBatch

    tok = AutoTokenizer.from_pretrained(model_dir)
    convs = []
    for i in range(n):
        messages = [
            {"role": "system", "content": "reply with only the answer"},
            {"role": "user", "content": f"parity of {i} {i + 3}"},
            {"role": "assistant", "content": f"the answer is {(i + 3) % 2}"},
            {"role": "user", "content": "say hello"},
            {"role": "assistant", "content": "hello world"},
        ]
        tokens, mask = sft.tokenize_conversation(tok, messages)
        convs.append(sft.Conversation(messages=messages, tokens=tokens, loss_mask=mask))
    samples = [sft.conversation_sample(c) for c in convs]
    return RolloutBatch(tokens=[s.tokens for s in samples], response_lengths=[s.response_length for s in samples],
                        loss_masks=[s.loss_mask for s in samples], rewards=[0.0] * n, raw_rewards=[0.0] * n,
                        rollout_log_probs=[None] * n, group_indices=list(range(n)))


def test_sft_loss_gives_mask_zero_tokens_exactly_zero_gradient(tiny_model_dir, tmp_path):
    args = make_args(tiny_model_dir, tmp_path, "--loss-type", "sft_loss", "--rollout-batch-size", 2,
                     "--micro-batch-size", 1, "--lr", 1e-2)
    batch = sft_batch(tiny_model_dir)
    assert all(0 in m and 1 in m for m in batch.loss_masks)  # the second user turn is in the "response"
    actor = local_actor(args)
    try:
        be = actor.backend
        assert be.temperature == 1.0  # the data's own distribution, whatever --rollout-temperature says
        grads = []
        orig_step = be.train_step

        def train_step(mbs, loss_fn, **kw):
            def wrapped(k, lp, ent):
                lp.register_hook(lambda g: grads.append(g.detach().clone()))
                return loss_fn(k, lp, ent)
            return orig_step(mbs, wrapped, **kw)

        be.train_step = train_step
        m = actor.train(0, batch)
        total = sum(map(sum, batch.loss_masks))
        assert m["train/loss_tokens"] == total
        for g, mask in zip(grads, batch.loss_masks):
            mask = torch.tensor(mask, dtype=torch.float32)
            assert torch.equal(g[mask == 0], torch.zeros(int((mask == 0).sum())))  # exactly zero
            torch.testing.assert_close(g[mask == 1], torch.full((int(mask.sum()),), -1.0 / total))
        be.train_step = orig_step
        losses = [m["train/sft_loss"]] + [actor.train(i, batch)["train/sft_loss"] for i in range(1, 6)]
        assert losses[-1] < 0.5 * losses[0], losses
    finally:
        actor.shutdown()
