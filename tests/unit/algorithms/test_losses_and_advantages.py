"""Exact values of the pure algorithm functions on small hand-computed tensors."""

import math

import pytest
import torch

from slime.algorithms.advantages import ADVANTAGE_ESTIMATORS, group_normalize, grpo
from slime.algorithms.losses import (
    POLICY_LOSSES,
    LossInputs,
    compute_entropy,
    compute_log_probs,
    compute_log_probs_and_entropy,
    kl_penalty,
    masked_mean,
    masked_sum,
    ppo_policy_loss,
    token_mean_over,
)

EPS = 1e-6


def _inputs(log_probs, old_log_probs, advantages, eps_clip, eps_clip_high=None, **rest):
    """The one record every policy loss takes, from the arguments in their usual order."""
    return LossInputs(log_probs=log_probs, old_log_probs=old_log_probs, advantages=advantages, eps_clip=eps_clip,
                      eps_clip_high=eps_clip_high, **rest)


# ---------------------------------------------------------------- advantages


def test_grpo_broadcasts_reward_over_response_tokens():
    adv = grpo(torch.tensor([0.5, -1.0, 2.0]), [3, 1, 0])
    assert [a.tolist() for a in adv] == [[0.5, 0.5, 0.5], [-1.0], []]
    assert ADVANTAGE_ESTIMATORS["grpo"] is grpo
    with pytest.raises(ValueError):
        grpo(torch.tensor([1.0]), [1, 2])


def test_group_normalize_groups_by_id_not_position():
    # group 0: {0, 1, 2} -> mean 1, unbiased std 1; group 1: {4, 4, 4} -> std 0;
    # group 2: {1, 3, 5} -> mean 3, unbiased std 2. Positions are shuffled.
    ids = [2, 0, 1, 0, 2, 1, 0, 1, 2]
    rewards = torch.tensor([1.0, 0.0, 4.0, 2.0, 3.0, 4.0, 1.0, 4.0, 5.0])
    out = group_normalize(rewards, ids)
    expected = [
        -2 / (2 + EPS), -1 / (1 + EPS), 0.0, 1 / (1 + EPS), 0.0, 0.0, 0.0, 0.0, 2 / (2 + EPS)
    ]
    torch.testing.assert_close(out, torch.tensor(expected), rtol=0, atol=1e-7)
    # same with a tensor of ids and the std matching torch.std (unbiased) per group
    out_t = group_normalize(rewards, torch.tensor(ids))
    torch.testing.assert_close(out_t, out, rtol=0, atol=0)
    g2 = rewards[torch.tensor(ids) == 2]
    assert math.isclose(float(g2.std()), 2.0)

    centered = group_normalize(rewards, ids, std_normalize=False)
    assert centered.tolist() == [-2.0, -1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 2.0]


def test_group_normalize_single_sample_group_is_zero_not_nan():
    out = group_normalize(torch.tensor([3.0, 1.0, 2.0]), [7, 9, 9])
    assert out[0].item() == 0.0
    torch.testing.assert_close(out[1:], torch.tensor([-0.5 / (math.sqrt(0.5) + EPS), 0.5 / (math.sqrt(0.5) + EPS)]))
    with pytest.raises(ValueError):
        group_normalize(torch.tensor([1.0, 2.0]), [0])


# ---------------------------------------------------------------- KL


def test_kl_penalty_kinds():
    lp = torch.tensor([0.0, -1.0])
    ref = torch.tensor([-0.5, -0.5])  # log_ratio = [0.5, -0.5]
    assert kl_penalty(lp, ref, "k1").tolist() == [0.5, -0.5]
    assert kl_penalty(lp, ref, "k2").tolist() == [0.125, 0.125]
    k3 = [math.exp(-0.5) + 0.5 - 1.0, math.exp(0.5) - 0.5 - 1.0]  # d = ref - lp; e^d - d - 1
    torch.testing.assert_close(kl_penalty(lp, ref, "k3"), torch.tensor(k3), rtol=0, atol=1e-7)
    torch.testing.assert_close(kl_penalty(lp, ref, "low_var_kl"), torch.tensor(k3), rtol=0, atol=1e-7)
    assert kl_penalty(lp, lp, "k3").tolist() == [0.0, 0.0]


