"""Pipeline parallelism for the megatron backend: megatron-core's own schedules (1F1B, and the
interleaved one with virtual stages) driven with slime's per-sample RL loss.

The micro-batches. As under tensor parallelism, every train rank keeps its own samples. The
ranks of one model-parallel group (TP x PP) run one pipeline over the concatenation of their
k-th micro-batches, in group-rank order (`gather_group_micro_batches`).

Two passes per optimizer step. slime's loss of a sample is computed by the rank that owns it
(`loss_fn` closes over that rank's advantages, old log-probs, masks and step weights), but the
log-probs exist only on the last stage, inside the schedule, where the other stages wait in
pipeline sends and receives: a round trip to the owners there would deadlock. So:

1. a forward-only pass through the schedule gives every sample's log-probs (and entropy) on the
   last stage, which broadcasts them over the pipeline; each rank evaluates its own samples'
   loss and its gradient d loss / d log-prob (and d loss / d entropy) at those values, and the
   group sums the gradients (disjoint slices);
2. the forward-backward schedule then back-propagates the surrogate sum(log_prob x gradient)
   from the last stage: its parameter gradient is exactly the chain rule of every sample's loss,
   because the model is deterministic (no dropout), so pass 2's log-probs equal pass 1's.

This costs one extra forward per step. megatron's loss scaling is switched off for it
(`calculate_per_token_loss`: the surrogate is returned unscaled; slime's loss already carries
its token weights). Gradient reduction over data-parallel ranks and the tied embedding stays
with the backend (`grads.py`).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func
from torch import Tensor

from slime.algorithms.losses import compute_entropy, compute_log_probs, compute_log_probs_and_entropy
from slime.training.megatron import shims
from slime.training.megatron.head import output_weight

# a micro-batch of the group: (token lists, response lengths)
GroupBatch = tuple[list[list[int]], list[int]]
# a one-sample filler (one prompt and one response token, zero upstream gradient): the interleaved
# schedule needs a number of micro-batches that is a multiple of the pipeline size
FILLER: GroupBatch = ([[0, 0]], [1])


def batch_inputs(tokens: list[list[int]], lengths: list[int], device, shape: tuple[int, int] | None = None,
                 seq_multiple: int = 1) -> tuple[Tensor, Tensor, Tensor, list[int]]:
    """(ids [b, t], positions [b, t], causal mask, prompt lengths) of right-padded samples; `shape`:
    pad to [B, T] (rows of zeros after the samples); the length padded to a multiple of `seq_multiple`
    (the TP size under sequence parallelism, which splits the sequence over the TP ranks)."""
    lens = [len(t) for t in tokens]
    prompt_lens = [n - r for n, r in zip(lens, lengths)]
    for i, (p, r) in enumerate(zip(prompt_lens, lengths)):
        if p < 1 or r < 0:
            raise ValueError(f"sample {i} of the micro-batch: {lens[i]} tokens, response length {r} "
                             "(a response needs at least one prompt token before it)")
    b, t = shape or (len(lens), max(lens))
    t = -(-t // seq_multiple) * seq_multiple
    # right padding under a causal mask: no real token attends to a pad, so no padding mask
    ids = torch.zeros((b, t), dtype=torch.long)
    for i, toks in enumerate(tokens):
        ids[i, : lens[i]] = torch.as_tensor(toks, dtype=torch.long)
    ids = ids.to(device)
    pos = torch.arange(t, device=device).unsqueeze(0).expand(b, t)
    return ids, pos, shims.causal_mask(t, device), prompt_lens


def response_scores(logits: Tensor, ids: Tensor, prompt_lens: list[int], lengths: list[int], temperature: float,
                    *, with_entropy: bool, entropy_grad: bool) -> tuple[list[Tensor], list[Tensor | None]]:
    """Per-sample log-probs (and entropy) of the response tokens, lists of Tensor[r_i]; response
    token t is scored by the logits at position t - 1 (`logits` trimmed to the real vocabulary)."""
    lps, ents = [], []
    for i, (p, r) in enumerate(zip(prompt_lens, lengths)):
        lg, tgt = logits[i, p - 1 : p - 1 + r], ids[i, p : p + r]
        if with_entropy and entropy_grad:
            lp, ent = compute_log_probs_and_entropy(lg, tgt, temperature)
        else:
            lp = compute_log_probs(lg, tgt, temperature)
            ent = None
            if with_entropy:
                with torch.no_grad():
                    ent = compute_entropy(lg.detach(), temperature)
        if r == 0 and torch.is_grad_enabled():
            lp = lp + 0.0 * logits[i].sum()  # keep the graph (and its TP collectives) connected
        lps.append(lp)
        ents.append(ent)
    return lps, ents


def gather_group_micro_batches(mb_tokens: list[list[int]], mb_lengths: list[int],
                               group) -> tuple[list[list[int]], list[int], int, int]:
    """The group's micro-batches concatenated in group-rank order, and this rank's sample range."""
    size = dist.get_world_size(group)
    if size == 1:
        return mb_tokens, mb_lengths, 0, len(mb_tokens)
    parts: list = [None] * size
    dist.all_gather_object(parts, (mb_tokens, mb_lengths), group=group)
    me = dist.get_rank(group)
    start = sum(len(p[0]) for p in parts[:me])
    return [t for p in parts for t in p[0]], [r for p in parts for r in p[1]], start, start + len(mb_tokens)


class Pipeline:
    """Runs micro-batches through this rank's model chunks with megatron's schedule. `scores`: what
    the last stage's output is scored as, per micro-batch, `(out, ids, prompt_lens, lens, *,
    with_entropy, entropy_grad) -> (per-sample Tensors, per-sample entropies or Nones)`; default
    the response tokens' log-probs (and entropy) at `temperature` (the critic: its values).
    `before_forward(k, lens, (b, t), filler)`: called before micro-batch k's forward on each stage
    (MoE: which of the [b, t] tokens are real and which experts to replay; moe.MegatronRouting).
    `head`: the last stage hands back hidden states, scored by the output layer chunk by chunk (head.py)."""

    def __init__(self, device, vocab_size: int, temperature: float, seq_multiple: int = 1,
                 scores: Callable | None = None, before_forward: Callable | None = None, head=None):
        self.device, self.vocab_size, self.temperature = device, vocab_size, temperature
        self.seq_multiple = seq_multiple
        self.score_fn = scores
        self.head = head
        self.before_forward = before_forward
        self.pp = ps.get_pipeline_model_parallel_world_size()
        self.vp = ps.get_virtual_pipeline_model_parallel_world_size() or 1

    def padded(self, batches: list[GroupBatch]) -> list[GroupBatch]:
        """The interleaved schedule runs micro-batches in groups of the pipeline size."""
        if self.vp == 1 or len(batches) % self.pp == 0:
            return batches
        return batches + [FILLER] * (self.pp - len(batches) % self.pp)

    def shape(self, batches: list[GroupBatch]) -> tuple[int, int]:
        """The [samples, tokens] every micro-batch of a pass is padded to (`padded(batches)`'s)."""
        m = self.seq_multiple
        return max(len(toks) for toks, _ in batches), -(-max(len(t) for toks, _ in batches for t in toks) // m) * m

    def _run(self, chunks, batches: list[GroupBatch], on_logits: Callable, forward_only: bool) -> None:
        shape = self.shape(batches)
        inputs = [(k, *batch_inputs(toks, lens, self.device, shape), lens) for k, (toks, lens) in enumerate(batches)]

        def forward_step(data_iterator, model):
            k, ids, pos, mask, prompt_lens, lens = next(data_iterator)
            if self.before_forward is not None:
                self.before_forward(k, [len(t) for t in batches[k][0]], tuple(ids.shape), batches[k] is FILLER)
            weight = None
            if self.head is not None and model.post_process:
                with self.head.hidden_states(model):
                    out = model(ids, pos, attention_mask=mask)  # [b, t, H]
                weight = output_weight(model)
            else:
                out = model(ids, pos, attention_mask=mask)
            if not model.post_process:  # sent to the next stage: gloo sends contiguous tensors only, and an
                out = out.contiguous()  # MoE layer's output under sequence parallelism was not
            return out, functools.partial(on_logits, k, ids, prompt_lens, lens, weight)

        iters = [iter(inputs) for _ in chunks] if len(chunks) > 1 else iter(inputs)
        with shims.cpu_only_cuda_shims(), torch.set_grad_enabled(not forward_only):
            get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iters, model=chunks if len(chunks) > 1 else chunks[0],
                num_microbatches=len(inputs), seq_length=shape[1], micro_batch_size=shape[0], forward_only=forward_only)

    def _scores(self, logits, weight, ids, prompt_lens, lens, *, with_entropy: bool, entropy_grad: bool):
        """`logits`: the last stage's output; with `head`, the hidden states and `weight` the output layer's."""
        if weight is not None:
            return self.head.scores(logits, weight, ids, prompt_lens, lens, with_entropy=with_entropy,
                                    entropy_grad=entropy_grad)
        if self.score_fn is not None:
            return self.score_fn(logits, ids, prompt_lens, lens, with_entropy=with_entropy, entropy_grad=entropy_grad)
        return response_scores(logits[..., : self.vocab_size], ids, prompt_lens, lens, self.temperature,
                               with_entropy=with_entropy, entropy_grad=entropy_grad)

    def forward(self, chunks, batches: list[GroupBatch], *, with_entropy: bool) -> list[tuple[Tensor, Tensor | None]]:
        """(log-probs, entropy or None) of every response token of each micro-batch, Tensor[N_k] in
        sample order, on every rank of the pipeline (broadcast from the last stage). No gradient."""
        results: dict[int, tuple[Tensor, Tensor | None]] = {}

        def keep(k, ids, prompt_lens, lens, weight, logits):
            lps, ents = self._scores(logits, weight, ids, prompt_lens, lens, with_entropy=with_entropy,
                                     entropy_grad=False)
            results[k] = (torch.cat(lps), torch.cat(ents) if with_entropy else None)
            return torch.zeros((), device=self.device), torch.ones((), dtype=torch.int, device=self.device), {}

        padded = self.padded(batches)
        self._run(chunks, padded, keep, forward_only=True)
        sizes = [sum(lens) for _, lens in batches]
        width = 2 if with_entropy else 1
        flat = torch.empty(width * sum(sizes), dtype=torch.float32, device=self.device)
        if ps.is_pipeline_last_stage():
            parts = [results[k][0] for k in range(len(batches))]
            if with_entropy:
                parts += [results[k][1] for k in range(len(batches))]
            flat = torch.cat(parts).float() if parts else flat
        if self.pp > 1:
            dist.broadcast(flat, src=ps.get_pipeline_model_parallel_last_rank(),
                           group=ps.get_pipeline_model_parallel_group())
        lps = list(flat[: sum(sizes)].split(sizes))
        ents = list(flat[sum(sizes):].split(sizes)) if with_entropy else [None] * len(sizes)
        return list(zip(lps, ents))

    def backward(self, chunks, batches: list[GroupBatch], upstream: list[tuple[Tensor, Tensor | None]]) -> None:
        """Back-propagate sum(log-probs x g_lp + entropy x g_ent) of every micro-batch through the
        pipeline (gradients accumulate into the chunks' parameters). `upstream[k]`: (g_lp, g_ent or
        None) of micro-batch k, Tensor[N_k] each, the same on every rank of the group."""

        def surrogate(k, ids, prompt_lens, lens, weight, logits):
            one = torch.ones((), dtype=torch.int, device=self.device)
            if k >= len(upstream):  # a filler micro-batch
                return 0.0 * logits.sum(), one, {}
            g_lp, g_ent = upstream[k]
            lps, ents = self._scores(logits, weight, ids, prompt_lens, lens, with_entropy=g_ent is not None,
                                     entropy_grad=g_ent is not None)
            lp = torch.cat(lps)  # fp32 (bf16 logits too): the upstream gradient is not rounded
            loss = (lp * g_lp.to(lp.dtype)).sum() + 0.0 * logits.sum()
            if g_ent is not None:
                ent = torch.cat(ents)
                loss = loss + (ent * g_ent.to(ent.dtype)).sum()
            return loss, one, {}

        self._run(chunks, self.padded(batches), surrogate, forward_only=False)


def gather_stages(state: dict[str, Tensor], device) -> dict[str, Tensor]:
    """Every pipeline stage's tensors (disjoint names) on every rank of the pipeline: each stage
    broadcasts its own in turn. Collective over the pipeline group."""
    group = ps.get_pipeline_model_parallel_group()
    ranks = dist.get_process_group_ranks(group)
    metas: list = [None] * len(ranks)
    dist.all_gather_object(metas, [(n, tuple(t.shape), t.dtype) for n, t in state.items()], group=group)
    out = {}
    for src, meta in zip(ranks, metas):
        for name, shape, dtype in meta:
            t = state[name].contiguous() if src == dist.get_rank() else torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(t, src=src, group=group)
            out[name] = t
    return out
