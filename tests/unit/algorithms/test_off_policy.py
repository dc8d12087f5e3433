"""Off-policy corrections (slime/algorithms/off_policy.py, slime/off_policy_flags.py): exact values
on small hand-computed tensors, and every flag error through `validate_off_policy` on the real parser."""

import math
from functools import partial

import pytest
import torch

from slime.algorithms.losses import POLICY_LOSSES, LossInputs, vanilla_tis
from slime.algorithms.off_policy import (
    SAPO_TAU_NEG,
    SAPO_TAU_POS,
    off_policy_tis,
    opsm_mask,
    policy_loss_for,
    sapo_policy_loss,
    tis_mode_weights,
    tis_veto_mask,
    top_entropy_mask,
)
from slime.arguments import Args, build_parser
from slime.off_policy_flags import add_off_policy_flags, validate_off_policy
from slime.utils.errors import SlimeConfigError

E = math.exp
# log-ratios train - rollout = [0.5, -1, 0, 3]: ratios e^0.5, e^-1, 1, e^3
TRAIN = torch.tensor([-1.0, -2.0, -0.5, -0.2])
ROLLOUT = torch.tensor([-1.5, -1.0, -0.5, -3.2])
ONES = torch.ones(4)


def parser():
    """slime's parser, with the off-policy flags added when slime.arguments does not add them yet."""
    p = build_parser()
    if "--tis-mode" not in p._option_string_actions:
        add_off_policy_flags(p)
    return p


def flags(model_dir, *argv):
    """Args from the real parser, with what slime.arguments.validate derives before the off-policy
    checks (steps per rollout, loss type, LoRA), then `validate_off_policy`."""
    args = parser().parse_args(["--hf-checkpoint", model_dir, "--rollout-batch-size", "1", *map(str, argv)],
                               namespace=Args())
    args.num_steps_per_rollout = args.num_steps_per_rollout or 1
    if args.loss_type is None:
        args.loss_type = "custom_loss" if args.custom_loss_function_path else "policy_loss"
    args.lora = args.lora_rank is not None
    validate_off_policy(args)
    return args


# ---------------------------------------------------------------- TIS modes


def test_truncate_and_clip_weights_and_metrics():
    ratio = torch.tensor([E(0.5), E(-1.0), 1.0, E(3.0)])
    w, keep, m = tis_mode_weights(TRAIN, ROLLOUT, mode="truncate", clip=2.0, clip_low=0.5)
    torch.testing.assert_close(w, torch.tensor([E(0.5), 0.5, 1.0, 2.0]))
    assert keep.tolist() == [1.0] * 4
    torch.testing.assert_close(m["tis"], ratio)
    assert m["tis_clipfrac"].tolist() == [0.0, 1.0, 0.0, 1.0]
    assert "tis_masked" not in m and "tis_clip_low" not in m
    w2, keep2, m2 = tis_mode_weights(TRAIN, ROLLOUT, mode="clip", clip=2.0, clip_low=0.5)
    assert torch.equal(w2, w) and torch.equal(keep2, keep)
    assert m2["tis_clip_low"].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert m2["tis_clip_high"].tolist() == [0.0, 0.0, 0.0, 1.0]


def test_mask_mode_drops_tokens_outside_the_range_and_keeps_the_ratio_of_the_others():
    w, keep, m = tis_mode_weights(TRAIN, ROLLOUT, mode="mask", clip=2.0, clip_low=0.5)
    assert keep.tolist() == [1.0, 0.0, 1.0, 0.0]
    torch.testing.assert_close(w, torch.tensor([E(0.5), 0.0, 1.0, 0.0]))  # kept: weighted by the ratio
    assert m["tis_mask_low"].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert m["tis_mask_high"].tolist() == [0.0, 0.0, 0.0, 1.0]
    assert m["tis_masked"].tolist() == [0.0, 1.0, 0.0, 1.0]
    torch.testing.assert_close(m["tis_weight"], w)
    # the bounds are inclusive: a ratio of exactly clip_low or clip stays
    _, keep, _ = tis_mode_weights(torch.tensor([math.log(2.0), math.log(0.5)]), torch.zeros(2), mode="mask",
                                  clip=2.0, clip_low=0.5)
    assert keep.tolist() == [1.0, 1.0]
    # clip_low 0: only the upper side masks (TRL's token_mask)
    _, keep, _ = tis_mode_weights(TRAIN, ROLLOUT, mode="mask", clip=2.0)
    assert keep.tolist() == [1.0, 1.0, 1.0, 0.0]