def test_kl_k3_is_clamped():
    lp = torch.tensor([0.0, 0.0])
    ref = torch.tensor([30.0, -30.0])
    # d = 30 -> clamp(d)=20 -> e^20 - 21 -> clamp 10; d = -30 -> -20 -> e^-20 + 19 -> clamp 10
    assert kl_penalty(lp, ref, "k3").tolist() == [10.0, 10.0]
    # d = -9 -> e^-9 + 8 (inside the clamp); d = -12 -> e^-12 + 11 -> clamp 10
    assert kl_penalty(lp, torch.tensor([-9.0, -12.0]), "low_var_kl").tolist() == pytest.approx(
        [math.exp(-9.0) + 8.0, 10.0], abs=1e-6
    )
    with pytest.raises(ValueError):
        kl_penalty(lp, ref, "k4")


# ---------------------------------------------------------------- policy loss


def test_policy_loss_asymmetric_clip_and_clipfrac():
    ratio = torch.tensor([1.5, 0.5, 0.5, 1.5, 1.25, 0.85, 1.25])
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 1.0, -1.0, 2.0])
    old = torch.tensor([-1.0, -2.0, -0.5, -3.0, -1.0, -1.0, -2.0])
    lp = old + ratio.log()
    loss, clipfrac = ppo_policy_loss(_inputs(lp, old, adv, eps_clip=0.2, eps_clip_high=0.28))
    # 1.5,A=1 -> max(-1.5, -1.28) clipped; 0.5,A=1 -> max(-0.5, -0.8) not; 0.5,A=-1 -> max(0.5, 0.8) clipped
    # 1.5,A=-1 -> max(1.5, 1.28) not; 1.25 within the high clip 1.28 -> not; 0.85 within the low clip -> not
    expected = torch.tensor([-1.28, -0.5, 0.8, 1.5, -1.25, 0.85, -2.5])
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-6)
    assert clipfrac.tolist() == [1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    # symmetric 0.2 clips the 1.25 ratio with positive advantage
    loss_sym, clip_sym = ppo_policy_loss(_inputs(lp, old, adv, eps_clip=0.2))
    torch.testing.assert_close(loss_sym[4], torch.tensor(-1.2))
    assert clip_sym.tolist() == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    assert POLICY_LOSSES["ppo"](_inputs(lp, old, adv, 0.2, 0.28))[1].tolist() == clipfrac.tolist()


def test_policy_loss_ratio_one_gradient_is_minus_advantage():
    lp = torch.tensor([-1.0, -2.0, -0.3], requires_grad=True)
    adv = torch.tensor([0.5, -2.0, 1.0])
    loss, clipfrac = ppo_policy_loss(_inputs(lp, lp.detach(), adv, 0.2, 0.2))
    loss.sum().backward()
    assert clipfrac.tolist() == [0.0, 0.0, 0.0]
    assert loss.tolist() == (-adv).tolist()
    assert lp.grad.tolist() == (-adv).tolist()


# ---------------------------------------------------------------- aggregation


def test_masked_aggregation():
    v = torch.tensor([1.0, 2.0, 3.0, 4.0])
    m = torch.tensor([1, 0, 1, 1])
    assert masked_sum(v, m).item() == 8.0
    assert masked_mean(v, m).item() == pytest.approx(8.0 / 3.0)
    assert masked_mean(v, torch.zeros(4)).item() == 0.0
    assert token_mean_over(v, m, 16).item() == 0.5
    # token-mean over a split batch equals the token-mean of the whole
    parts = token_mean_over(v[:1], m[:1], 3) + token_mean_over(v[1:], m[1:], 3)
    assert parts.item() == pytest.approx(masked_mean(v, m).item())


# ---------------------------------------------------------------- log-probs and entropy


def _reference(logits, tokens, temperature):
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_log_probs_equal_unchunked_with_grads(temperature):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g)
    tokens = torch.randint(0, 11, (3, 5), generator=g)
    ref_lp, ref_ent = _reference(logits, tokens, temperature)
    weights = torch.randn(3, 5, generator=g)

    x = logits.clone().requires_grad_(True)
    (_reference(x, tokens, temperature)[0] * weights).sum().backward()
    ref_grad = x.grad.clone()

    for chunk in (1, 4, 1000):
        x = logits.clone().requires_grad_(True)
        lp = compute_log_probs(x, tokens, temperature, chunk_size=chunk)
        torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-6)
        (lp * weights).sum().backward()
        torch.testing.assert_close(x.grad, ref_grad, rtol=0, atol=1e-6)

        with torch.no_grad():
            torch.testing.assert_close(compute_log_probs(logits, tokens, temperature, chunk), ref_lp, rtol=0, atol=1e-6)
        torch.testing.assert_close(compute_entropy(logits, temperature, chunk), ref_ent, rtol=0, atol=1e-6)
        lp2, ent2 = compute_log_probs_and_entropy(logits, tokens, temperature, chunk)
        torch.testing.assert_close(lp2, ref_lp, rtol=0, atol=1e-6)
        torch.testing.assert_close(ent2, ref_ent, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_log_prob_backward_is_bitwise_the_checkpointed_one(temperature, dtype):
    """compute_log_probs' hand-written backward (_TokenLogProbs) gives exactly the gradients of
    autograd through the checkpointed chunk function it replaced, down to a layer below."""
    from slime.algorithms.losses import _chunk_log_probs, _run_chunked

    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(37, 16, generator=g)
    head = torch.randn(50, 16, generator=g)
    tokens = torch.randint(0, 50, (37,), generator=g)
    weights = torch.randn(37, generator=g)
    for chunk in (1, 8, 1024):
        grads, values = [], []
        for new in (True, False):
            w = head.clone().to(dtype).requires_grad_(True)
            logits = hidden.to(dtype) @ w.t()
            if new:
                lp = compute_log_probs(logits, tokens, temperature, chunk_size=chunk)
            else:
                lp = torch.cat(_run_chunked(_chunk_log_probs, logits, tokens, temperature, chunk))
            (lp * weights).sum().backward()
            grads.append(w.grad)
            values.append(lp.detach())
        assert torch.equal(values[0], values[1])
        assert torch.equal(grads[0], grads[1])


def test_temperature_zero_means_no_scaling_and_shape_checks():
    logits = torch.tensor([[0.0, math.log(3.0)]])
    assert compute_log_probs(logits, torch.tensor([1]), 0.0).tolist() == pytest.approx([math.log(0.75)])
    assert compute_log_probs(torch.zeros(0, 7), torch.zeros(0, dtype=torch.long)).shape == (0,)
    with pytest.raises(ValueError):
        compute_log_probs(torch.zeros(2, 7), torch.zeros(3, dtype=torch.long))


def test_entropy_values_and_gradient():
    v = 8
    uniform = torch.zeros(2, v)
    torch.testing.assert_close(compute_entropy(uniform), torch.full((2,), math.log(v)))
    # two-way 3:1 distribution: H = -(0.75 ln 0.75 + 0.25 ln 0.25)
    logits = torch.tensor([[math.log(3.0), 0.0]])
    h = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    assert compute_entropy(logits).item() == pytest.approx(h, abs=1e-6)
    # gradient through the chunked (checkpointed) path equals the direct one
    g = torch.Generator().manual_seed(1)
    base = torch.randn(4, 6, generator=g)
    x1 = base.clone().requires_grad_(True)
    compute_entropy(x1, 0.5, chunk_size=1).sum().backward()
    x2 = base.clone().requires_grad_(True)
    _reference(x2, torch.zeros(4, dtype=torch.long), 0.5)[1].sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=0, atol=1e-6)


