"""Mixture-of-experts routing of Hugging Face models, observed and replayed: one hook for the
engine and every trainer.

A Hugging Face MoE layer (Qwen3-MoE, Qwen2-MoE, Mixtral and the families built the same way) asks
its router for `(router_logits [N, E], top-k weights [N, K], top-k expert ids [N, K])` over the N
tokens of the forward, flattened in (batch, position) order. `RoutingHook(model)` wraps every such
router once; each forward then runs in one of three modes:

- plain: the router's own choice (the hook costs nothing but a Python call);
- `recording()`: the router's choice, kept per layer (`Recording.indices()`: Tensor[N, L, K] int32,
  L the MoE layers in model order; `Recording.logits`: the router logits, for the load-balancing
  loss and the expert usage);
- `replaying(indices)`: the experts given (Tensor[N, L, K]; a row of -1 keeps the router's own
  choice) are used instead of the router's top-k; their weights are the router's softmax
  probabilities of those experts, renormalized exactly as the router renormalizes its own
  (`norm_topk_prob`, always for Mixtral), so gradients reach the router as in a normal forward.
  What the forward used is recorded too, so a caller can check it.

Rollout routing replay (R3, `--use-rollout-routing-replay`): the engine records, the trainer
replays the engine's experts. Routing replay (R2, `--use-routing-replay`): the trainer's old-policy
forward records, its policy forwards replay.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def is_router(module: nn.Module) -> bool:
    """A Hugging Face top-k router: `top_k`, `num_experts` and a `weight` of [experts, hidden]."""
    return (type(module).__name__.endswith("TopKRouter") and hasattr(module, "top_k")
            and hasattr(module, "num_experts") and isinstance(getattr(module, "weight", None), torch.Tensor))


def routers(model: nn.Module) -> list[nn.Module]:
    """The model's routers in layer order (empty for a dense model)."""
    return [m for m in model.modules() if is_router(m)]


@dataclass
class Recording:
    """What the routers chose during the forwards of one `recording()` (or `replaying()`) block:
    per forward call, per MoE layer, the expert ids [N, K] and router logits [N, E]."""

    calls: list[list[tuple[Tensor, Tensor]]] = field(default_factory=list)

    def _add(self, layer: int, idx: Tensor, logits: Tensor) -> None:
        if layer == 0 or not self.calls:
            self.calls.append([])
        self.calls[-1].append((idx, logits))

    def indices(self, call: int = -1) -> Tensor:
        """Tensor[N, L, K] int32: the experts of every token of forward `call` at every MoE layer."""
        return torch.stack([idx for idx, _ in self.calls[call]], dim=1).to(torch.int32)

    def logits(self, call: int = -1) -> list[Tensor]:
        """The router logits [N, E] of every MoE layer of forward `call` (with their graph)."""
        return [lg for _, lg in self.calls[call]]


class RoutingHook:
    """Wraps every router of `model` (see the module docstring). Safe to build once per model; a
    model without routers gets a hook that does nothing (`self.num_layers == 0`)."""

    def __init__(self, model: nn.Module):
        self.routers = routers(model)
        self.num_layers = len(self.routers)
        self.top_k = int(self.routers[0].top_k) if self.routers else 0
        self.num_experts = int(self.routers[0].num_experts) if self.routers else 0
        self._recording: Recording | None = None
        self._replay: Tensor | None = None
        for layer, router in enumerate(self.routers):
            if getattr(router, "_slime_routing_hook", None) is not None:
                raise RuntimeError("a RoutingHook is already installed on this model")
            router._slime_routing_hook = self
            router.forward = self._wrap(router, router.forward, layer)

    def _wrap(self, router: nn.Module, forward, layer: int):
        normalizes = bool(getattr(router, "norm_topk_prob", True))  # Mixtral's router always renormalizes

        def routed(hidden_states: Tensor):
            logits, scores, idx = forward(hidden_states)
            if self._replay is not None:
                given = self._replay[:, layer, :].to(device=idx.device, dtype=idx.dtype)
                if given.shape != idx.shape:
                    raise ValueError(f"routing replay: layer {layer} has {tuple(idx.shape)} routed slots in this "
                                     f"forward, the replayed experts {tuple(given.shape)}")
                idx = torch.where(given >= 0, given, idx)
                top = F.softmax(logits.float(), dim=-1).gather(-1, idx.long())
                if normalizes:
                    top = top / top.sum(dim=-1, keepdim=True)
                scores = top.to(scores.dtype)
            if self._recording is not None:
                self._recording._add(layer, idx.detach(), logits)
            return logits, scores, idx

        return routed

    @contextlib.contextmanager
    def recording(self):
        """Forwards in this block keep what every router chose: yields a `Recording`."""
        rec = self._recording = Recording()
        try:
            yield rec
        finally:
            self._recording = None

    @contextlib.contextmanager
    def replaying(self, indices: Tensor, record: bool = True):
        """Forwards in this block use `indices` (Tensor[N, L, K], -1: the router's own choice) for
        their N flattened tokens; yields the `Recording` of what was used (None with record=False)."""
        if indices.dim() != 3 or indices.shape[1] != self.num_layers or indices.shape[2] != self.top_k:
            raise ValueError(f"routing replay needs experts of shape [tokens, {self.num_layers} MoE layers, "
                             f"top-k {self.top_k}], got {tuple(indices.shape)}")
        self._replay = indices
        rec = Recording() if record else None
        self._recording = rec
        try:
            yield rec
        finally:
            self._replay = None
            self._recording = None


