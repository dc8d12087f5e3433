"""Off-policy corrections: pure tensor functions (docs/algorithms.md, "Off-policy corrections").

Every function works on one micro-batch's N concatenated response tokens (a sample is never split
across micro-batches), like the policy losses of `slime.algorithms.losses`:

- `off_policy_tis`: the built-in TIS function (the contract above `tis_weights` in losses.py) with
  `--tis-mode truncate|mask|clip` and `--tis-veto-threshold`; `tis_mode_weights` is its core.
  `truncate` without a veto is `vanilla_tis`, exactly.
- `opsm_mask`: Off-Policy Sequence Masking (DeepSeek-V3.2; original slime's `--use-opsm`).
- `top_entropy_mask`: only the highest-entropy tokens keep their policy loss ("Beyond the 80/20
  Rule: High-Entropy Minority Tokens Drive Effective RL for LLM Reasoning", Wang et al. 2025,
  arXiv 2506.01939).
- `sapo_policy_loss`: SAPO's soft, temperature-controlled gate on the ratio instead of the hard
  clip ("Soft Adaptive Policy Optimization", Gao et al., Qwen 2025, arXiv 2511.20347); a policy
  loss by name through `policy_loss_for(args)`.

Every mask here is 0./1. per token and carries no gradient; a 0 drops the token's *policy* loss
only (the KL loss and the entropy bonus stay), and the aggregation denominator is unchanged (the
trainer fixes the per-token aggregation weights of a step before its forwards).
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, Callable

import torch
from torch import Tensor

from slime.algorithms.losses import POLICY_LOSSES, LossInputs, PolicyLoss, sequence_mean, tis_weights, vanilla_tis

TIS_MODES = ("truncate", "mask", "clip")
# SAPO's temperatures (the paper's defaults, as TRL's): negative advantages get the larger one, a
# faster-decaying gate (their gradients are the less stable ones)
SAPO_TAU_POS = 1.0
SAPO_TAU_NEG = 1.05
# SAPO's log-ratio cap (exp overflow); beyond it the gate's gradient sech^2(tau (r - 1) / 2) is 0 in fp32
SAPO_MAX_LOG_RATIO = 20.0


def _lengths(n: int, response_lengths, who: str) -> list[int]:
    if response_lengths is None:
        raise ValueError(f"{who} needs response_lengths")
    lengths = [int(x) for x in response_lengths]
    if sum(lengths) != n:
        raise ValueError(f"{who}: {n} tokens but response lengths sum to {sum(lengths)}")
    return lengths


def _sequence_any(flags: Tensor, lengths: list[int]) -> Tensor:
    """flags: Tensor[N] bool -> Tensor[N] bool, True on every token of a sequence with any True."""
    if not lengths:
        return flags
    counts = sequence_mean(flags.float(), lengths, torch.ones_like(flags, dtype=torch.float32), reduce="sum")
    return counts > 0


# ---------------------------------------------------------------- TIS modes and the veto


def tis_veto_mask(train_log_probs: Tensor, rollout_log_probs: Tensor, loss_mask: Tensor,
                  response_lengths: list[int], threshold: float) -> tuple[Tensor, Tensor]:
    """Sequence veto (original slime's `rs_veto_threshold`): a sequence with any loss-mask token
    whose own ratio exp(train - rollout) is below `threshold` loses all its tokens.

    train_log_probs, rollout_log_probs, loss_mask: Tensor[N]; response_lengths sum to N
    returns (keep Tensor[N]: 0. on every token of a vetoed sequence, else 1.;
             catastrophic Tensor[N]: 1. on the loss-mask tokens below the threshold), float32, no gradient.
    The comparison is on log-ratios (log r < log threshold), so no ratio underflows.
    """
    if not threshold > 0:
        raise ValueError(f"tis veto threshold must be > 0, got {threshold}")
    log_ratio = train_log_probs.detach().float() - rollout_log_probs.detach().float()
    lengths = _lengths(log_ratio.numel(), response_lengths, "tis_veto_mask")
    bad = (log_ratio < math.log(threshold)) & (loss_mask > 0)
    return (~_sequence_any(bad, lengths)).float(), bad.float()


def tis_mode_weights(
    train_log_probs: Tensor,
    rollout_log_probs: Tensor,
    *,
    mode: str,
    clip: float,
    clip_low: float = 0.0,
    level: str = "token",
    response_lengths: list[int] | None = None,
    loss_mask: Tensor | None = None,
    veto_threshold: float | None = None,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Importance weights against the engine's log-probs under a TIS mode (no gradient).

    train_log_probs, rollout_log_probs, loss_mask: Tensor[N]; the ratio r (per token, or per
    sequence with level sequence | geometric) is `tis_weights`'s.
      truncate: w = clamp(r, clip_low, clip), keep = 1           (today's TIS, `vanilla_tis`)
      clip:     the same numbers (two-sided: the flags require clip_low > 0); metrics split low/high
      mask:     keep = [clip_low <= r <= clip], w = r * keep     (IcePop / MIS / TRL's *_mask: a kept
                token is still reweighted by its ratio, which lies in [clip_low, clip]; with level
                sequence | geometric whole sequences are kept or dropped)
    veto_threshold: `tis_veto_mask` on the per-token ratios; a vetoed sequence gets w = keep = 0.
    returns (weights Tensor[N], keep Tensor[N] 0./1., metrics {name: Tensor[N]}), float32:
      tis (r), tis_weight (w), tis_abs (|r - 1|); truncate / clip: tis_clipfrac (w != r);
      clip: tis_clip_low (r < clip_low), tis_clip_high (r > clip); mask: tis_mask_low, tis_mask_high;
      veto: tis_veto_token (a catastrophic token), tis_veto_seq (a token of a vetoed sequence);
      mask or veto: tis_masked (1 - keep).
    """
    w, ratio = tis_weights(train_log_probs, rollout_log_probs, clip, clip_low, level, response_lengths, loss_mask)
    keep = torch.ones_like(ratio)
    metrics: dict[str, Tensor] = {"tis": ratio, "tis_abs": (ratio - 1).abs()}
    if mode in ("truncate", "clip"):
        metrics["tis_clipfrac"] = (w != ratio).float()
        if mode == "clip":
            metrics["tis_clip_low"] = (ratio < clip_low).float()
            metrics["tis_clip_high"] = (ratio > clip).float()
    elif mode == "mask":
        low, high = ratio < clip_low, ratio > clip
        keep = (~(low | high)).float()
        w = ratio * keep
        metrics["tis_mask_low"] = low.float()
        metrics["tis_mask_high"] = high.float()
    else:
        raise ValueError(f"unknown tis mode {mode!r} (choose from {', '.join(TIS_MODES)})")
    if veto_threshold is not None:
        mask = torch.ones_like(ratio) if loss_mask is None else loss_mask
        veto_keep, catastrophic = tis_veto_mask(train_log_probs, rollout_log_probs, mask, response_lengths,
                                                veto_threshold)
        keep, w = keep * veto_keep, w * veto_keep
        metrics["tis_veto_token"] = catastrophic
        metrics["tis_veto_seq"] = 1.0 - veto_keep
    if mode == "mask" or veto_threshold is not None:
        metrics["tis_masked"] = 1.0 - keep
    metrics["tis_weight"] = w
    return w, keep, metrics


def off_policy_tis(args, *, pg_loss: Tensor, train_log_probs: Tensor, rollout_log_probs: Tensor,
                   loss_mask: Tensor, response_lengths: list[int], **_: object):
    """The built-in TIS function (`--use-tis`; the contract above `tis_weights`): `--tis-mode`,
    `--tis-clip`, `--tis-clip-low`, `--tis-level`, `--tis-veto-threshold` through
    `tis_mode_weights`. Returns (pg_loss * w, loss_mask * keep, metrics). `truncate` without a veto
    is `vanilla_tis` itself (same values, same metrics)."""
    if args.tis_mode == "truncate" and args.tis_veto_threshold is None:
        return vanilla_tis(args, pg_loss=pg_loss, train_log_probs=train_log_probs,
                           rollout_log_probs=rollout_log_probs, loss_mask=loss_mask, response_lengths=response_lengths)
    w, keep, metrics = tis_mode_weights(train_log_probs, rollout_log_probs, mode=args.tis_mode, clip=args.tis_clip,
                                        clip_low=args.tis_clip_low, level=args.tis_level,
                                        response_lengths=response_lengths, loss_mask=loss_mask,
                                        veto_threshold=args.tis_veto_threshold)
    return pg_loss * w.to(pg_loss.dtype), loss_mask * keep.to(loss_mask.dtype), metrics


# ---------------------------------------------------------------- OPSM


def opsm_mask(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, loss_mask: Tensor,
              response_lengths: list[int], delta: float) -> tuple[Tensor, Tensor]:
    """Off-Policy Sequence Masking (DeepSeek-V3.2, arXiv 2512.02556; original slime's `--use-opsm`).

    log_probs:     Tensor[N], the current policy's (detached here)
    old_log_probs: Tensor[N], the policy the samples were drawn from (the engine's log-probs when
                   the trainer has them: they carry both staleness and the engine/trainer mismatch)
    advantages, loss_mask: Tensor[N]; response_lengths: the sequences' lengths (sum N)
        kl_i   = mean over sequence i's loss-mask tokens of (old_log_probs - log_probs)
                 (the sampled-token estimate of KL(pi_old || pi_theta))
        mask_t = 0 where A_t < 0 and kl_{i(t)} > delta, else 1
    A negative-advantage sequence that the policy has already moved far from teaches little and
    destabilizes; positive ones always train.
    returns (mask Tensor[N] float32 0./1., masked_fraction: scalar tensor, the masked loss-mask
    tokens over all loss-mask tokens, 0 when there are none).
    """
    log_ratio = old_log_probs.detach().float() - log_probs.detach().float()
    lengths = _lengths(log_ratio.numel(), response_lengths, "opsm_mask")
    m = loss_mask.float()
    kl = sequence_mean(log_ratio, lengths, m) if lengths else log_ratio
    drop = (advantages.detach() < 0) & (kl > delta)
    masked_fraction = (drop.float() * m).sum() / m.sum().clamp(min=1.0)
    return (~drop).float(), masked_fraction


# ---------------------------------------------------------------- high-entropy tokens


def top_entropy_mask(entropy: Tensor, loss_mask: Tensor, fraction: float) -> Tensor:
    """Keep the policy loss of the highest-entropy `fraction` of the loss-mask tokens (Wang et al.
    2025, arXiv 2506.01939: the ~20% "forking" tokens carry the RL signal).

    entropy, loss_mask: Tensor[N] (one micro-batch; the entropy of the training forward, detached here)
    fraction: in (0, 1]
    returns Tensor[N] float32 0./1.: with n loss-mask tokens and k = ceil(fraction * n) (at least
    1), 1 on the loss-mask tokens whose entropy is >= the k-th largest among them. Ties at that
    threshold are all kept (order-independent), so more than k can be kept. fraction 1 returns the
    loss mask itself (as 0./1.).
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"top_entropy_mask: fraction must be in (0, 1], got {fraction}")
    valid = loss_mask > 0
    n = int(valid.sum())
    if fraction >= 1 or n == 0:
        return valid.float()
    k = max(1, math.ceil(fraction * n - 1e-9))  # 0.2 * 10 is 2.0000000000000004 in floats
    ent = entropy.detach().float()
    threshold = torch.topk(ent[valid], k).values[-1]
    return (valid & (ent >= threshold)).float()


# ---------------------------------------------------------------- SAPO


def sapo_policy_loss(inputs: LossInputs, *, tau_pos: float = SAPO_TAU_POS,
                     tau_neg: float = SAPO_TAU_NEG) -> tuple[Tensor, Tensor]:
    """SAPO (arXiv 2511.20347): a smooth gate on the token ratio instead of PPO's hard clip.

    inputs: log_probs, old_log_probs, advantages Tensor[N] (the eps_clip fields are not used)
    tau = tau_pos where A > 0, else tau_neg; r = exp(log_probs - old_log_probs)
        the paper's gate:  f(r) = sigmoid(tau (r - 1)) * 4 / tau
        loss = -A * (f(r) - 2/tau + 1) = -A * (1 + (2/tau) * tanh(tau (r - 1) / 2))
    The constant shift (-2/tau + 1, times -A) changes no gradient; it makes the value -A at r = 1
    (PPO's) and computes the gate without cancellation for small tau. Gradient:
        d loss / d log p = -A * r * 4 s (1 - s),  s = sigmoid(tau (r - 1))   (weight 1 at r = 1)
    Limits: tau -> 0: loss -> -A * r (the unclipped surrogate, full gradient everywhere);
    tau -> inf: the weight 4 s (1 - s) -> 0 for every r != 1 (only on-policy tokens train).
    returns (per_token_loss Tensor[N], clipfrac Tensor[N]): clipfrac = 1 - 4 s (1 - s) =
    tanh^2(tau (r - 1) / 2), the share of the gradient the gate removes (soft; 0 at r = 1).
    The log-ratio is capped at SAPO_MAX_LOG_RATIO (no gradient beyond; the gate's is 0 there).
    """
    if not (tau_pos > 0 and tau_neg > 0):
        raise ValueError(f"SAPO temperatures must be > 0, got tau_pos={tau_pos}, tau_neg={tau_neg}")
    log_ratio = (inputs.log_probs - inputs.old_log_probs).clamp(max=SAPO_MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    adv = inputs.advantages
    tau = torch.where(adv > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    t = torch.tanh(tau * (ratio - 1.0) / 2.0)
    loss = -adv * (1.0 + (2.0 / tau) * t)
    return loss, t.detach().square()


# name -> (args -> PolicyLoss): the policy losses with flags of their own, bound to them once
OFF_POLICY_LOSSES: dict[str, Callable[[Any], PolicyLoss]] = {
    "sapo": lambda args: partial(sapo_policy_loss, tau_pos=args.sapo_tau_pos, tau_neg=args.sapo_tau_neg),
}
POLICY_LOSS_TYPES = (*POLICY_LOSSES, *OFF_POLICY_LOSSES)


def policy_loss_for(args) -> PolicyLoss:
    """The per-token policy loss `args.policy_loss_type` names: `POLICY_LOSSES[name]`, or one of
    `OFF_POLICY_LOSSES` bound to its flags. Called as loss(inputs: LossInputs)."""
    name = args.policy_loss_type
    if name in OFF_POLICY_LOSSES:
        return OFF_POLICY_LOSSES[name](args)
    return POLICY_LOSSES[name]


# ---------------------------------------------------------------- the trainer's per-token masks


def token_masks(args, *, pg_loss: Tensor, log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor,
                entropy: Tensor | None, loss_mask: Tensor, response_lengths: list[int]) -> tuple[Tensor, dict]:
    """The policy loss of one micro-batch (Tensor[N]) with OPSM (`--use-opsm`) and the top-entropy
    mask (`--top-entropy-token-fraction`) applied, and their per-token logged values
    (`opsm_clipfrac`, `top_entropy_kept`). old_log_probs: the policy the samples came from (the
    engine's when the trainer has them)."""
    logged: dict[str, Tensor] = {}
    if args.use_opsm:
        keep, _ = opsm_mask(log_probs, old_log_probs, advantages, loss_mask, response_lengths, args.opsm_delta)
        pg_loss = pg_loss * keep.to(pg_loss.dtype)
        logged["opsm_clipfrac"] = 1.0 - keep
    if args.top_entropy_token_fraction < 1:
        keep = top_entropy_mask(entropy, loss_mask, args.top_entropy_token_fraction)
        pg_loss = pg_loss * keep.to(pg_loss.dtype)
        logged["top_entropy_kept"] = keep
    return pg_loss, logged