# ---------------------------------------------------------------- more estimators

from slime.algorithms.advantages import (  # noqa: E402
    REWARD_NORMALIZATION,
    gae,
    overlong_penalty,
    post_process_rewards,
    ppo,
    reinforce_plus_plus,
    reinforce_plus_plus_baseline,
    whiten,
    whiten_stats,
)
from slime.algorithms.losses import (  # noqa: E402
    aggregation_weights,
    cispo_policy_loss,
    gspo_policy_loss,
    sequence_mean,
    value_loss,
)


def test_every_estimator_flag_has_an_implementation():
    from slime.algorithms.losses import LOSS_AGG_MODES as IMPLEMENTED
    from slime.arguments import ADVANTAGE_ESTIMATORS as CHOICES
    from slime.arguments import LOSS_AGG_MODES, POLICY_LOSS_OF_ESTIMATOR

    assert set(CHOICES) == set(ADVANTAGE_ESTIMATORS) == set(REWARD_NORMALIZATION)
    assert set(POLICY_LOSS_OF_ESTIMATOR.values()) <= set(POLICY_LOSSES)
    assert LOSS_AGG_MODES == IMPLEMENTED


def test_reinforce_plus_plus_discounted_kl_shaped_returns():
    kl = [torch.tensor([0.1, 0.2, 0.3]), torch.tensor([0.5, 0.5])]
    masks = [torch.tensor([1.0, 1.0, 0.0]), torch.tensor([1.0, 1.0])]
    out = reinforce_plus_plus(torch.tensor([1.0, -1.0]), [3, 2], loss_masks=masks, kl=kl, kl_coef=0.5, gamma=0.9)
    # sample 0: token rewards [-0.05, -0.1 + 1 (last mask token), 0]; G = [r0 + .9 r1, r1, 0]
    r0 = [-0.05, 0.9, 0.0]
    g0 = [r0[0] + 0.9 * (r0[1] + 0.9 * r0[2]), r0[1] + 0.9 * r0[2], r0[2]]
    r1 = [-0.25, -0.25 - 1.0]
    g1 = [r1[0] + 0.9 * r1[1], r1[1]]
    torch.testing.assert_close(out[0], torch.tensor(g0))
    torch.testing.assert_close(out[1], torch.tensor(g1))
    # no KL, gamma 1: every token gets the reward
    assert reinforce_plus_plus(torch.tensor([2.0]), [3])[0].tolist() == [2.0, 2.0, 2.0]