def test_mask_mode_at_sequence_and_geometric_level_drops_whole_sequences():
    # sequences [2, 2]: summed log-ratios -0.5 and 3 -> ratios e^-0.5 (in [0.5, 2]) and e^3 (out)
    w, keep, _ = tis_mode_weights(TRAIN, ROLLOUT, mode="mask", clip=2.0, clip_low=0.5, level="sequence",
                                  response_lengths=[2, 2], loss_mask=ONES)
    assert keep.tolist() == [1.0, 1.0, 0.0, 0.0]
    torch.testing.assert_close(w, torch.tensor([E(-0.5), E(-0.5), 0.0, 0.0]))
    # geometric: mean log-ratios -0.25 and 1.5 -> e^-0.25 kept, e^1.5 = 4.48 dropped
    w, keep, _ = tis_mode_weights(TRAIN, ROLLOUT, mode="mask", clip=2.0, clip_low=0.5, level="geometric",
                                  response_lengths=[2, 2], loss_mask=ONES)
    assert keep.tolist() == [1.0, 1.0, 0.0, 0.0]
    torch.testing.assert_close(w, torch.tensor([E(-0.25), E(-0.25), 0.0, 0.0]))
    # a loss-mask 0 token does not count: without token 3 (log-ratio 3), sequence 1 has ratio 1
    _, keep, _ = tis_mode_weights(TRAIN, ROLLOUT, mode="mask", clip=2.0, clip_low=0.5, level="sequence",
                                  response_lengths=[2, 2], loss_mask=torch.tensor([1.0, 1.0, 1.0, 0.0]))
    assert keep.tolist() == [1.0, 1.0, 1.0, 1.0]


def test_veto_drops_every_token_of_a_sequence_with_a_catastrophic_token():
    # token 1's ratio e^-1 = 0.37 < 0.5: sequence 0 (tokens 0, 1) is vetoed
    keep, bad = tis_veto_mask(TRAIN, ROLLOUT, ONES, [2, 2], 0.5)
    assert keep.tolist() == [0.0, 0.0, 1.0, 1.0] and bad.tolist() == [0.0, 1.0, 0.0, 0.0]
    # ... unless that token has no loss
    keep, bad = tis_veto_mask(TRAIN, ROLLOUT, torch.tensor([1.0, 0.0, 1.0, 1.0]), [2, 2], 0.5)
    assert keep.tolist() == [1.0] * 4 and bad.tolist() == [0.0] * 4
    # with truncate: weights of the vetoed sequence 0, the others clamped as usual
    w, keep, m = tis_mode_weights(TRAIN, ROLLOUT, mode="truncate", clip=2.0, response_lengths=[2, 2],
                                  loss_mask=ONES, veto_threshold=0.5)
    torch.testing.assert_close(w, torch.tensor([0.0, 0.0, 1.0, 2.0]))
    assert keep.tolist() == [0.0, 0.0, 1.0, 1.0]
    assert m["tis_veto_token"].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert m["tis_veto_seq"].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert m["tis_masked"].tolist() == [1.0, 1.0, 0.0, 0.0]
    # the veto compares log-ratios: a ratio that underflows to 0 in fp32 is still caught
    keep, bad = tis_veto_mask(torch.tensor([-200.0, 0.0]), torch.zeros(2), torch.ones(2), [1, 1], 1e-4)
    assert keep.tolist() == [0.0, 1.0] and bad.tolist() == [1.0, 0.0]
    with pytest.raises(ValueError):
        tis_veto_mask(TRAIN, ROLLOUT, ONES, [2, 1], 0.5)


