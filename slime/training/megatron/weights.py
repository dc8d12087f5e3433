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
  * MoE experts' linear_fc1 / linear_fc2: split the same way when expert tensor parallelism is the TP
    size (the expert-TP group is then the TP group, rank for rank), whole on every TP rank when it is 1;
  * everything else (norms) is replicated.

Under pipeline parallelism a model chunk holds some decoder layers, numbered from 0 locally:
`global_names` maps them to the whole model's numbering (each layer's `layer_number`), so
loading and exporting work per chunk with the full model's names. A tied output layer on the
last stage is megatron's duplicate of the first stage's embedding: loaded from it, never exported.
"""

from __future__ import annotations

import re
from typing import Callable

import torch
from torch import Tensor

from slime.training.megatron import convert as mc
from slime.training.megatron import moe
from slime.training.megatron.optimizer import ShardedAdamW
from slime.utils.errors import SlimeError


_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.*)")


def global_names(model) -> dict[str, str]:
    """This model chunk's parameter names -> the whole model's megatron names (an EP rank's local
    experts under their global ids, slime.training.megatron.moe)."""
    out = {}
    for name, _ in model.named_parameters():
        m = _LAYER.fullmatch(name)
        out[name] = f"decoder.layers.{model.decoder.layers[int(m.group(1))].layer_number - 1}.{m.group(2)}" if m \
            else name
        if m and moe.is_expert(name):
            experts = model.decoder.layers[int(m.group(1))].mlp.experts
            out[name] = moe.global_expert_name(out[name], experts.num_local_experts, moe.ep_rank())
    return out


def is_tied_duplicate(model, name: str) -> bool:
    """The last pipeline stage's copy of a tied embedding (megatron keeps one for the output layer)."""
    return name == "output_layer.weight" and model.share_embeddings_and_output_weights and not model.pre_process


def _is_fc1(name: str) -> bool:
    """A gated fc1 ([gate; up]): the dense MLP's, an MoE layer's shared expert's or an expert's (every
    model slime builds has SwiGLU MLPs)."""
    return name.endswith(("linear_fc1.weight", "linear_fc1.bias"))


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
    """Copy a HF state dict into this TP rank's GPTModel chunk; every parameter must be covered
    (and, for a whole model, every tensor of the checkpoint used)."""
    full = (moe.hf_to_mcore if moe.is_moe(config) else mc.hf_to_mcore)(hf_state, config, vocab_rows=model.vocab_size)
    load_mcore_into(model, full, tp, tp_rank)


def load_mcore_into(model, full: dict[str, Tensor], tp: int, tp_rank: int) -> None:
    """Copy whole-model megatron tensors (full, unsharded) into this TP rank's GPTModel chunk, with
    the checks of `load_hf_into`."""
    params = dict(model.named_parameters())
    names = global_names(model)
    if "output_layer.weight" in params and is_tied_duplicate(model, "output_layer.weight"):
        full["output_layer.weight"] = full["embedding.word_embeddings.weight"]
    missing = sorted(n for n in params if names[n] not in full)
    unexpected = sorted(set(full) - set(names.values()) - {n for n in full if moe.is_expert(n)}) \
        if model.pre_process and model.post_process else []
    if missing or unexpected:
        raise SlimeError(f"weights do not match the megatron model (missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]})")
    with torch.no_grad():
        for name, p in params.items():
            t = shard(name, full[names[name]], partition_dim(p), tp, tp_rank)
            if t.shape != p.shape:
                raise SlimeError(f"{name}: shard {tuple(t.shape)} != parameter {tuple(p.shape)}")
            p.copy_(t.to(p.dtype))


def full_mcore_state(model, gather: Callable[[Tensor], list[Tensor]]) -> dict[str, Tensor]:
    """{whole-model megatron name: full tensor} of this chunk's parameters; `gather(t)` returns every
    TP rank's copy of t (rank order). Collective over the TP group; tied output weights appear once."""
    out = {}
    names = global_names(model)
    for name, p in model.named_parameters():
        if is_tied_duplicate(model, name):
            continue
        dim = partition_dim(p)
        t = p.detach()
        out[names[name]] = unshard(name, gather(t) if dim is not None else [t], dim)
    return out


def to_hf(mcore_state: dict[str, Tensor], config) -> dict[str, Tensor]:
    """Full megatron state -> HF state (vocabulary trimmed to the config's; a tied head omitted)."""
    return (moe.mcore_to_hf if moe.is_moe(config) else mc.mcore_to_hf)(mcore_state, config,
                                                                       vocab_size=config.vocab_size)


def full_optimizer_state(chunks: list, optimizer, gather: Callable[[Tensor], list[Tensor]],
                         join: Callable[[dict], dict]) -> dict:
    """The AdamW state of every trained parameter as full tensors, in torch's state-dict shape keyed by
    whole-model megatron name: {"state": {name: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups"}.
    `gather`: a tensor's TP shards (all-gather); `join`: the other pipeline stages' and expert-parallel
    ranks' entries of a {"name/key": tensor} dict. Collective."""
    trained = [(global_names(c)[n], p) for c in chunks for n, p in c.named_parameters() if p.requires_grad]
    states = optimizer.full_state(trained, all_ranks=True) if isinstance(optimizer, ShardedAdamW) \
        else {n: optimizer.state.get(p, {}) for n, p in trained}
    flat = {}  # "name/key": full tensor
    for chunk in chunks:
        names = global_names(chunk)
        for name, p in chunk.named_parameters():
            st, dim = states.get(names[name], {}), partition_dim(p)
            for key in ("step", "exp_avg", "exp_avg_sq"):
                if key in st and not is_tied_duplicate(chunk, name):
                    v = st[key]
                    if key != "step" and dim is not None:
                        v = unshard(name, gather(v), dim)
                    flat[f"{names[name]}/{key}"] = v.detach()
    state: dict = {}
    for k, v in join(flat).items():
        name, key = k.rsplit("/", 1)
        state.setdefault(name, {})[key] = v.cpu().clone()
    return {"state": state, "param_groups": [{k: v for k, v in g.items() if k != "params"}
                                             for g in optimizer.param_groups]}