def test_reinforce_plus_plus_baseline_and_ppo_gae():
    kl = [torch.tensor([0.2, 0.4])]
    out = reinforce_plus_plus_baseline(torch.tensor([0.5]), [2], kl=kl, kl_coef=0.5)
    torch.testing.assert_close(out[0], torch.tensor([0.4, 0.3]))

    # GAE by hand: r = [0, 0, 1], V = [0.5, 0.2, 0.4], gamma 0.9, lambda 0.8
    r, v = torch.tensor([0.0, 0.0, 1.0]), torch.tensor([0.5, 0.2, 0.4])
    d2 = 1.0 - 0.4
    d1 = 0.0 + 0.9 * 0.4 - 0.2
    d0 = 0.0 + 0.9 * 0.2 - 0.5
    a2 = d2
    a1 = d1 + 0.72 * a2
    a0 = d0 + 0.72 * a1
    adv, ret = gae([r], [v], 0.9, 0.8)
    torch.testing.assert_close(adv[0], torch.tensor([a0, a1, a2]))
    torch.testing.assert_close(ret[0], torch.tensor([a0, a1, a2]) + v)
    # gamma = lambda = 1: A_t = R - V_t (Monte Carlo)
    torch.testing.assert_close(gae([r], [v], 1.0, 1.0)[0][0], 1.0 - v)
    # the ppo estimator puts the scalar reward on the last token and the KL penalty on every token
    out = ppo(torch.tensor([1.0]), [3], values=[v], kl=[torch.tensor([0.1, 0.1, 0.1])], kl_coef=1.0,
              gamma=0.9, lambd=0.8)
    torch.testing.assert_close(out[0], gae([torch.tensor([-0.1, -0.1, 0.9])], [v], 0.9, 0.8)[0][0])
    with pytest.raises(ValueError, match="critic values"):
        ppo(torch.tensor([1.0]), [3])


def test_post_process_rewards_per_estimator():
    rewards, ids = torch.tensor([1.0, 0.0, 1.0, 1.0]), [0, 0, 1, 1]
    std = group_normalize(rewards, ids)
    for est in ("grpo", "gspo", "cispo"):
        torch.testing.assert_close(post_process_rewards(rewards, ids, est), std)
        assert post_process_rewards(rewards, ids, est, std_normalization=False).tolist() == [0.5, -0.5, 0.0, 0.0]
    assert post_process_rewards(rewards, ids, "reinforce_plus_plus_baseline").tolist() == [0.5, -0.5, 0.0, 0.0]
    for est in ("ppo", "reinforce_plus_plus"):
        assert post_process_rewards(rewards, ids, est).tolist() == rewards.tolist()
    assert post_process_rewards(rewards, ids, "grpo", rewards_normalization=False).tolist() == rewards.tolist()


