"""Loss pieces: token log-probs and entropy from logits, PPO policy loss, KL penalties,
masked aggregation. Pure tensor functions; shapes are in the docstrings.

Memory: `compute_log_probs` / `compute_entropy` never materialize a full-vocabulary
fp32 log-softmax for the whole input. They walk the rows in chunks of `chunk_size`
positions; when gradients are needed each chunk is recomputed in backward
(activation checkpointing), so the autograd graph keeps only the input logits (a
view) plus O(rows) results, never a second [rows, vocab] copy.
"""

from __future__ import annotations

from typing import Callable

import torch
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


def _run_chunked(fn: Callable, logits: Tensor, extra: Tensor | None, temperature: float, chunk_size: int):
    flat = _rows(logits)
    flat_extra = extra.reshape(-1) if extra is not None else None
    n = flat.shape[0]
    use_ckpt = torch.is_grad_enabled() and flat.requires_grad
    outs = []
    for s in range(0, n, max(1, chunk_size)):
        args = (flat[s : s + chunk_size],) + ((flat_extra[s : s + chunk_size],) if flat_extra is not None else ())
        args = args + (temperature,)
        outs.append(checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False) if use_ckpt else fn(*args))
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
    outs = _run_chunked(_chunk_log_probs, logits, tokens, temperature, chunk_size)
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


# ---------------------------------------------------------------- policy losses


def ppo_policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    eps_clip: float,
    eps_clip_high: float | None = None,
) -> tuple[Tensor, Tensor]:
    """PPO clipped surrogate with asymmetric clip range [1 - eps_clip, 1 + eps_clip_high].

    log_probs, old_log_probs, advantages: Tensor[N] (per token)
    returns (per_token_loss Tensor[N], clipfrac Tensor[N] of 0./1.):
        ratio = exp(log_probs - old_log_probs)
        loss  = max(-A * ratio, -A * clip(ratio, 1 - eps_clip, 1 + eps_clip_high))
        clipfrac = 1 where the clipped term is strictly larger (the clip is active).
    """
    if eps_clip_high is None:
        eps_clip_high = eps_clip
    ratio = torch.exp(log_probs - old_log_probs)
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high)
    loss = torch.maximum(loss1, loss2)
    clipfrac = torch.gt(loss2, loss1).float()
    return loss, clipfrac


def policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    eps_clip: float,
    eps_clip_high: float | None = None,
) -> tuple[Tensor, Tensor]:
    """The default policy loss (PPO clip); see `ppo_policy_loss`."""
    return ppo_policy_loss(log_probs, old_log_probs, advantages, eps_clip, eps_clip_high)


POLICY_LOSSES: dict[str, Callable[..., tuple[Tensor, Tensor]]] = {
    "ppo": ppo_policy_loss,
}


# ---------------------------------------------------------------- KL


KL_KINDS = ("k1", "k2", "k3", "low_var_kl")


def kl_penalty(log_probs: Tensor, ref_log_probs: Tensor, kind: str = "low_var_kl") -> Tensor:
    """Per-token estimate of KL(policy || ref) from sampled-token log-probs.

    log_probs, ref_log_probs: Tensor[N]  ->  Tensor[N] float32
      k1:  log p - log q
      k2:  (log p - log q)^2 / 2
      k3 / low_var_kl (Schulman's unbiased low-variance estimator, as in slime/verl):
           d = clamp(log q - log p, -20, 20);  exp(d) - d - 1, clamped to [-10, 10]
    """
    log_ratio = log_probs.float() - ref_log_probs.float()
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return log_ratio.square() / 2.0
    if kind in ("k3", "low_var_kl"):
        d = (-log_ratio).clamp(-20.0, 20.0)
        return (d.exp() - d - 1.0).clamp(-10.0, 10.0)
    raise ValueError(f"unknown KL kind {kind!r} (choose from {', '.join(KL_KINDS)})")


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
