"""Mixture-of-experts training on Hugging Face MoE models: the routers' load-balancing loss, expert
usage per layer, and routing replay in the policy's forwards (slime.utils.moe_routing holds the hook).

`TrainRouting(model, aux_coef)` lives in a train backend. Around each policy forward of a micro-batch
`with routing.forward(mb.routed_experts, *backend.routing_layout(mb)) as rec:` does what the run asks:
- replay: the micro-batch carries routed experts per sample (`mb.routed_experts`: Tensor[T_i - 1, L, K]
  for a sample of T_i tokens: the engine's with --use-rollout-routing-replay, the old-policy
  forward's with --use-routing-replay); they are laid out like the forward's tokens (`replay_rows`)
  and forced on every MoE layer. Positions with nothing recorded (padding, each sample's last
  token, whose output scores nothing) keep the router's own choice;
- record: what the routers chose (or were made to use), for the load-balancing loss and the usage
  metrics of a training forward (`training_forward`) and R2's recording (`recorded_per_sample`).
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch
from torch import Tensor

from slime.utils.moe_routing import RoutingHook, expert_usage, load_balancing_loss, usage_metrics


def replay_rows(routed: Sequence[Tensor | None], lens: Sequence[int], packed: bool, width: int | None = None,
                num_layers: int = 0, top_k: int = 0) -> Tensor:
    """The experts to force for every token of one forward, Tensor[rows, L, K] int32 (-1: the router's
    own choice), from each sample's recorded experts (Tensor[<= T_i - 1, L, K] or, as the engine
    returns them, [<= T_i - 1, L * K]; or None).

    packed: one row of all samples back to back (rows = sum(lens)); else a batch right-padded to
    `width` tokens (rows = len(lens) x width), flattened in (sample, position) order, as the routers
    see it."""
    per_sample = []
    for r, n in zip(routed, lens):
        rows = torch.full((n if packed else width, num_layers, top_k), -1, dtype=torch.int32)
        if r is not None:
            if r.dim() == 2:  # as the engine returns them: [tokens, L * K]
                if r.shape[1] != num_layers * top_k:
                    raise ValueError(f"routing replay: {r.shape[1]} expert ids per token, but the model has "
                                     f"{num_layers} MoE layers x top-k {top_k}")
                r = r.reshape(r.shape[0], num_layers, top_k)
            m = min(int(r.shape[0]), n)
            rows[:m] = r[:m].to(torch.int32)
        per_sample.append(rows)
    return torch.cat(per_sample, dim=0)


def per_sample(indices: Tensor, lens: Sequence[int], packed: bool, width: int | None = None) -> list[Tensor]:
    """The inverse of `replay_rows`: each sample's experts of its first T_i - 1 tokens, from a forward's
    Tensor[rows, L, K]."""
    out, offset = [], 0
    for n in lens:
        out.append(indices[offset: offset + n - 1].clone())
        offset += n if packed else width
    return out


class TrainRouting:
    """The MoE side of one train rank's policy model (see the module docstring); `enabled` is False for a
    dense model, and then `forward` does nothing."""

    def __init__(self, model: torch.nn.Module, aux_coef: float = 0.0):
        self.hook = RoutingHook(model)
        self.enabled = self.hook.num_layers > 0
        self.aux_coef = float(aux_coef)
        self.usage: Tensor | None = None  # [L, E] routed-slot counts since the last `take_metrics`
        self.model_layers = self.hook.num_layers  # rows of the usage and of the replayed experts

    @contextlib.contextmanager
    def forward(self, routed: Sequence[Tensor | None] | None, lens: Sequence[int], packed: bool,
                width: int | None = None):
        """Around one policy forward: replays `routed` when given (see `replay_rows`), records what
        was used; yields the Recording (None for a dense model)."""
        if not self.enabled:
            yield None
            return
        if routed is not None:
            rows = replay_rows(routed, lens, packed, width, self.model_layers, self.hook.top_k)
            with self.hook.replaying(rows) as rec:
                yield rec
        else:
            with self.hook.recording() as rec:
                yield rec

    def training_forward(self, rec, lens: Sequence[int], packed: bool, width: int | None = None) -> Tensor | None:
        """After a training forward (recorded in `rec`): count its experts for the usage metrics and
        return `aux_coef` x its load-balancing loss over the real tokens (None when off or dense)."""
        if not self.enabled or rec is None or not rec.calls:
            return None
        mask = _real_tokens(lens, packed, width)
        indices = rec.indices()
        counts = expert_usage(indices, self.hook.num_experts, mask) * float(mask.sum())
        self.usage = counts if self.usage is None else self.usage + counts
        if self.aux_coef == 0:
            return None
        return self.aux_coef * load_balancing_loss(rec.logits(), indices, self.hook.num_experts, mask)

    def recorded_per_sample(self, rec, lens: Sequence[int], packed: bool, width: int | None = None) -> list[Tensor]:
        """Each sample's experts in the forward of `rec` (R2: the old-policy forward's routing)."""
        return per_sample(rec.indices(), lens, packed, width)

    def take_metrics(self, reduce=None) -> dict[str, float]:
        """Expert usage per MoE layer of the training forwards since the last call
        (`moe/layer_<i>/max_load`, `/experts_used`); `reduce` sums the counts over the train ranks."""
        if not self.enabled:
            return {}
        usage = self.usage if self.usage is not None else torch.zeros(self.model_layers, self.hook.num_experts)
        self.usage = None
        if reduce is not None:
            usage = reduce(usage)
        if float(usage.sum()) == 0:
            return {}
        return usage_metrics(usage / usage.sum(dim=-1, keepdim=True).clamp_min(1.0))


def _real_tokens(lens: Sequence[int], packed: bool, width: int | None) -> Tensor:
    if packed:
        return torch.ones(sum(lens), dtype=torch.bool)
    mask = torch.zeros(len(lens), width, dtype=torch.bool)
    for i, n in enumerate(lens):
        mask[i, :n] = True
    return mask.reshape(-1)