def test_overlong_penalty_ramp():
    # max 10, buffer 4: no penalty up to 6, then -(L - 6) / 4 * factor
    out = overlong_penalty([3, 6, 7, 10], 10, 4, 2.0)
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, -0.5, -2.0]))
    assert overlong_penalty([10], 10, 0, 1.0).tolist() == [0.0]


def test_whitening_from_summed_stats_equals_whole_batch():
    g = torch.Generator().manual_seed(0)
    adv = [torch.randn(n, generator=g) for n in (3, 1, 4, 2)]
    masks = [torch.tensor(m, dtype=torch.float32) for m in ([1, 0, 1], [1], [1, 1, 1, 0], [0, 0])]
    whole = whiten(adv, whiten_stats(adv, masks))
    stats = whiten_stats(adv[:1], masks[:1]) + whiten_stats(adv[1:], masks[1:])  # "two ranks"
    parts = whiten(adv[:1], stats) + whiten(adv[1:], stats)
    for a, b in zip(whole, parts):
        torch.testing.assert_close(a, b)
    flat = torch.cat(whole)[torch.cat(masks).bool()]
    assert abs(float(flat.mean())) < 1e-6 and float(flat.std()) == pytest.approx(1.0, abs=1e-4)


# ---------------------------------------------------------------- more policy losses


def test_dual_clip_caps_negative_advantage_loss():
    old = torch.zeros(3)
    lp = torch.log(torch.tensor([5.0, 5.0, 0.5]))
    adv = torch.tensor([-1.0, 1.0, -1.0])
    loss, _ = ppo_policy_loss(_inputs(lp, old, adv, 0.2, 0.2, eps_clip_c=3.0))
    # ratio 5, A<0: max(5, 1.2) = 5, capped at 3; A>0 untouched (-1.2); ratio .5, A<0 -> 0.8 (< 3)
    torch.testing.assert_close(loss, torch.tensor([3.0, -1.2, 0.8]))
    with pytest.raises(ValueError):
        ppo_policy_loss(_inputs(lp, old, adv, 0.2, 0.2, eps_clip_c=0.5))


def test_gspo_uses_the_sequence_ratio_and_reduces_to_ppo_for_single_tokens():
    old = torch.tensor([-1.0, -1.0, -2.0, -0.5])
    lp = old + torch.tensor([0.2, -0.1, 0.5, 0.0])
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    loss, clipfrac = gspo_policy_loss(_inputs(lp, old, adv, 0.2, 0.28, response_lengths=[2, 2], loss_mask=mask))
    s0, s1 = math.exp(0.05), math.exp(0.5)  # masked means: (0.2 - 0.1) / 2; 0.5 / 1
    torch.testing.assert_close(loss, torch.tensor([-s0, -s0, s1, s1]))
    assert clipfrac.tolist() == [0.0, 0.0, 0.0, 0.0]  # A<0 with a large ratio: the unclipped term is larger
    # one-token sequences: exactly PPO
    pl, pc = ppo_policy_loss(_inputs(lp, old, adv, 0.2, 0.28))
    gl, gc = gspo_policy_loss(_inputs(lp, old, adv, 0.2, 0.28, response_lengths=[1, 1, 1, 1],
                                      loss_mask=torch.ones(4)))
    torch.testing.assert_close(gl, pl)
    assert gc.tolist() == pc.tolist()


