"""The megatron backend's training state in megatron-core's distributed checkpoint format
(`megatron.core.dist_checkpointing`, torch_dist backend): resumable at another layout.

What is written (one directory; every rank writes its part, collectively):

  * the model: each model chunk's own `sharded_state_dict()`. megatron-core names every tensor
    by its whole-model key with its place in the global tensor (TP slices, fused SwiGLU halves,
    decoder layers stacked along a leading axis with pipeline offsets applied, a tied output layer
    marked as a copy of the embedding), so the checkpoint is independent of the TP / PP / DP
    layout that wrote it. Vocabulary padding may differ between layouts (it grows with the TP
    size): megatron loads the rows both have and zeroes the rest, which is what padded rows hold;
  * the optimizer: each AdamW moment (`exp_avg`, `exp_avg_sq`) as a tensor laid out exactly like
    its parameter (`optimizer.state.<moment>.<parameter key>`, megatron's own
    `make_sharded_optimizer_tensor`), the parameter groups' hyperparameters (learning-rate
    schedule step included) and one step count shared by all parameters (megatron's
    `common_step`). With `ShardedAdamW` (--use-distributed-optimizer) a parameter's moments are
    written by the data-parallel rank that owns them, so state saved with or without it, at any
    data-parallel size, loads into either;
  * `slime`: the caller's `extra` dict (iteration counters and the like), and `layout`: how the
    state was written (informational).

Needs `megatron.core.parallel_state` initialized as for training (the chunks' sharded keys come
from it). CPU: the calls run under `shims.cpu_only_cuda_shims()` (the writer names CUDA).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
from megatron.core.dist_checkpointing.optimizer import get_param_id_to_sharded_param_map, make_sharded_optimizer_tensor
from torch import Tensor

from slime.training.megatron import shims
from slime.training.megatron.optimizer import STATE_KEYS, ShardedAdamW
from slime.utils.errors import SlimeConfigError, SlimeError

CHECKPOINT_VERSION = 3.0  # Megatron-LM's; stored in the common part as Megatron-LM does


def _model_key(chunks: list, i: int) -> str:
    return "model" if len(chunks) == 1 else f"model{i}"  # Megatron-LM's names for virtual stages


def _optimizer_params(optimizer) -> list[Tensor]:
    """Every parameter the optimizer steps, in torch's id order (all of them for ShardedAdamW)."""
    if isinstance(optimizer, ShardedAdamW):
        return optimizer.params
    return [p for g in optimizer.param_groups for p in g["params"]]


def _holds_state(optimizer, p: Tensor) -> bool:
    return optimizer.owns(p) if isinstance(optimizer, ShardedAdamW) else True


def _state_keys(optimizer) -> tuple[str, ...]:
    return STATE_KEYS + (("max_exp_avg_sq",) if optimizer.param_groups[0].get("amsgrad") else ())


def _common_step(optimizer) -> float | None:
    """The step count every parameter's state shares (megatron's `common_step`), agreed over all
    ranks; None before the first step. Collective."""
    steps = {float(st["step"]) for st in optimizer.state.values() if "step" in st}
    if len(steps) > 1:
        raise SlimeError(f"the optimizer's step count differs between parameters ({sorted(steps)[:4]}); "
                         "a distributed checkpoint stores one shared step")
    mine = steps.pop() if steps else None
    t = torch.tensor([mine if mine is not None else -1.0, -mine if mine is not None else -float("inf")],
                     dtype=torch.float64, device="cuda" if torch.cuda.is_available() else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    hi, lo = float(t[0]), -float(t[1])
    if hi < 0:
        return None
    if hi != lo:
        raise SlimeError(f"ranks disagree on the optimizer step count ({lo} vs {hi})")
    return hi


def _as_owner(sh):
    """An optimizer tensor written by its owner: the data-parallel part of the replica id (megatron's
    (pipeline copy, TP, DP) tuple; an int for replicated objects) set to 0, the rest kept."""
    rid = sh.replica_id
    rid = (*rid[:-1], 0) if isinstance(rid, tuple) else 0
    return dataclasses.replace(sh, replica_id=rid)


def _optimizer_sharded_state(model_sds: list[dict], optimizer, step: float | None, *, loading: bool) -> dict:
    """The optimizer's sharded state dict on the model's layout. `loading`: placeholders to read
    into, for every parameter this rank keeps state for."""
    params = _optimizer_params(optimizer)
    id_map = get_param_id_to_sharded_param_map(model_sds, params)
    unmapped = [i for i in range(len(params)) if i not in id_map]
    if unmapped:
        raise SlimeError(f"{len(unmapped)} optimizer parameter(s) (first: id {unmapped[0]}, shape "
                         f"{tuple(params[unmapped[0]].shape)}) are not parameters of the model chunks")
    sharded_opt = isinstance(optimizer, ShardedAdamW)
    state = {}
    if step is not None:
        for i, p in enumerate(params):
            if not _holds_state(optimizer, p):
                continue  # another data-parallel rank writes / reads it
            sh = _as_owner(id_map[i]) if sharded_opt else id_map[i]
            if loading:
                st = {k: torch.empty_like(p) for k in _state_keys(optimizer)}
            else:
                st = optimizer.state.get(p)
                if not st:
                    raise SlimeError(f"optimizer parameter {i} (shape {tuple(p.shape)}) has no state after "
                                     f"{step:g} steps")
            state[i] = {k: make_sharded_optimizer_tensor(sh, st[k], prefix=f"optimizer.state.{k}")
                        for k in _state_keys(optimizer)}
    return {"state": state, "common_step": step,
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]}