def _tis_args(**kw):
    base = dict(tis_mode="truncate", tis_clip=2.0, tis_clip_low=0.0, tis_level="token", tis_veto_threshold=None)
    return Args(**{**base, **kw})


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("clip_low", [0.0, 0.5])
def test_truncate_is_vanilla_tis_exactly(level, clip_low):
    g = torch.Generator().manual_seed(0)
    train, rollout = -torch.rand(9, generator=g) * 3, -torch.rand(9, generator=g) * 3
    pg = torch.randn(9, generator=g, requires_grad=True)
    mask = torch.tensor([1.0, 1, 0, 1, 1, 1, 0, 1, 1])
    args = _tis_args(tis_clip_low=clip_low, tis_level=level)
    kw = dict(train_log_probs=train, rollout_log_probs=rollout, loss_mask=mask, response_lengths=[4, 2, 3])
    out, out_mask, m = off_policy_tis(args, pg_loss=pg, **kw)
    ref, ref_mask, ref_m = vanilla_tis(args, pg_loss=pg, **kw)
    assert torch.equal(out, ref) and out_mask is mask and ref_mask is mask
    assert m.keys() == ref_m.keys() and all(torch.equal(m[k], ref_m[k]) for k in m)
    # the pure core gives the very same weights
    w, keep, _ = tis_mode_weights(train, rollout, mode="truncate", clip=2.0, clip_low=clip_low, level=level,
                                  response_lengths=[4, 2, 3], loss_mask=mask)
    assert torch.equal(pg * w, ref) and keep.tolist() == [1.0] * 9
    out.sum().backward()  # the gradient reaches the policy loss only through pg
    assert torch.equal(pg.grad, w)


def test_off_policy_tis_mask_mode_follows_the_tis_contract():
    pg = torch.tensor([2.0, -1.0, 3.0, 4.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    args = _tis_args(tis_mode="mask", tis_clip_low=0.5)
    out, out_mask, m = off_policy_tis(args, pg_loss=pg, train_log_probs=TRAIN, rollout_log_probs=ROLLOUT,
                                      loss_mask=mask, response_lengths=[4])
    torch.testing.assert_close(out, torch.tensor([2.0 * E(0.5), 0.0, 3.0, 0.0]))
    assert out_mask.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert all(v.shape == (4,) for v in m.values())


# ---------------------------------------------------------------- OPSM


def test_opsm_masks_negative_advantage_sequences_past_delta():
    # sequences [2, 2, 1]; old - current = [0.5, 0.3 | 0, -0.2 | 0.1]: mean KLs 0.4, -0.1, 0.1
    cur = torch.full((5,), -1.0)
    old = torch.tensor([-0.5, -0.7, -1.0, -1.2, -0.9])
    adv = torch.tensor([-1.0, -1.0, -1.0, -1.0, 1.0])
    mask, frac = opsm_mask(cur, old, adv, torch.ones(5), [2, 2, 1], 0.05)
    # seq 0: A < 0 and KL 0.4 > delta -> masked; seq 1: KL below delta; seq 2: KL 0.1 but A > 0
    assert mask.tolist() == [0.0, 0.0, 1.0, 1.0, 1.0]
    assert math.isclose(float(frac), 2 / 5, rel_tol=1e-6)
    # positive advantages are never masked, however far the policy moved
    mask, frac = opsm_mask(cur, old, adv.abs(), torch.ones(5), [2, 2, 1], 0.05)
    assert mask.tolist() == [1.0] * 5 and float(frac) == 0.0
    # per-token advantages (e.g. GAE): only the negative ones of a far sequence
    mask, _ = opsm_mask(cur, old, torch.tensor([-1.0, 2.0, -1.0, -1.0, 1.0]), torch.ones(5), [2, 2, 1], 0.05)
    assert mask.tolist() == [0.0, 1.0, 1.0, 1.0, 1.0]
    # a KL of exactly delta is kept (strictly greater masks): KL 0.5 (exact in floats)
    half = torch.tensor([-0.5, -0.5])
    assert opsm_mask(torch.full((2,), -1.0), half, -torch.ones(2), torch.ones(2), [2], 0.5)[0].tolist() == [1.0, 1.0]
    assert opsm_mask(torch.full((2,), -1.0), half, -torch.ones(2), torch.ones(2), [2], 0.25)[0].tolist() == [0.0, 0.0]


def test_opsm_kl_is_over_loss_mask_tokens_and_carries_no_gradient():
    cur = torch.full((3,), -1.0, requires_grad=True)
    old = torch.tensor([-0.5, -1.5, -1.0])  # old - cur = [0.5, -0.5, 0]
    adv = -torch.ones(3)
    # all tokens: seq 0's KL (0.5 - 0.5) / 2 = 0 -> kept; without token 1: 0.5 -> masked
    assert opsm_mask(cur, old, adv, torch.ones(3), [2, 1], 0.1)[0].tolist() == [1.0, 1.0, 1.0]
    m, frac = opsm_mask(cur, old, adv, torch.tensor([1.0, 0.0, 1.0]), [2, 1], 0.1)
    assert m.tolist() == [0.0, 0.0, 1.0]
    assert math.isclose(float(frac), 1 / 2)  # one of the two loss-mask tokens
    assert not m.requires_grad
    with pytest.raises(ValueError):
        opsm_mask(cur, old, adv, torch.ones(3), [2, 2], 0.1)


# ---------------------------------------------------------------- top-entropy tokens


def test_top_entropy_mask_keeps_the_highest_entropy_fraction():
    ent = torch.tensor([0.1, 0.9, 0.5, 0.7, 0.3])
    ones = torch.ones(5)
    assert top_entropy_mask(ent, ones, 0.4).tolist() == [0.0, 1.0, 0.0, 1.0, 0.0]  # k = 2
    assert top_entropy_mask(ent, ones, 0.2).tolist() == [0.0, 1.0, 0.0, 0.0, 0.0]  # k = 1
    assert top_entropy_mask(ent, ones, 0.3).tolist() == [0.0, 1.0, 0.0, 1.0, 0.0]  # k = ceil(1.5) = 2
    assert top_entropy_mask(ent, ones, 0.01).tolist() == [0.0, 1.0, 0.0, 0.0, 0.0]  # at least one
    # only loss-mask tokens compete (and only they are kept): without 0.9, the top 2 of 4 are 0.7, 0.5
    lm = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0])
    assert top_entropy_mask(ent, lm, 0.5).tolist() == [0.0, 0.0, 1.0, 1.0, 0.0]
    # 0.2 * 10 is 2.0000000000000004 in floats: still the top 2
    assert top_entropy_mask(torch.arange(10.0), torch.ones(10), 0.2).tolist() == [0.0] * 8 + [1.0, 1.0]