def test_gspo_is_per_sequence_so_split_invariant_and_on_policy_gradient_is_ppos():
    g = torch.Generator().manual_seed(3)
    lengths = [3, 1, 4]
    old = torch.randn(8, generator=g)
    adv = torch.tensor([0.7] * 3 + [-1.2] + [0.3] * 4)
    mask = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0])
    lp = (old + 0.1 * torch.randn(8, generator=g)).requires_grad_(True)
    whole, _ = gspo_policy_loss(_inputs(lp, old, adv, 0.2, response_lengths=lengths, loss_mask=mask))
    parts = torch.cat([gspo_policy_loss(_inputs(lp[a:b], old[a:b], adv[a:b], 0.2, response_lengths=[b - a],
                                                loss_mask=mask[a:b]))[0] for a, b in ((0, 3), (3, 4), (4, 8))])
    torch.testing.assert_close(whole, parts)
    # at ratio 1 the token-summed GSPO gradient equals the PPO (and CISPO) gradient: -A on mask tokens
    grads = []
    for fn in (gspo_policy_loss, ppo_policy_loss, cispo_policy_loss):
        x = old.clone().requires_grad_(True)
        loss, _ = fn(_inputs(x, old, adv, 0.2, 0.28, response_lengths=lengths, loss_mask=mask))
        (loss * mask).sum().backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[0], -adv * mask)
    torch.testing.assert_close(grads[1], -adv * mask)
    torch.testing.assert_close(grads[2], -adv * mask)
    torch.testing.assert_close(sequence_mean(torch.arange(8.0), lengths, mask),
                               torch.tensor([1.0] * 3 + [3.0] + [16 / 3] * 4))  # (4 + 5 + 7) / 3


def test_cispo_keeps_gradient_on_clipped_tokens():
    old = torch.zeros(3)
    ratio = torch.tensor([1.5, 0.5, 1.1])
    adv = torch.tensor([1.0, 1.0, -2.0])
    lp = ratio.log().requires_grad_(True)
    loss, clipfrac = cispo_policy_loss(_inputs(lp, old, adv, 0.2, 0.28))
    torch.testing.assert_close(loss, -torch.tensor([1.28, 0.8, 1.1]) * adv * ratio.log())
    assert clipfrac.tolist() == [1.0, 1.0, 0.0]
    loss.sum().backward()
    torch.testing.assert_close(lp.grad, -torch.tensor([1.28, 0.8, 1.1]) * adv)  # PPO's would be [0, -1 * .5, ...]
    x = ratio.log().requires_grad_(True)
    ppo_policy_loss(_inputs(x, old, adv, 0.2, 0.28))[0].sum().backward()
    assert x.grad[0].item() == 0.0  # the PPO clip kills the gradient where CISPO keeps it


def test_value_loss_clipped():
    values, old, ret = torch.tensor([1.0, 0.0, 0.5]), torch.tensor([0.5, 0.5, 0.5]), torch.tensor([2.0, 0.0, 0.0])
    loss, clipfrac = value_loss(values, old, ret, 0.2)
    # clipped values [0.7, 0.3, 0.5]: max((v-R)^2, (vc-R)^2) = [max(1, 1.69), max(0, .09), .25]
    torch.testing.assert_close(loss, torch.tensor([1.69, 0.09, 0.25]))
    assert clipfrac.tolist() == [1.0, 1.0, 0.0]
    assert value_loss(values, old, ret, None)[0].tolist() == [1.0, 0.0, 0.25]


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_aggregation_weights_are_split_invariant(mode):
    masks = [torch.tensor(m, dtype=torch.float32) for m in ([1, 1, 0], [1], [1, 1, 1, 1], [0, 0])]
    losses = [torch.arange(len(m), dtype=torch.float32) + i for i, m in enumerate(masks)]
    total_tokens = sum(float(m.sum()) for m in masks)
    whole = aggregation_weights(masks, mode, total_tokens, 4, max_response_len=5)
    split = aggregation_weights(masks[:1], mode, total_tokens, 4, 5) + aggregation_weights(masks[1:], mode,
                                                                                          total_tokens, 4, 5)
    for a, b in zip(whole, split):
        torch.testing.assert_close(a, b)
    value = sum(float((w * l).sum()) for w, l in zip(whole, losses))
    if mode == "token-mean":
        expected = sum(float((l * m).sum()) for l, m in zip(losses, masks)) / total_tokens
    elif mode == "seq-mean-token-mean":
        expected = sum(float((l * m).sum()) / max(float(m.sum()), 1) for l, m in zip(losses, masks)) / 4
    else:
        expected = sum(float((l * m).sum()) / 5 for l, m in zip(losses, masks)) / 4
    assert value == pytest.approx(expected)


# ---------------------------------------------------------------- RLOO