def _layout(optimizer) -> dict:
    return {"tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
            "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
            "data_parallel_size": ps.get_data_parallel_world_size(),
            "distributed_optimizer": isinstance(optimizer, ShardedAdamW)}


def save_train_state(path: str | Path, chunks: list, optimizer=None, extra: dict | None = None) -> None:
    """Write the model chunks (this rank's pipeline stage, every virtual stage), the optimizer
    (torch AdamW or ShardedAdamW; None: the model only) and `extra` to the directory `path`.
    Collective over all ranks."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model_sds = [c.sharded_state_dict() for c in chunks]
    state: dict = {_model_key(chunks, i): sd for i, sd in enumerate(model_sds)}
    state.update(checkpoint_version=CHECKPOINT_VERSION, slime=dict(extra or {}), layout=_layout(optimizer))
    if optimizer is not None:
        state["optimizer"] = _optimizer_sharded_state(model_sds, optimizer, _common_step(optimizer), loading=False)
    with shims.cpu_only_cuda_shims():
        dist_checkpointing.save(state, str(path), content_metadata={})


def is_train_state(path: str | Path) -> bool:
    return dist_checkpointing.check_is_distributed_checkpoint(str(path))


def _check_model_shapes(path: Path, chunks: list) -> None:
    """One clear line for a checkpoint of another model (megatron's own error lists every key)."""
    saved = {k: tuple(v.global_shape) for k, v in dist_checkpointing.load_tensors_metadata(str(path)).items()
             if hasattr(v, "global_shape")}
    for chunk in chunks:
        sd = chunk.sharded_state_dict()
        apply_factories(sd)
        for sh in nested_values(sd):
            if not isinstance(sh, ShardedTensor):
                continue
            if sh.key not in saved:
                raise SlimeConfigError(f"{path}: the checkpoint has no {sh.key}: it was saved from another model "
                                       "(check --load and the model flags / --hf-checkpoint)")
            want, have = tuple(sh.global_shape), saved[sh.key]
            # padded vocabulary rows may differ between TP sizes (megatron's allow_shape_mismatch)
            same = want[1:] == have[1:] if sh.allow_shape_mismatch else want == have
            if not same:
                raise SlimeConfigError(f"{path}: {sh.key} has shape {have} in the checkpoint, {want} in this model: "
                                       "it was saved from another model (check --load and --hf-checkpoint)")


def load_train_state(path: str | Path, chunks: list, optimizer=None) -> dict:
    """Load a `save_train_state` directory into the model chunks and the optimizer (any TP / PP /
    DP layout, with or without ShardedAdamW, on either side; `optimizer=None`: the model only).
    Returns the saved `extra`. Collective over all ranks."""
    path = Path(path)
    if not is_train_state(path):
        raise SlimeConfigError(f"--load {path}: not a megatron distributed checkpoint (no metadata.json "
                               "written by megatron.core.dist_checkpointing)")
    _check_model_shapes(path, chunks)
    common = dist_checkpointing.load_common_state_dict(str(path))
    model_sds = [c.sharded_state_dict() for c in chunks]
    request: dict = {_model_key(chunks, i): sd for i, sd in enumerate(model_sds)}
    saved_opt = common.get("optimizer") if optimizer is not None else None
    if optimizer is not None and saved_opt is None:
        raise SlimeConfigError(f"--load {path}: the checkpoint has no optimizer state (it was saved without "
                               "one); resume from a state saved with its optimizer, or start from its weights")
    step = saved_opt.get("common_step") if saved_opt else None
    if saved_opt is not None:
        if len(saved_opt["param_groups"]) != len(optimizer.param_groups):
            raise SlimeConfigError(f"--load {path}: the optimizer was saved with {len(saved_opt['param_groups'])} "
                                   f"parameter groups, this one has {len(optimizer.param_groups)}")
        request["optimizer"] = _optimizer_sharded_state(model_sds, optimizer, step, loading=True)
    with shims.cpu_only_cuda_shims():
        loaded = dist_checkpointing.load(request, str(path))
    for i, chunk in enumerate(chunks):
        missing, unexpected = chunk.load_state_dict(loaded[_model_key(chunks, i)], strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise SlimeConfigError(f"{path}: weights do not match the model (missing {missing[:3]}, "
                                   f"unexpected {unexpected[:3]})")
    if saved_opt is not None:
        wanted = {i: loaded["optimizer"]["state"][i] for i in request["optimizer"]["state"]}
        _restore_optimizer(optimizer, wanted, saved_opt["param_groups"], step)
    return dict(loaded.get("slime") or {})


def _restore_optimizer(optimizer, moments_by_id: dict, groups: list[dict], step: float | None) -> None:
    """The loaded moments ({optimizer parameter id: {moment: tensor}}), the groups' hyperparameters
    and the shared step into the optimizer."""
    for group, saved in zip(optimizer.param_groups, groups):
        group.update({k: v for k, v in saved.items() if k != "params"})
    params = _optimizer_params(optimizer)
    optimizer.state.clear()
    if step is None:
        return
    for i, moments in moments_by_id.items():
        p = params[int(i)]
        # torch AdamW keeps `step` as an fp32 scalar tensor, on the CPU unless capturable / fused
        on_device = any(g.get("capturable") or g.get("fused") for g in optimizer.param_groups)
        st = {"step": torch.tensor(step, dtype=torch.float32, device=p.device if on_device else "cpu")}
        st.update({k: v.to(p.device, p.dtype) for k, v in moments.items()})
        optimizer.state[p] = st
