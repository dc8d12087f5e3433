"""Exact values of the pure algorithm functions on small hand-computed tensors."""

import math

import pytest
import torch

from slime.algorithms.advantages import ADVANTAGE_ESTIMATORS, group_normalize, grpo
from slime.algorithms.losses import (
    POLICY_LOSSES,
    compute_entropy,
    compute_log_probs,
    compute_log_probs_and_entropy,
    kl_penalty,
    masked_mean,
    masked_sum,
    policy_loss,
    token_mean_over,
)

EPS = 1e-6


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
    loss, clipfrac = policy_loss(lp, old, adv, eps_clip=0.2, eps_clip_high=0.28)
    # 1.5,A=1 -> max(-1.5, -1.28) clipped; 0.5,A=1 -> max(-0.5, -0.8) not; 0.5,A=-1 -> max(0.5, 0.8) clipped
    # 1.5,A=-1 -> max(1.5, 1.28) not; 1.25 within the high clip 1.28 -> not; 0.85 within the low clip -> not
    expected = torch.tensor([-1.28, -0.5, 0.8, 1.5, -1.25, 0.85, -2.5])
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-6)
    assert clipfrac.tolist() == [1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    # symmetric 0.2 clips the 1.25 ratio with positive advantage
    loss_sym, clip_sym = policy_loss(lp, old, adv, eps_clip=0.2)
    torch.testing.assert_close(loss_sym[4], torch.tensor(-1.2))
    assert clip_sym.tolist() == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    assert POLICY_LOSSES["ppo"](lp, old, adv, 0.2, 0.28)[1].tolist() == clipfrac.tolist()


def test_policy_loss_ratio_one_gradient_is_minus_advantage():
    lp = torch.tensor([-1.0, -2.0, -0.3], requires_grad=True)
    adv = torch.tensor([0.5, -2.0, 1.0])
    loss, clipfrac = policy_loss(lp, lp.detach(), adv, 0.2, 0.2)
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
