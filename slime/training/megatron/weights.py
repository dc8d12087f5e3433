"""HF <-> megatron-core weights under tensor parallelism.

`slime.training.megatron.convert.hf_to_mcore` / `mcore_to_hf` map full (unsharded) tensors
between HF names and the GPTModel's local-spec names (fused QKV per query group, fc1 =
[gate; up], padded vocabulary). This module splits those full tensors into one TP rank's
shards and joins the shards back, following each parameter's own megatron attributes
(`tensor_model_parallel`, `partition_dim`):

  * column-parallel (partition_dim 0): linear_qkv (weight, bias), embedding and output
    layer (vocabulary rows): rank r holds the r-th contiguous block of rows. For linear_qkv
    that is whole query groups (their q heads, k head, v head), which is how megatron's
    attention splits the fused projection, so `num_key_value_heads % tp == 0` is required;
  * linear_fc1 (column-parallel, gated): megatron's rank r holds [gate_r; up_r], the r-th
    block of the gate rows followed by the r-th block of the up rows - not the r-th block
    of [gate; up];
  * row-parallel (partition_dim 1): linear_proj, linear_fc2: column blocks;
  * everything else (norms) is replicated.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from slime.training.megatron import convert as mc
from slime.utils.errors import SlimeError


def _is_fc1(name: str) -> bool:
    return name.endswith("mlp.linear_fc1.weight") or name.endswith("mlp.linear_fc1.bias")


def partition_dim(param) -> int | None:
    """The dimension megatron splits this parameter along over TP ranks, or None if replicated."""
    return int(param.partition_dim) if getattr(param, "tensor_model_parallel", False) else None


def shard(name: str, full: Tensor, dim: int | None, tp: int, rank: int) -> Tensor:
    """TP rank `rank`'s shard of a full megatron tensor."""
    if dim is None or tp == 1:
        return full
    if full.shape[dim] % tp:
        raise SlimeError(f"{name}: dimension {dim} of shape {tuple(full.shape)} does not split over {tp} TP ranks")
    if _is_fc1(name):
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]]).contiguous()
    return full.chunk(tp, dim=dim)[rank].contiguous()


def unshard(name: str, shards: list[Tensor], dim: int | None) -> Tensor:
    """The full megatron tensor from every TP rank's shard (in rank order)."""
    if dim is None or len(shards) == 1:
        return shards[0]
    if _is_fc1(name):
        halves = [torch.chunk(s, 2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves]).contiguous()
    return torch.cat(shards, dim=dim).contiguous()


def load_hf_into(model, hf_state: dict[str, Tensor], config, tp: int, tp_rank: int) -> None:
    """Copy a HF state dict into this TP rank's GPTModel; every parameter must be covered."""
    params = dict(model.named_parameters())
    vocab_rows = params["embedding.word_embeddings.weight"].shape[0] * tp
    full = mc.hf_to_mcore(hf_state, config, vocab_rows=vocab_rows)
    missing = sorted(set(params) - set(full))
    unexpected = sorted(set(full) - set(params))
    if missing or unexpected:
        raise SlimeError(f"weights do not match the megatron model (missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]})")
    with torch.no_grad():
        for name, p in params.items():
            t = shard(name, full[name], partition_dim(p), tp, tp_rank)
            if t.shape != p.shape:
                raise SlimeError(f"{name}: shard {tuple(t.shape)} != parameter {tuple(p.shape)}")
            p.copy_(t.to(p.dtype))


def full_mcore_state(model, gather: Callable[[Tensor], list[Tensor]]) -> dict[str, Tensor]:
    """{megatron name: full tensor} of the model's parameters; `gather(t)` returns every TP rank's
    copy of t (rank order). Collective over the TP group; tied output weights appear once."""
    out = {}
    for name, p in model.named_parameters():
        dim = partition_dim(p)
        t = p.detach()
        out[name] = unshard(name, gather(t) if dim is not None else [t], dim)
    return out


def to_hf(mcore_state: dict[str, Tensor], config) -> dict[str, Tensor]:
    """Full megatron state -> HF state (vocabulary trimmed to the config's; a tied head omitted)."""
    return mc.mcore_to_hf(mcore_state, config, vocab_size=config.vocab_size)