def test_rloo_leave_one_out_exact_values_and_zero_group_sums():
    from slime.algorithms.advantages import leave_one_out, post_process_rewards

    # groups by id, interleaved: id 5 -> [1, 0, 0], id 2 -> [2, 4, 6], id 9 -> [7] (alone)
    rewards = torch.tensor([1.0, 2.0, 0.0, 4.0, 7.0, 0.0, 6.0])
    ids = [5, 2, 5, 2, 9, 5, 2]
    # r_i - mean of the others: 1 - 0 = 1; 0 - 1/2 = -0.5 (twice); 2 - 5 = -3; 4 - 4 = 0; 6 - 3 = 3; alone: 0
    expected = torch.tensor([1.0, -3.0, -0.5, 0.0, 0.0, -0.5, 3.0])
    out = leave_one_out(rewards, ids)
    torch.testing.assert_close(out, expected)
    for g in set(ids):
        assert float(sum(out[i] for i, x in enumerate(ids) if x == g)) == pytest.approx(0.0, abs=1e-6)
    # equals n/(n-1) * (r - group mean)
    torch.testing.assert_close(out[[1, 3, 6]], 1.5 * (rewards[[1, 3, 6]] - 4.0))
    torch.testing.assert_close(post_process_rewards(rewards, ids, "rloo"), expected)
    torch.testing.assert_close(post_process_rewards(rewards, ids, "rloo", rewards_normalization=False), rewards)
    adv = ADVANTAGE_ESTIMATORS["rloo"](expected[:2], [3, 1])
    torch.testing.assert_close(adv[0], torch.full((3,), 1.0))
    torch.testing.assert_close(adv[1], torch.full((1,), -3.0))


# ---------------------------------------------------------------- truncated importance sampling


def test_tis_weights_token_sequence_geometric_exact():
    from slime.algorithms.losses import tis_weights

    train = torch.tensor([-1.0, -2.0, -0.5])
    rollout = torch.tensor([-1.5, -1.0, -0.5])  # log-ratios 0.5, -1, 0
    w, ratio = tis_weights(train, rollout, clip=1.5, clip_low=0.5)
    torch.testing.assert_close(ratio, torch.tensor([math.exp(0.5), math.exp(-1.0), 1.0]))
    torch.testing.assert_close(w, torch.tensor([1.5, 0.5, 1.0]))
    w, _ = tis_weights(train, rollout, clip=2.0)  # default lower clip 0: only the upper one bites
    torch.testing.assert_close(w, torch.tensor([math.exp(0.5), math.exp(-1.0), 1.0]))
    # sequences [2, 1]: sequence = product of the token ratios, geometric = their geometric mean
    w, ratio = tis_weights(train, rollout, 10.0, 0.0, "sequence", [2, 1])
    torch.testing.assert_close(ratio, torch.tensor([math.exp(-0.5), math.exp(-0.5), 1.0]))
    w, _ = tis_weights(train, rollout, 10.0, 0.0, "geometric", [2, 1])
    torch.testing.assert_close(w, torch.tensor([math.exp(-0.25), math.exp(-0.25), 1.0]))
    # masked tokens do not count: mask [1, 0, 1] leaves token 0's ratio for sequence 0
    w, _ = tis_weights(train, rollout, 1.5, 0.0, "sequence", [2, 1], torch.tensor([1.0, 0.0, 1.0]))
    torch.testing.assert_close(w, torch.tensor([1.5, 1.5, 1.0]))
    # no gradient flows through the weights
    t = train.clone().requires_grad_()
    assert not tis_weights(t, rollout, 2.0)[0].requires_grad


def test_vanilla_tis_weights_the_policy_loss_and_reports_metrics(tiny_model_dir, tmp_path):
    from slime.algorithms.losses import vanilla_tis
    from tests.helpers.args import make_args

    args = make_args(tiny_model_dir, tmp_path, "--use-tis", "--tis-clip", 1.5, "--tis-clip-low", 0.5,
                     "--tis-level", "token")
    pg = torch.tensor([2.0, -1.0, 3.0])
    mask = torch.tensor([1.0, 1.0, 0.0])
    out, out_mask, m = vanilla_tis(args, pg_loss=pg, train_log_probs=torch.tensor([-1.0, -2.0, -0.5]),
                                   rollout_log_probs=torch.tensor([-1.5, -1.0, -0.5]), loss_mask=mask,
                                   response_lengths=[3])
    torch.testing.assert_close(out, torch.tensor([3.0, -0.5, 3.0]))
    assert out_mask is mask
    torch.testing.assert_close(m["tis_clipfrac"], torch.tensor([1.0, 1.0, 0.0]))
    torch.testing.assert_close(m["tis_weight"], torch.tensor([1.5, 0.5, 1.0]))
    torch.testing.assert_close(m["tis_abs"], torch.tensor([math.exp(0.5) - 1, 1 - math.exp(-1.0), 0.0]))


