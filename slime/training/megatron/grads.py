"""The megatron backend's gradients after the micro-batches' backward: what megatron's
`finalize_model_grads` does for its own DistributedDataParallel (which slime does not use,
shims.py says why), and the global gradient norm that `--clip-grad` clips to.

Reduction, in order:
- a tied embedding: the first stage's embedding and the last stage's copy train as one weight
  (summed over megatron's embedding group);
- under tensor parallelism, replicated weights that each TP rank applies to a part of the work (the
  q/k norms to its own heads; under sequence parallelism the layer norms and the router to its own
  tokens) hold partial sums: summed over the TP group;
- every weight over the group it is replicated over (`replica_group(p)`): the data-parallel group,
  or for an MoE expert the expert-data-parallel group (the ranks that hold the same experts; the
  all-to-all's backward has already brought every EP rank's tokens);
- divided by the number of train ranks (the actor multiplies each rank's loss by it).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from torch import Tensor

from slime.training.megatron import moe
from slime.training.megatron.weights import is_tied_duplicate


def tied_embedding(chunks: list, pp: int) -> Tensor | None:
    """This rank's copy of a tied embedding shared between the first and the last pipeline stage."""
    if pp == 1 or not ps.is_rank_in_embedding_group(ignore_virtual=True):
        return None
    chunk = chunks[0] if ps.is_pipeline_first_stage(ignore_virtual=True) else chunks[-1]
    if not chunk.share_embeddings_and_output_weights:
        return None
    return chunk.shared_embedding_or_output_weight()


def reduce_gradients(chunks: list, replica_group: Callable, world_size: int, tp_group, pp: int) -> None:
    """Every parameter's `.grad` (zeros where backward left none) reduced as the module docstring says."""
    named, seen = [], set()
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                named.append((name, p))
    for _, p in named:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    tied = tied_embedding(chunks, pp)
    if tied is not None:
        dist.all_reduce(tied.grad, group=ps.get_embedding_group())
    if dist.get_world_size(tp_group) > 1:
        for name, p in named:
            if "q_layernorm" in name or "k_layernorm" in name or getattr(p, "sequence_parallel", False):
                dist.all_reduce(p.grad, group=tp_group)
    for _, p in named:
        group = replica_group(p)
        if dist.get_world_size(group) > 1:
            dist.all_reduce(p.grad, group=group)
    for _, p in named:
        p.grad.div_(world_size)


def global_norm(chunks: list, device, expert_group, mp_group) -> float:
    """The gradient norm of the whole model: TP shards summed over the model-parallel group (TP x PP),
    replicated weights and a tied embedding's last-stage copy once. MoE experts: each rank's own
    (its EP rank's experts, or its expert-TP shards of them) summed over the expert tensor-and-expert-
    parallel group (`expert_group`, ETP x EP; None when it is one rank), which lies within a pipeline
    stage and holds each of the stage's expert weights once, then counted once per stage (by its TP
    rank 0; the other TP ranks hold the same experts, or have just summed theirs into it)."""
    sq = torch.zeros((), dtype=torch.float32, device=device)
    sq_experts = torch.zeros((), dtype=torch.float32, device=device)
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if moe.is_expert(name):
                sq_experts.add_(p.grad.float().pow(2).sum())
            elif param_is_not_tensor_parallel_duplicate(p) and not is_tied_duplicate(chunk, name):
                sq.add_(p.grad.float().pow(2).sum())
    if expert_group is not None and dist.get_world_size(expert_group) > 1:
        dist.all_reduce(sq_experts, group=expert_group)
    if ps.get_tensor_model_parallel_rank() == 0:
        sq += sq_experts
    if dist.get_world_size(mp_group) > 1:
        dist.all_reduce(sq, group=mp_group)
    return float(sq.sqrt())