def test_top_entropy_mask_ties_identity_and_edges():
    # ties at the threshold are all kept (k = 1, but three tokens share the top entropy)
    assert top_entropy_mask(torch.tensor([0.5, 0.5, 0.5, 0.1]), torch.ones(4), 0.25).tolist() == [1.0, 1.0, 1.0, 0.0]
    # fraction 1 is the loss mask itself
    ent, lm = torch.tensor([0.3, 0.1, 0.2]), torch.tensor([1.0, 0.0, 1.0])
    assert torch.equal(top_entropy_mask(ent, lm, 1.0), lm)
    assert top_entropy_mask(ent, torch.zeros(3), 0.5).tolist() == [0.0] * 3
    assert not top_entropy_mask(ent.requires_grad_(), lm, 0.5).requires_grad
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError):
            top_entropy_mask(ent, lm, bad)


# ---------------------------------------------------------------- SAPO


def _sapo(lp, old, adv, **kw):
    return sapo_policy_loss(LossInputs(log_probs=lp, old_log_probs=old, advantages=adv, eps_clip=0.2), **kw)


def test_sapo_values_match_the_papers_gate_shifted_to_ppo_at_ratio_one():
    d = [0.1, -0.2, 0.3, 0.0]
    adv = [1.0, -2.0, 0.5, -1.5]
    loss, cf = _sapo(torch.tensor(d), torch.zeros(4), torch.tensor(adv))
    want, want_cf = [], []
    for x, a in zip(d, adv):
        tau = SAPO_TAU_POS if a > 0 else SAPO_TAU_NEG
        s = 1 / (1 + E(-tau * (E(x) - 1)))
        want.append(-a * (s * 4 / tau - 2 / tau + 1))  # the paper's f(r) = sigmoid(tau (r - 1)) 4 / tau, shifted
        want_cf.append(1 - 4 * s * (1 - s))
    torch.testing.assert_close(loss, torch.tensor(want))
    torch.testing.assert_close(cf, torch.tensor(want_cf))
    assert loss[3].item() == 1.5 and cf[3].item() == 0.0  # ratio 1: -A, like PPO, nothing gated
    # tau_neg applies to A <= 0: A = 0 has no loss
    assert _sapo(torch.tensor([0.4]), torch.zeros(1), torch.zeros(1))[0].item() == 0.0


