"""Loss pieces: token log-probs and entropy from logits, PPO policy loss, KL penalties,
masked aggregation. Pure tensor functions; shapes are in the docstrings.

Memory: `compute_log_probs` / `compute_entropy` never materialize a full-vocabulary
fp32 log-softmax for the whole input. They walk the rows in chunks of `chunk_size`
positions, and the autograd graph keeps only the input logits (a view) plus O(rows)
results, never a second [rows, vocab] copy: token log-probs keep their per-row
log-normalizer and compute the softmax again in backward (`_TokenLogProbs`); the entropy
recomputes each chunk in backward (activation checkpointing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

DEFAULT_CHUNK_SIZE = 1024


# ---------------------------------------------------------------- log-probs and entropy


def _scaled(logits: Tensor, temperature: float) -> Tensor:
    logits = logits.float()
    if temperature not in (None, 0, 1, 1.0):
        logits = logits / temperature
    return logits


def _chunk_log_probs(logits: Tensor, tokens: Tensor, temperature: float) -> Tensor:
    x = _scaled(logits, temperature)
    return x.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(x, dim=-1)


class _TokenLogProbs(torch.autograd.Function):
    """`_chunk_log_probs` with a hand-written backward that keeps only the per-row logsumexp.

    Activation checkpointing of `_chunk_log_probs` kept the same tensors (the input logits),
    but ran the whole chunk forward again in backward (the logsumexp: another pass over
    [rows, vocab]) through checkpoint's saved-tensor hooks, which cost more than the math on
    a small model. The backward below is autograd's for that forward, op for op (Sub -> -g into
    Logsumexp's `g * exp(x - lse)`, Gather's `zeros.scatter_add_`, the two summed, Div by T,
    the cast back), so the gradients are bitwise those of the checkpointed version.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, tokens: Tensor, temperature: float) -> Tensor:
        x = _scaled(logits, temperature)
        lse = torch.logsumexp(x, dim=-1)
        ctx.save_for_backward(logits, tokens, lse)
        ctx.temperature = temperature
        return x.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - lse

    @staticmethod
    def backward(ctx, grad: Tensor):
        logits, tokens, lse = ctx.saved_tensors
        t = ctx.temperature
        x = _scaled(logits, t)
        dx = (-grad).unsqueeze(-1) * (x - lse.unsqueeze(-1)).exp()
        dx = dx + torch.zeros_like(x).scatter_add_(-1, tokens.unsqueeze(-1), grad.unsqueeze(-1))
        if t not in (None, 0, 1, 1.0):
            dx = dx / t
        return dx.to(logits.dtype), None, None