def load_balancing_loss(logits: list[Tensor], indices: Tensor, num_experts: int, mask: Tensor | None = None) -> Tensor:
    """The Switch-Transformer load-balancing loss as Hugging Face computes it (`load_balancing_loss_func`,
    the models' `router_aux_loss_coef` term): over the tokens kept by `mask` (Tensor[N] bool; None:
    all) and every MoE layer together, `E * sum_e f_e * P_e` where f_e is the share of routed slots
    that went to expert e and P_e the mean router probability of e.

    logits: per layer Tensor[N, E]; indices: Tensor[N, L, K]. Returns a scalar with the logits' graph."""
    probs = torch.cat([F.softmax(lg.float(), dim=-1) for lg in logits], dim=0)  # [L*N, E]
    idx = indices.transpose(0, 1).reshape(-1, indices.shape[-1]).long()  # [L*N, K], layer-major like probs
    chosen = F.one_hot(idx, num_experts).float()  # [L*N, K, E]
    if mask is not None:
        keep = mask.to(probs.device).bool().repeat(len(logits))
        probs, chosen = probs[keep], chosen[keep]
    if probs.shape[0] == 0:
        return logits[0].sum() * 0.0
    tokens_per_expert = chosen.mean(dim=0)  # [K, E]
    prob_per_expert = probs.mean(dim=0)  # [E]
    return (tokens_per_expert * prob_per_expert.unsqueeze(0)).sum() * num_experts


def expert_usage(indices: Tensor, num_experts: int, mask: Tensor | None = None) -> Tensor:
    """Tensor[L, E]: the share of each layer's routed slots each expert received (rows sum to 1)."""
    idx = indices.long()
    if mask is not None:
        idx = idx[mask.to(idx.device).bool()]
    counts = F.one_hot(idx, num_experts).sum(dim=(0, 2)).float()  # [L, E]
    return counts / counts.sum(dim=-1, keepdim=True).clamp_min(1.0)


def usage_metrics(usage: Tensor) -> dict[str, float]:
    """Per MoE layer: `moe/layer_<i>/max_load`, the busiest expert's share x E (1.0 when perfectly
    balanced, E when one expert takes every token), and `moe/layer_<i>/experts_used` (experts that
    received any token)."""
    e = usage.shape[-1]
    out = {}
    for i, row in enumerate(usage):
        out[f"moe/layer_{i}/max_load"] = float(row.max()) * e
        out[f"moe/layer_{i}/experts_used"] = float((row > 0).sum())
    return out


def encode(indices: Tensor) -> bytes:
    """Tensor[N, L, K] -> int32 bytes (row-major), SGLang's `routed_experts` payload before base64."""
    return indices.to(torch.int32).contiguous().cpu().numpy().tobytes()


def decode(data: bytes, num_layers: int, top_k: int) -> Tensor:
    """The inverse of `encode`: Tensor[N, L, K] int32."""
    flat = torch.frombuffer(bytearray(data), dtype=torch.int32)
    per_row = num_layers * top_k
    if per_row == 0 or flat.numel() % per_row:
        raise ValueError(f"routed experts: {flat.numel()} ids are not rows of {num_layers} layers x top-k {top_k}")
    return flat.reshape(-1, num_layers, top_k)