def test_sapo_gradient_is_the_soft_gate_weight_autograd_and_finite_differences():
    d = torch.tensor([0.1, -0.2, 0.3, 0.0, 1.0], dtype=torch.float64)
    old = torch.tensor([-1.0, -2.0, -0.5, -1.0, -3.0], dtype=torch.float64)
    adv = torch.tensor([1.0, -2.0, 0.5, -1.5, 0.7], dtype=torch.float64)
    lp = (old + d).requires_grad_()
    loss, _ = _sapo(lp, old, adv, tau_pos=2.0, tau_neg=3.0)
    (g,) = torch.autograd.grad(loss.sum(), lp)
    tau = torch.where(adv > 0, 2.0, 3.0)
    r = d.exp()
    s = torch.sigmoid(tau * (r - 1))
    torch.testing.assert_close(g, -adv * r * 4 * s * (1 - s))  # weight 4 s (1 - s): 1 at r = 1
    assert g[3].item() == 1.5  # ratio 1: PPO's -A
    h = 1e-6
    for i in range(5):
        e = torch.zeros(5, dtype=torch.float64)
        e[i] = h
        fd = (_sapo(lp.detach() + e, old, adv, tau_pos=2.0, tau_neg=3.0)[0].sum()
              - _sapo(lp.detach() - e, old, adv, tau_pos=2.0, tau_neg=3.0)[0].sum()) / (2 * h)
        assert math.isclose(float(fd), float(g[i]), rel_tol=1e-6, abs_tol=1e-9)
    torch.autograd.gradcheck(lambda x: _sapo(x, old, adv, tau_pos=2.0, tau_neg=3.0)[0], (lp,))