def _chunk_entropy(logits: Tensor, temperature: float) -> Tensor:
    x = _scaled(logits, temperature)
    logp = torch.log_softmax(x, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def _chunk_both(logits: Tensor, tokens: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    x = _scaled(logits, temperature)
    logp = torch.log_softmax(x, dim=-1)
    token_logp = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return token_logp, -(logp.exp() * logp).sum(-1)


def _rows(logits: Tensor) -> Tensor:
    return logits.reshape(-1, logits.shape[-1])


def _run_chunked(fn: Callable, logits: Tensor, extra: Tensor | None, temperature: float, chunk_size: int,
                 grad_fn: type[torch.autograd.Function] | None = None):
    """fn over chunks of rows; with gradients, `grad_fn.apply` (same arguments) when given, else
    fn under activation checkpointing."""
    flat = _rows(logits)
    flat_extra = extra.reshape(-1) if extra is not None else None
    n = flat.shape[0]
    use_grad = torch.is_grad_enabled() and flat.requires_grad
    outs = []
    for s in range(0, n, max(1, chunk_size)):
        args = (flat[s : s + chunk_size],) + ((flat_extra[s : s + chunk_size],) if flat_extra is not None else ())
        args = args + (temperature,)
        if not use_grad:
            outs.append(fn(*args))
        elif grad_fn is not None:
            outs.append(grad_fn.apply(*args))
        else:
            outs.append(checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False))
    return outs


def compute_log_probs(
    logits: Tensor, tokens: Tensor, temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> Tensor:
    """log softmax(logits / T)[token] for every position, in chunks of rows.

    logits: Tensor[..., V] (any float dtype; computed in fp32)
    tokens: Tensor[...] (int64), the token whose log-prob each row of logits gives.
            The caller shifts: a response token at position t is scored by the logits
            at position t-1.
    temperature: T; 0 or 1 means no scaling (greedy decoding is scored at T=1).
    returns: Tensor[...] float32
    """
    if logits.shape[:-1] != tokens.shape:
        raise ValueError(f"compute_log_probs: logits {tuple(logits.shape)} vs tokens {tuple(tokens.shape)}")
    if tokens.numel() == 0:
        return torch.zeros(tokens.shape, dtype=torch.float32, device=logits.device)
    outs = _run_chunked(_chunk_log_probs, logits, tokens, temperature, chunk_size, grad_fn=_TokenLogProbs)
    return torch.cat(outs).reshape(tokens.shape)


def compute_entropy(logits: Tensor, temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK_SIZE) -> Tensor:
    """Entropy of softmax(logits / T) per position, in chunks of rows.

    logits: Tensor[..., V]  ->  Tensor[...] float32 (nats)
    """
    shape = logits.shape[:-1]
    if logits.numel() == 0:
        return torch.zeros(shape, dtype=torch.float32, device=logits.device)
    outs = _run_chunked(_chunk_entropy, logits, None, temperature, chunk_size)
    return torch.cat(outs).reshape(shape)


def compute_log_probs_and_entropy(
    logits: Tensor, tokens: Tensor, temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> tuple[Tensor, Tensor]:
    """Both of the above sharing one log-softmax per chunk.

    logits: Tensor[..., V], tokens: Tensor[...]  ->  (log_probs Tensor[...], entropy Tensor[...])
    """
    if logits.shape[:-1] != tokens.shape:
        raise ValueError(f"compute_log_probs: logits {tuple(logits.shape)} vs tokens {tuple(tokens.shape)}")
    if tokens.numel() == 0:
        z = torch.zeros(tokens.shape, dtype=torch.float32, device=logits.device)
        return z, z.clone()
    outs = _run_chunked(_chunk_both, logits, tokens, temperature, chunk_size)
    lp = torch.cat([o[0] for o in outs]).reshape(tokens.shape)
    ent = torch.cat([o[1] for o in outs]).reshape(tokens.shape)
    return lp, ent


def log_probs_from_hidden(
    hidden: Tensor, weight: Tensor, tokens: Tensor, temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE, with_entropy: bool = False, entropy_grad: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Token log-probs (and entropy) straight from the last hidden states: the output layer
    (`weight` [V, H], no bias) is applied chunk by chunk, so no [rows, V] tensor larger than one
    chunk ever exists, in forward or backward (with gradients each chunk's logits are recomputed
    in backward: activation checkpointing). Up to `chunk_size` rows are one chunk, computed
    exactly as `compute_log_probs*` on the full logits.

    hidden: Tensor[N, H]; tokens: Tensor[N] (the caller shifts, as for compute_log_probs)
    returns (log_probs Tensor[N] float32, entropy Tensor[N] float32 or None unless `with_entropy`;
    with gradient only with `entropy_grad`)
    """
    n = tokens.shape[0]
    if n <= chunk_size:
        logits = F.linear(hidden, weight)
        if with_entropy and entropy_grad:
            return compute_log_probs_and_entropy(logits, tokens, temperature, chunk_size)
        log_probs = compute_log_probs(logits, tokens, temperature, chunk_size)
        if not with_entropy:
            return log_probs, None
        with torch.no_grad():
            return log_probs, compute_entropy(logits.detach(), temperature, chunk_size)

    def scores(h: Tensor, t: Tensor):
        if with_entropy and entropy_grad:
            return _chunk_both(F.linear(h, weight), t, temperature)
        return _chunk_log_probs(F.linear(h, weight), t, temperature)

    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    lps, ents = [], []
    for s in range(0, n, chunk_size):
        h, t = hidden[s : s + chunk_size], tokens[s : s + chunk_size]
        out = checkpoint(scores, h, t, use_reentrant=False, preserve_rng_state=False) if grad else scores(h, t)
        if with_entropy and entropy_grad:
            lps.append(out[0])
            ents.append(out[1])
            continue
        lps.append(out)
        if with_entropy:
            with torch.no_grad():
                ents.append(_chunk_entropy(F.linear(h.detach(), weight.detach()), temperature))
    return torch.cat(lps), (torch.cat(ents) if with_entropy else None)


# ---------------------------------------------------------------- policy losses
#
# Every entry of POLICY_LOSSES (and a `--custom-loss-function-path` hook, with `args` bound first)
# takes one `LossInputs` record of a micro-batch and returns (per_token_loss, clipfrac), Tensor[N]
# each; the trainer aggregates the per-token loss (see `aggregation_weights`).


@dataclass(frozen=True, kw_only=True)
class LossInputs:
    """One micro-batch's inputs to a policy loss, over its N concatenated response tokens
    (N = sum(response_lengths); a sample is never split across micro-batches).

    log_probs:        Tensor[N], the current policy's log-probs (carries the gradient)
    old_log_probs:    Tensor[N], the log-probs of the policy that generated the samples (the
                      ratio's denominator), no gradient
    advantages:       Tensor[N]
    loss_mask:        Tensor[N] of 0./1. (0: tokens without a loss, e.g. tool output); None: all 1
    response_lengths: list[int], the micro-batch's samples' lengths; None when unknown
    eps_clip:         the PPO clip range's lower side: ratio >= 1 - eps_clip
    eps_clip_high:    its upper side, ratio <= 1 + eps_clip_high (None: eps_clip)
    eps_clip_c:       dual-clip bound (> 1) for negative advantages, or None
    """

    log_probs: Tensor
    old_log_probs: Tensor
    advantages: Tensor
    loss_mask: Tensor | None = None
    response_lengths: list[int] | None = None
    eps_clip: float
    eps_clip_high: float | None = None
    eps_clip_c: float | None = None

    @property
    def clip_high(self) -> float:
        """eps_clip_high, or eps_clip when it is not set."""
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high


def ppo_policy_loss(inputs: LossInputs) -> tuple[Tensor, Tensor]:
    """PPO clipped surrogate with asymmetric clip range [1 - eps_clip, 1 + eps_clip_high].

    inputs: log_probs, old_log_probs, advantages Tensor[N] (per token), eps_clip(_high, _c)
    returns (per_token_loss Tensor[N], clipfrac Tensor[N] of 0./1.):
        ratio = exp(log_probs - old_log_probs)
        loss  = max(-A * ratio, -A * clip(ratio, 1 - eps_clip, 1 + eps_clip_high))
        clipfrac = 1 where the clipped term is strictly larger (the clip is active).
    Dual-clip (`eps_clip_c` > 1, arXiv 1912.09729): where A < 0 the loss is further
    capped at -A * eps_clip_c.
    """
    ratio = torch.exp(inputs.log_probs - inputs.old_log_probs)
    return _clipped_surrogate(ratio, inputs.advantages, inputs.eps_clip, inputs.clip_high, inputs.eps_clip_c)


def _clipped_surrogate(ratio, advantages, eps_clip, eps_clip_high, eps_clip_c):
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high)
    loss = torch.maximum(loss1, loss2)
    clipfrac = torch.gt(loss2, loss1).float()
    if eps_clip_c is not None:
        if eps_clip_c <= 1.0:
            raise ValueError(f"dual-clip PPO needs eps_clip_c > 1, got {eps_clip_c}")
        loss = torch.where(advantages < 0, torch.minimum(loss, -advantages * eps_clip_c), loss)
    return loss, clipfrac


def sequence_mean(values: Tensor, response_lengths: list[int], loss_mask: Tensor, reduce: str = "mean") -> Tensor:
    """Per-sequence masked mean (or sum, `reduce="sum"`), broadcast back to every token of the sequence.

    values, loss_mask: Tensor[N] (concatenated sequences); response_lengths: their lengths
    returns Tensor[N]: out[t] = sum_{s in seq(t)} values[s] * mask[s] / max(sum mask over seq(t), 1)
    """
    lengths = [int(n) for n in response_lengths]
    if sum(lengths) != values.numel():
        raise ValueError(f"sequence_mean: {values.numel()} tokens but response lengths sum to {sum(lengths)}")
    if not lengths:
        return values
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=values.device),
                                  torch.as_tensor(lengths, device=values.device))
    m = loss_mask.to(values.dtype)
    sums = torch.zeros(len(lengths), dtype=values.dtype, device=values.device).index_add(0, seq, values * m)
    if reduce == "sum":
        return sums[seq]
    counts = torch.zeros(len(lengths), dtype=values.dtype, device=values.device).index_add(0, seq, m)
    return (sums / counts.clamp(min=1.0))[seq]


def gspo_policy_loss(inputs: LossInputs) -> tuple[Tensor, Tensor]:
    """GSPO (arXiv 2507.18071): the PPO clip on a sequence-level ratio.

    s_i = exp(mean over sequence i's loss-mask tokens of (log_probs - old_log_probs)),
    used as the ratio of every token of sequence i (gradient flows to each token through
    the mean). Shapes as `ppo_policy_loss`; needs `response_lengths` (and uses `loss_mask`).
    With one-token sequences it is PPO.
    """
    if inputs.response_lengths is None:
        raise ValueError("gspo_policy_loss needs response_lengths")
    log_probs = inputs.log_probs
    mask = torch.ones_like(log_probs) if inputs.loss_mask is None else inputs.loss_mask
    ratio = torch.exp(sequence_mean(log_probs - inputs.old_log_probs, inputs.response_lengths, mask))
    return _clipped_surrogate(ratio, inputs.advantages, inputs.eps_clip, inputs.clip_high, inputs.eps_clip_c)


def cispo_policy_loss(inputs: LossInputs) -> tuple[Tensor, Tensor]:
    """CISPO (MiniMax-M1, arXiv 2506.13585): REINFORCE weighted by a clipped, stop-gradient ratio.

    loss = -sg(clip(ratio, 1 - eps_clip, 1 + eps_clip_high)) * A * log_probs; clipfrac = 1
    where the clip changed the ratio. Unlike PPO a clipped token still has gradient
    (-clip(ratio) * A); at ratio 1 the gradient equals PPO's (-A). Shapes as `ppo_policy_loss`.
    """
    ratio = torch.exp(inputs.log_probs - inputs.old_log_probs).detach()
    clipped = ratio.clamp(1.0 - inputs.eps_clip, 1.0 + inputs.clip_high)
    loss = -clipped * inputs.advantages * inputs.log_probs
    return loss, (clipped != ratio).float()


PolicyLoss = Callable[[LossInputs], tuple[Tensor, Tensor]]

POLICY_LOSSES: dict[str, PolicyLoss] = {
    "ppo": ppo_policy_loss,
    "gspo": gspo_policy_loss,
    "cispo": cispo_policy_loss,
}


# ---------------------------------------------------------------- value loss


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, value_clip: float | None) -> tuple[Tensor, Tensor]:
    """PPO clipped value loss (per token).

    values, old_values, returns: Tensor[N]
    returns (loss Tensor[N], clipfrac Tensor[N]):
        clipped = old + clamp(values - old, -value_clip, value_clip)
        loss    = max((values - R)^2, (clipped - R)^2)       (no clip when value_clip is None)
        clipfrac = 1 where |values - old| > value_clip
    """
    unclipped = (values - returns).square()
    if value_clip is None:
        return unclipped, torch.zeros_like(unclipped)
    clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
    loss = torch.maximum(unclipped, (clipped - returns).square())
    return loss, ((values - old_values).abs() > value_clip).float()


# ---------------------------------------------------------------- KL


KL_KINDS = ("k1", "k2", "k3", "low_var_kl")


def kl_penalty(log_probs: Tensor, ref_log_probs: Tensor, kind: str = "low_var_kl",
               importance_ratio: Tensor | None = None) -> Tensor:
    """Per-token estimate of KL(policy || ref) from sampled-token log-probs.

    log_probs, ref_log_probs: Tensor[N]  ->  Tensor[N] float32
      k1:  log p - log q
      k2:  (log p - log q)^2 / 2
      k3 / low_var_kl (Schulman's unbiased low-variance estimator, as in slime/verl):
           d = clamp(log q - log p, -20, 20);  exp(d) - d - 1, clamped to [-10, 10]
    importance_ratio: Tensor[N] or None (`--use-unbiased-kl`, DeepSeek-V3.2): the estimate is
      multiplied by it (before the k3 clamp), normally exp(log p - log p_old) with gradient
      through log p, so tokens sampled from the old policy estimate the current policy's KL.
    """
    log_ratio = log_probs.float() - ref_log_probs.float()
    if kind == "k1":
        kl = log_ratio
    elif kind == "k2":
        kl = log_ratio.square() / 2.0
    elif kind in ("k3", "low_var_kl"):
        d = (-log_ratio).clamp(-20.0, 20.0)
        kl = d.exp() - d - 1.0
    else:
        raise ValueError(f"unknown KL kind {kind!r} (choose from {', '.join(KL_KINDS)})")
    if importance_ratio is not None:
        kl = importance_ratio.float() * kl
    return kl.clamp(-10.0, 10.0) if kind in ("k3", "low_var_kl") else kl


# ---------------------------------------------------------------- truncated importance sampling
#
# A TIS function (the built-in `vanilla_tis`, or `--custom-tis-function-path`) has the signature
#     tis(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_mask, response_lengths)
#         -> (pg_loss Tensor[N], loss_mask Tensor[N], metrics dict[str, Tensor[N]])
# over the concatenated response tokens of one micro-batch (original slime's contract, per
# micro-batch). It returns the weighted per-token policy loss, the mask of tokens that keep a
# policy loss (0 rejects a token: its policy loss is dropped, the aggregation denominator is
# unchanged), and per-token metrics logged as loss-mask token means `train/<name>`.


def tis_weights(
    train_log_probs: Tensor,
    rollout_log_probs: Tensor,
    clip: float,
    clip_low: float = 0.0,
    level: str = "token",
    response_lengths: list[int] | None = None,
    loss_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Truncated importance-sampling weights against the engine's log-probs (no gradient).

    train_log_probs:   Tensor[N], the trainer's log-probs under the policy that generated the
                       rollout (the old log-probs), detached
    rollout_log_probs: Tensor[N], the engine's log-probs of the same tokens
    level: token:     ratio_t = exp(train_t - rollout_t)
           sequence:  every token of sequence i gets prod over its loss-mask tokens of ratio_t
           geometric: ... the geometric mean of those ratios (exp of the masked mean log-ratio)
    returns (weights Tensor[N] = clamp(ratio, clip_low, clip), ratio Tensor[N]), float32.
    """
    log_ratio = (train_log_probs.detach().float() - rollout_log_probs.detach().float())
    if level != "token":
        if response_lengths is None:
            raise ValueError(f"tis level {level!r} needs response_lengths")
        if level not in ("sequence", "geometric"):
            raise ValueError(f"unknown tis level {level!r} (token, sequence, geometric)")
        mask = torch.ones_like(log_ratio) if loss_mask is None else loss_mask.float()
        if level == "sequence":
            log_ratio = sequence_mean(log_ratio, response_lengths, mask, reduce="sum")
        else:
            log_ratio = sequence_mean(log_ratio, response_lengths, mask)
    ratio = log_ratio.clamp(max=80.0).exp()
    return ratio.clamp(clip_low, clip), ratio


def vanilla_tis(args, *, pg_loss: Tensor, train_log_probs: Tensor, rollout_log_probs: Tensor,
                loss_mask: Tensor, response_lengths: list[int], **_: object):
    """The built-in TIS function (`--use-tis`): pg_loss * tis_weights(...) with `--tis-clip`,
    `--tis-clip-low`, `--tis-level`; the mask is unchanged. Metrics: tis (the raw ratio),
    tis_weight, tis_clipfrac (the clip changed the ratio), tis_abs (|ratio - 1|)."""
    w, ratio = tis_weights(train_log_probs, rollout_log_probs, args.tis_clip, args.tis_clip_low,
                           args.tis_level, response_lengths, loss_mask)
    metrics = {"tis": ratio, "tis_weight": w, "tis_clipfrac": (w != ratio).float(), "tis_abs": (ratio - 1).abs()}
    return pg_loss * w, loss_mask, metrics


# ---------------------------------------------------------------- SFT


def sft_loss(log_probs: Tensor) -> Tensor:
    """Negative log-likelihood per token: log_probs Tensor[N] -> Tensor[N]. Aggregated over the
    loss-mask tokens with `--loss-agg-mode`, like the policy losses (`--loss-type sft_loss`)."""
    return -log_probs


# ---------------------------------------------------------------- aggregation


def masked_sum(values: Tensor, mask: Tensor) -> Tensor:
    """sum(values * mask). values, mask: Tensor[N] (same shape)  ->  scalar."""
    return (values * mask.to(values.dtype)).sum()


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """sum(values * mask) / max(sum(mask), 1). values, mask: Tensor[N]  ->  scalar (0 if the mask is empty)."""
    return masked_sum(values, mask) / mask.to(values.dtype).sum().clamp(min=1.0)


def token_mean_over(values: Tensor, mask: Tensor, total_tokens: float | Tensor) -> Tensor:
    """Token-mean across a larger batch: sum(values * mask) / total_tokens.

    Used for micro-batches: summing this over every micro-batch (and rank) of a step
    gives the step's token-mean, independent of how the step was split.
    """
    return masked_sum(values, mask) / max(float(total_tokens), 1.0)


LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def aggregation_weights(
    loss_masks: list[Tensor], mode: str, total_tokens: float, total_samples: int, max_response_len: int | None = None
) -> list[Tensor]:
    """Per-token weights w such that a step's loss is sum over its tokens of w * per_token_loss.

    loss_masks:    the masks (Tensor[L_i]) of the samples of one step on this rank
    total_tokens:  sum of loss-mask tokens of the whole step (all ranks)
    total_samples: samples in the whole step (all ranks)
      token-mean:              w = mask / total_tokens              (every token counts the same)
      seq-mean-token-mean:     w = mask / (sum(mask_i) * total_samples)   (every sequence counts the same)
      seq-mean-token-sum-norm: w = mask / (max_response_len * total_samples)   (Dr. GRPO)
    Weights depend only on the sample and step totals, so the loss and its gradient are
    independent of how the step is split into micro-batches and ranks.
    """
    out = []
    for m in loss_masks:
        m = m.to(torch.float32)
        if mode == "token-mean":
            out.append(m / max(float(total_tokens), 1.0))
        elif mode == "seq-mean-token-mean":
            out.append(m / (max(float(m.sum()), 1.0) * max(total_samples, 1)))
        elif mode == "seq-mean-token-sum-norm":
            if not max_response_len:
                raise ValueError("seq-mean-token-sum-norm needs max_response_len")
            out.append(m / (float(max_response_len) * max(total_samples, 1)))
        else:
            raise ValueError(f"unknown loss aggregation {mode!r} (choose from {', '.join(LOSS_AGG_MODES)})")
    return out