# ---------------------------------------------------------------- unbiased KL, SFT loss


def test_unbiased_kl_is_importance_weighted_exact_values_and_gradient():
    lp = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-1.5, -1.0])
    old = torch.tensor([-1.2, -2.0])
    ratio = torch.exp(lp - old)  # [e^0.2, 1]
    torch.testing.assert_close(kl_penalty(lp, ref, "k1", importance_ratio=ratio),
                               torch.tensor([0.5 * math.exp(0.2), -1.0]))
    k3 = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]  # exp(d) - d - 1, d = ref - lp
    torch.testing.assert_close(kl_penalty(lp, ref, "low_var_kl", importance_ratio=ratio),
                               torch.tensor([k3[0] * math.exp(0.2), k3[1]]))
    torch.testing.assert_close(kl_penalty(lp, ref, "k2", importance_ratio=ratio),
                               torch.tensor([0.125 * math.exp(0.2), 0.5]))
    # on policy (old = lp, ratio 1) the value is the plain estimate, but the gradient gains kl * dlogp:
    # d/dlp [exp(lp - sg(lp)) * (lp - ref)] = (lp - ref) + 1
    x = lp.clone().requires_grad_()
    kl = kl_penalty(x, ref, "k1", importance_ratio=torch.exp(x - x.detach()))
    torch.testing.assert_close(kl.detach(), torch.tensor([0.5, -1.0]))
    kl.sum().backward()
    torch.testing.assert_close(x.grad, torch.tensor([1.5, 0.0]))
    # the k3 clamp applies after weighting
    big = kl_penalty(torch.tensor([0.0]), torch.tensor([3.0]), "k3", importance_ratio=torch.tensor([10.0]))
    assert float(big) == 10.0


def test_sft_loss_is_negative_log_likelihood():
    from slime.algorithms.losses import sft_loss

    torch.testing.assert_close(sft_loss(torch.tensor([-0.5, -2.0])), torch.tensor([0.5, 2.0]))


@pytest.mark.parametrize("estimator", ["grpo", "gspo", "cispo", "rloo", "reinforce_plus_plus_baseline"])
@pytest.mark.parametrize("std", [True, False])
def test_group_rewards_sum_to_zero_per_group(estimator, std):
    from slime.algorithms.advantages import post_process_rewards

    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(12, generator=g)
    ids = [3, 1, 3, 2, 1, 2, 3, 1, 2, 3, 1, 2]  # 3 groups of 4, interleaved
    out = post_process_rewards(rewards, ids, estimator, std_normalization=std)
    for gid in set(ids):
        assert float(sum(out[i] for i, x in enumerate(ids) if x == gid)) == pytest.approx(0.0, abs=1e-5)


def test_gspo_equals_token_level_ppo_when_a_sequence_shares_one_ratio():
    from slime.algorithms.losses import gspo_policy_loss, ppo_policy_loss

    old = torch.tensor([-1.0, -2.0, -0.3, -1.5, -0.7])
    shift = torch.tensor([0.1, 0.1, 0.1, -0.4, -0.4])  # sequences [3, 2], one log-ratio each
    lp = (old + shift).requires_grad_()
    adv = torch.tensor([1.0, 1.0, 1.0, -2.0, -2.0])
    gl, gc = gspo_policy_loss(_inputs(lp, old, adv, 0.2, 0.28, response_lengths=[3, 2],
                                      loss_mask=torch.ones(5)))
    pl, pc = ppo_policy_loss(_inputs(lp, old, adv, 0.2, 0.28))
    torch.testing.assert_close(gl, pl)
    assert gc.tolist() == pc.tolist() == [0.0, 0.0, 0.0, 1.0, 1.0]