def test_sapo_limits_small_tau_is_the_unclipped_surrogate_large_tau_trains_only_on_policy():
    d = torch.tensor([0.3, -0.4, 0.05], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 2.0], dtype=torch.float64)
    r = d.exp()
    lp = d.clone().requires_grad_()
    # tau -> 0: loss -> -A r (gradient -A r everywhere, no clip)
    loss, cf = _sapo(lp, torch.zeros(3, dtype=torch.float64), adv, tau_pos=1e-6, tau_neg=1e-6)
    (g,) = torch.autograd.grad(loss.sum(), lp)
    torch.testing.assert_close(loss, -adv * r, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(g, -adv * r, rtol=1e-9, atol=1e-9)
    assert float(cf.max()) < 1e-12
    # tau -> inf: every ratio != 1 loses its gradient; the value tends to -A
    loss, cf = _sapo(lp, torch.zeros(3, dtype=torch.float64), adv, tau_pos=1e4, tau_neg=1e4)
    (g,) = torch.autograd.grad(loss.sum(), lp)
    assert float(g.abs().max()) < 1e-12
    torch.testing.assert_close(loss, -adv, rtol=0, atol=1e-3)
    assert cf.tolist() == [1.0, 1.0, 1.0]
    # tau between: the gradient weight falls off with |r - 1| and faster for larger tau
    w = [float(torch.autograd.grad(_sapo(lp, torch.zeros(3, dtype=torch.float64), adv, tau_pos=t,
                                         tau_neg=t)[0][0], lp)[0][0]) for t in (0.5, 1.0, 4.0)]
    assert -r[0] < w[0] < w[1] < w[2] < 0


def test_sapo_huge_ratio_is_finite_and_policy_loss_for_binds_the_flags():
    lp = torch.tensor([60.0, 0.0], requires_grad=True)
    loss, _ = _sapo(lp, torch.zeros(2), torch.tensor([1.0, -1.0]))
    (g,) = torch.autograd.grad(loss.sum(), lp)
    assert torch.isfinite(loss).all() and torch.isfinite(g).all()
    fn = policy_loss_for(Args(policy_loss_type="sapo", sapo_tau_pos=2.0, sapo_tau_neg=3.0))
    assert isinstance(fn, partial) and fn.keywords == {"tau_pos": 2.0, "tau_neg": 3.0}
    inputs = LossInputs(log_probs=torch.tensor([0.2]), old_log_probs=torch.zeros(1), advantages=torch.ones(1),
                        eps_clip=0.2)
    assert torch.equal(fn(inputs)[0], sapo_policy_loss(inputs, tau_pos=2.0, tau_neg=3.0)[0])
    for name in POLICY_LOSSES:
        assert policy_loss_for(Args(policy_loss_type=name)) is POLICY_LOSSES[name]
    with pytest.raises(ValueError):
        _sapo(lp, torch.zeros(2), torch.ones(2), tau_pos=0.0)


# ---------------------------------------------------------------- flags


def test_defaults_change_nothing(tiny_model_dir):
    args = flags(tiny_model_dir)
    assert (args.tis_mode, args.tis_veto_threshold, args.use_opsm, args.opsm_delta) == ("truncate", None, False, None)
    assert args.top_entropy_token_fraction == 1.0 and args.policy_loss_type == "ppo"
    assert (args.sapo_tau_pos, args.sapo_tau_neg) == (SAPO_TAU_POS, SAPO_TAU_NEG)
    assert args.freeze_params_name_list is None and args.ref_update_interval is None
    assert flags(tiny_model_dir, "--advantage-estimator", "gspo").policy_loss_type == "gspo"
    assert flags(tiny_model_dir, "--advantage-estimator", "cispo").policy_loss_type == "cispo"


def test_good_combinations(tiny_model_dir):
    a = flags(tiny_model_dir, "--use-tis", "--tis-mode", "mask", "--tis-clip-low", 0.5, "--tis-level", "geometric",
              "--tis-veto-threshold", 1e-4)
    assert (a.tis_mode, a.tis_veto_threshold) == ("mask", 1e-4)
    assert flags(tiny_model_dir, "--use-tis", "--tis-mode", "clip", "--tis-clip-low", 0.5).tis_mode == "clip"
    assert flags(tiny_model_dir, "--use-tis", "--use-opsm").opsm_delta == 1e-4  # slime's default
    assert flags(tiny_model_dir, "--use-opsm", "--opsm-delta", 0.01, "--use-rollout-logprobs").opsm_delta == 0.01
    assert flags(tiny_model_dir, "--use-opsm", "--num-steps-per-rollout", 2).use_opsm
    a = flags(tiny_model_dir, "--policy-loss-type", "sapo", "--sapo-tau-pos", 2, "--sapo-tau-neg", 3)
    assert (a.policy_loss_type, a.sapo_tau_pos, a.sapo_tau_neg) == ("sapo", 2.0, 3.0)
    assert flags(tiny_model_dir, "--advantage-estimator", "rloo", "--policy-loss-type", "cispo").policy_loss_type == \
        "cispo"
    assert flags(tiny_model_dir, "--advantage-estimator", "gspo", "--policy-loss-type", "gspo").policy_loss_type == \
        "gspo"
    assert flags(tiny_model_dir, "--top-entropy-token-fraction", 0.2).top_entropy_token_fraction == 0.2


BAD = [
    (["--tis-mode", "mask"], "--tis-mode is a TIS flag: add --use-tis"),
    (["--tis-veto-threshold", 1e-4], "--tis-veto-threshold is a TIS flag: add --use-tis"),
    (["--use-tis", "--tis-mode", "potato"], "--tis-mode"),
    (["--use-tis", "--tis-mode", "clip"], "--tis-mode clip clamps both sides: give --tis-clip-low > 0"),
    (["--use-tis", "--tis-mode", "mask", "--tis-clip", 0.9], "--tis-mode mask needs --tis-clip-low <= 1 <= --tis-clip"),
    (["--use-tis", "--tis-mode", "clip", "--tis-clip-low", 1.2, "--tis-clip", 3],
     "--tis-mode clip needs --tis-clip-low <= 1 <= --tis-clip"),
    (["--use-tis", "--tis-veto-threshold", 0], "--tis-veto-threshold must be in (0, 1)"),
    (["--use-tis", "--tis-veto-threshold", 1.5], "--tis-veto-threshold must be in (0, 1)"),
    (["--use-tis", "--tis-mode", "mask", "--custom-tis-function-path", "x.y"],
     "--tis-mode configures the built-in TIS, which --custom-tis-function-path x.y replaces"),
    (["--use-tis", "--tis-veto-threshold", 1e-3, "--custom-tis-function-path", "x.y"],
     "--tis-veto-threshold configures the built-in TIS"),
    (["--opsm-delta", 0.1], "--opsm-delta is an Off-Policy Sequence Masking flag: add --use-opsm"),
    (["--use-opsm", "--use-tis", "--opsm-delta", -1], "--opsm-delta must be >= 0"),
    (["--use-opsm"], "--use-opsm: with one optimizer step per rollout and no engine log-probs"),
    (["--use-opsm", "--use-tis", "--loss-type", "sft_loss"], "--use-opsm masks the policy loss, which --loss-type "
                                                             "sft_loss"),
    (["--top-entropy-token-fraction", 0], "--top-entropy-token-fraction must be in (0, 1]"),
    (["--top-entropy-token-fraction", 1.5], "--top-entropy-token-fraction must be in (0, 1]"),
    (["--top-entropy-token-fraction", 0.2, "--loss-type", "sft_loss"], "--top-entropy-token-fraction masks the "
                                                                       "policy loss"),
    (["--policy-loss-type", "potato"], "--policy-loss-type"),
    (["--advantage-estimator", "gspo", "--policy-loss-type", "sapo"],
     "--policy-loss-type sapo with --advantage-estimator gspo: that estimator is GRPO with the gspo loss; use "
     "--advantage-estimator grpo --policy-loss-type sapo"),
    (["--policy-loss-type", "sapo", "--loss-type", "sft_loss"], "--policy-loss-type sapo has no effect with "
                                                                "--loss-type sft_loss"),
    (["--policy-loss-type", "cispo", "--custom-loss-function-path", "x.y"],
     "--policy-loss-type cispo has no effect with --loss-type custom_loss"),
    (["--sapo-tau-pos", 2], "--sapo-tau-pos is a SAPO flag: add --policy-loss-type sapo"),
    (["--sapo-tau-neg", 2], "--sapo-tau-neg is a SAPO flag: add --policy-loss-type sapo"),
    (["--policy-loss-type", "sapo", "--eps-clip-c", 3], "--eps-clip-c is PPO's dual clip; --policy-loss-type sapo "
                                                         "has no clip"),
    (["--policy-loss-type", "sapo", "--sapo-tau-pos", 0], "--sapo-tau-pos must be > 0"),
    (["--policy-loss-type", "sapo", "--sapo-tau-neg", -1], "--sapo-tau-neg must be > 0"),
]


@pytest.mark.parametrize("argv,message", BAD, ids=[" ".join(map(str, a)) for a, _ in BAD])
def test_every_bad_flag_is_one_line_naming_it(tiny_model_dir, argv, message):
    with pytest.raises(SlimeConfigError) as e:
        flags(tiny_model_dir, *argv)
    text = str(e.value)
    assert message in text and "\n" not in text


def test_the_wired_parser_resolves_and_refuses_like_the_checks(tiny_model_dir, tmp_path):
    """Once slime.arguments adds the flags and runs validate_off_policy, a run's args get the same."""
    if "--tis-mode" not in build_parser()._option_string_actions:
        pytest.skip("the off-policy flags are not wired into slime.arguments yet")
    from tests.helpers.args import make_args

    args = make_args(tiny_model_dir, tmp_path, "--policy-loss-type", "sapo", "--use-tis", "--tis-mode", "mask",
                     "--tis-clip-low", 0.5, "--use-opsm", "--top-entropy-token-fraction", 0.2)
    assert (args.policy_loss_type, args.tis_mode, args.opsm_delta) == ("sapo", "mask", 1e-4)
    assert make_args(tiny_model_dir, tmp_path, "--advantage-estimator", "gspo").policy_loss_type == "gspo"
    with pytest.raises(SlimeConfigError, match="--sapo-tau-pos is a SAPO flag"):
        make_args(tiny_model_dir, tmp_path, "--sapo-tau-pos", 2)
