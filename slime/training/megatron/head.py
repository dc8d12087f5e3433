"""`--log-probs-chunk-size` on the megatron backend: log-probs and entropy straight from the last
hidden states, the (vocabulary-parallel) output layer applied chunk by chunk, so no
[tokens, vocabulary] tensor of a whole micro-batch exists, in forward or backward. The FSDP
backend does the same through `slime.algorithms.losses.log_probs_from_hidden`.

While `OutputHead.hidden_states(model)` is active, the model's output layer hands back its input
instead of logits, prepared as megatron's `ColumnParallelLinear` prepares it: under sequence
parallelism gathered over the TP group (its backward reduce-scatters), else under TP passed on
unchanged with a backward that all-reduces (each rank's vocabulary shard gives part of the hidden
state's gradient). The model then returns [b, s, H] on every TP rank. (Not megatron's
`copy_to_tensor_model_parallel_region`: its backward all-reduces `grad.contiguous()` and returns
`grad`, so a non-contiguous gradient - GPTModel transposes its output - is silently not summed.)

`OutputHead.scores` takes the response positions' rows and, `chunk_size` rows at a time, this
rank's vocabulary shard of their logits ([rows, V / TP], fp32, / temperature; rows past the real
vocabulary dropped), and combines the shards with sums over the TP group:
    lse = max + log(sum over ranks of sum(exp(x - max)))
    log p(token) = x[token] (from the rank that holds it) - lse
    entropy = lse - sum over ranks of sum(softmax * x)
`_ShardScores` keeps only the rows' hidden states and lse (and entropy) and computes its backward
by hand, one chunk's logits at a time, with no collective: d log p / dx = onehot - p and
d entropy / dx = -p (x - lse + entropy) on this rank's shard. The hidden state's gradient is then
partial (this shard's vocabulary): the TP region's backward above sums it, and every TP rank
back-propagates the same upstream gradient (the backend's TP rule). (Recomputing each chunk with
activation checkpointing would repeat the forward's TP collectives inside backward, where the ranks'
graphs need not unpack them in the same order: a rank whose shard is all padding saved nothing.)
The numbers are those of the full logits up to summation order
(tests/unit/training/test_megatron_backend.py compares them).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import mappings
from torch import Tensor


def output_weight(model) -> Tensor:
    """The weight the last stage's output layer multiplies by (the embedding's when tied)."""
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight


class OutputHead:
    """Log-probs (and entropy) of response tokens from hidden states (see the module docstring)."""

    def __init__(self, vocab_size: int, temperature: float, chunk_size: int):
        self.vocab_size, self.temperature, self.chunk_size = vocab_size, temperature, chunk_size
        self.tp = ps.get_tensor_model_parallel_world_size()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.tp_group = ps.get_tensor_model_parallel_group()

    @contextlib.contextmanager
    def hidden_states(self, model) -> Iterator[None]:
        """Inside, `model(...)` (a last pipeline stage) returns the hidden states its output layer
        would see, [b, s, H], whole on every TP rank."""
        layer = model.output_layer

        def hand_back(hidden: Tensor, weight: Tensor | None = None, runtime_gather_output=None):
            if layer.sequence_parallel:
                hidden = mappings.gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True)
            elif self.tp > 1:
                hidden = _SumGradOverTP.apply(hidden, self.tp_group)
            return hidden, None

        layer.forward = hand_back
        try:
            yield
        finally:
            del layer.forward

    def scores(self, hidden: Tensor, weight: Tensor, ids: Tensor, prompt_lens: list[int], lengths: list[int], *,
               with_entropy: bool, entropy_grad: bool) -> tuple[list[Tensor], list[Tensor | None]]:
        """Per-sample log-probs (and entropy) of the response tokens, lists of Tensor[r_i] (fp32), as
        `pipeline.response_scores` gives them from the full logits: response token t is scored by
        the hidden state at position t - 1."""
        rows = torch.cat([hidden[i, p - 1 : p - 1 + r] for i, (p, r) in enumerate(zip(prompt_lens, lengths))])
        targets = torch.cat([ids[i, p : p + r] for i, (p, r) in enumerate(zip(prompt_lens, lengths))])
        lps, ents = [], []
        for s in range(0, max(1, rows.shape[0]), self.chunk_size):
            h, t = rows[s : s + self.chunk_size], targets[s : s + self.chunk_size]
            start = self.tp_rank * weight.shape[0]
            real = max(0, min(weight.shape[0], self.vocab_size - start))  # this shard's rows of the real vocabulary
            lp, ent = _ShardScores.apply(h, weight[:real], t - start, self.temperature, with_entropy,
                                         with_entropy and entropy_grad, self.tp_group if self.tp > 1 else None)
            lps.append(lp)
            if with_entropy:
                ents.append(ent if entropy_grad else ent.detach())
        lp = torch.cat(lps)
        if torch.is_grad_enabled() and not rows.shape[0]:
            lp = lp + 0.0 * hidden.sum()  # no response token: keep the graph (and its TP collectives) connected
        lp_parts = list(lp.split(lengths))
        ent_parts = list(torch.cat(ents).split(lengths)) if with_entropy else [None] * len(lengths)
        return lp_parts, ent_parts


class _SumGradOverTP(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the TP group."""

    @staticmethod
    def forward(ctx, x: Tensor, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.clone(memory_format=torch.contiguous_format)  # not in place: autograd may share it
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _scaled_logits(h: Tensor, weight: Tensor, temperature: float) -> Tensor:
    x = F.linear(h, weight).float()
    return x / temperature if temperature not in (None, 0, 1, 1.0) else x


class _ShardScores(torch.autograd.Function):
    """(log p(target), entropy) of a chunk of rows from this rank's vocabulary shard `weight` [V_r, H]
    (`local`: the targets' indices in the shard; outside [0, V_r) another rank holds them); the
    entropy carries a gradient only with `entropy_grad`. Forward sums over the TP `group` (None: one
    rank); backward is local (see the module docstring)."""

    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor, local: Tensor, temperature: float, with_entropy: bool,
                entropy_grad: bool, group):
        x = _scaled_logits(h, weight, temperature)
        mine = (local >= 0) & (local < x.shape[-1])
        top = x.max(-1).values if x.shape[-1] else torch.full(local.shape, -torch.inf, device=x.device)
        picked = torch.where(mine, x.gather(-1, local.clamp(0, max(x.shape[-1] - 1, 0)).unsqueeze(-1)).squeeze(-1),
                             torch.zeros_like(top)) if x.shape[-1] else torch.zeros_like(top)
        if group is not None:
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        sums = torch.stack([(x - top.unsqueeze(-1)).exp().sum(-1), picked])
        if group is not None:
            dist.all_reduce(sums, group=group)
        lse = top + sums[0].log()
        lp = sums[1] - lse
        ent = None
        if with_entropy:
            expected = ((x - lse.unsqueeze(-1)).exp() * x).sum(-1)
            if group is not None:
                dist.all_reduce(expected, group=group)
            ent = lse - expected
        ctx.save_for_backward(h, weight, local, lse, *((ent,) if entropy_grad else ()))
        ctx.temperature = temperature
        return lp, (ent if ent is not None else torch.zeros_like(lp))

    @staticmethod
    def backward(ctx, g_lp: Tensor, g_ent: Tensor):
        h, weight, local, lse, *entropy = ctx.saved_tensors  # the entropy when it carries a gradient
        x = _scaled_logits(h, weight, ctx.temperature)
        p = (x - lse.unsqueeze(-1)).exp()
        dx = -g_lp.unsqueeze(-1) * p
        mine = (local >= 0) & (local < x.shape[-1])
        if x.shape[-1]:
            dx.scatter_add_(-1, local.clamp(0, x.shape[-1] - 1).unsqueeze(-1), (g_lp * mine).unsqueeze(-1))
        if entropy:
            dx = dx - g_ent.unsqueeze(-1) * p * (x - lse.unsqueeze(-1) + entropy[0].unsqueeze(-1))
        if ctx.temperature not in (None, 0, 1, 1.0):
            dx = dx / ctx.temperature
        dx = dx.to(h.dtype)
        grad_h = dx @ weight if ctx.needs_input_grad[0] else None
        grad_w = dx.t() @ h if ctx.needs_input_grad[1] else None
        return grad_h, grad_w, None, None, None, None, None
