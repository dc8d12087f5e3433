"""Frozen parameters (`--freeze-params-name-list`) and a reference model that follows the policy
(`--ref-update-interval`); original slime's flags (docs/algorithms.md, "Off-policy corrections").

- `freeze_parameters(model, patterns)`: every parameter whose name matches a regex (re.search)
  gets requires_grad False. A backend calls it on the policy right after building it, before
  sharding and before the optimizer is made (the optimizer takes only trainable parameters).
  FSDP2 keeps parameter names and each parameter's requires_grad when it shards.
- `ref_update_due(rollout_id, interval)`: after training rollout `rollout_id`, is the reference
  due to become the policy? (original slime: after rollouts interval-1, 2*interval-1, ...)
- `copy_policy_into_reference(policy, ref)`: the reference's parameters take the policy's values,
  by name, in place (no new memory, the reference's devices and placement kept). With FSDP2 both
  models are sharded alike (same mesh, same placements): each rank copies its local shards, no
  communication. Where only one side is sharded (a one-rank policy trains the plain module while
  the reference is sharded to live in host memory; the root's parameters after a forward), the
  full tensor is gathered or the local shard sliced. Collective when a policy parameter is a
  sharded DTensor and the reference's is not (every rank calls it, in the same order).
- `save_reference(backend, path)` / `load_reference(backend, path)`: a reference that has followed
  the policy is saved with the checkpoint (`path/ref_state`) and a resume loads it back, so the
  resumed run's KL is the uninterrupted run's. Checkpoints of runs whose reference never moved have
  no `ref_state` (the reference is then `--ref-load` / `--hf-checkpoint`, rebuilt at start).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from slime.off_policy_flags import matching_names
from slime.utils.checkpoint_data import dcp_load
from slime.utils.errors import SlimeConfigError

REF_STATE = "ref_state"  # the checkpoint's subdirectory of a reference that followed the policy


def freeze_parameters(model: nn.Module, patterns: list[str]) -> list[str]:
    """Set requires_grad False on every parameter of `model` whose name any pattern matches
    (re.search; names as `model.named_parameters()` gives them, tied weights once).

    returns the frozen names, in the model's order. A pattern that is not a regex or matches no
    parameter, or patterns that freeze every parameter, are a SlimeConfigError naming the flag.
    """
    names = [n for n, _ in model.named_parameters()]
    frozen = matching_names(names, list(patterns))
    if len(frozen) == len(names):
        raise SlimeConfigError("--freeze-params-name-list matches every parameter: nothing would train")
    params = dict(model.named_parameters())
    for n in frozen:
        params[n].requires_grad_(False)
    return frozen


def ref_update_due(rollout_id: int, interval: int | None) -> bool:
    """True when the reference becomes the policy after training rollout `rollout_id` (0-based):
    every `interval` rollouts, i.e. after rollouts interval-1, 2*interval-1, ... None or 0: never."""
    return bool(interval) and (rollout_id + 1) % interval == 0


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def copy_policy_into_reference(policy_model: nn.Module, ref_model: nn.Module) -> int:
    """Copy the policy's parameters into the reference model's, by name (see the module docstring).

    Both models must have the same parameter names and (global) shapes; dtypes may differ (copy_
    casts). Returns the number of parameters copied. No gradient is recorded.
    """
    policy = dict(policy_model.named_parameters())
    ref = dict(ref_model.named_parameters())
    if set(policy) != set(ref):
        only_p, only_r = sorted(set(policy) - set(ref)), sorted(set(ref) - set(policy))
        raise ValueError("policy and reference parameters differ: "
                         + (f"only in the policy: {only_p[:3]}" if only_p else f"only in the reference: {only_r[:3]}"))
    with torch.no_grad():
        for name, r in ref.items():
            p = policy[name]
            if p.shape != r.shape:
                raise ValueError(f"{name}: policy shape {tuple(p.shape)} vs reference {tuple(r.shape)}")
            if isinstance(r, DTensor):
                if isinstance(p, DTensor) and (p.device_mesh, tuple(p.placements)) == (r.device_mesh,
                                                                                      tuple(r.placements)):
                    src = p.to_local()  # sharded alike: this rank's shards match
                else:
                    full = p.full_tensor() if isinstance(p, DTensor) else p
                    # this rank's piece of the full tensor under the reference's placement (local slicing,
                    # src_data_rank=None: no communication; every rank holds the same full tensor)
                    src = distribute_tensor(full.detach().to(r.to_local().device), r.device_mesh, r.placements,
                                            src_data_rank=None).to_local()
            else:
                src = p.full_tensor() if isinstance(p, DTensor) else p
            _local(r).copy_(src)
    return len(ref)


def save_reference(backend, path) -> None:
    """Write `backend.ref_model`'s weights to `path/ref_state`, exactly (its own dtype). A backend
    with its own format has `save_reference(dir)` (megatron: its distributed checkpoint, any TP / PP
    / DP layout loads it); otherwise a torch distributed checkpoint of the model's state dict (the
    FSDP backend: one rank's plain module or every rank's shards; any DP size loads it). Collective."""
    out = Path(path) / REF_STATE
    if hasattr(backend, "save_reference"):
        backend.save_reference(out)
    else:
        dcp.save({"model": get_model_state_dict(backend.ref_model)}, checkpoint_id=str(out))


def load_reference(backend, path) -> bool:
    """Load `path/ref_state` into `backend.ref_model` when the checkpoint has one and this run has a
    reference; returns whether it did (then the reference is the one the saved run had). Collective."""
    src = Path(path) / REF_STATE
    if backend.ref_model is None or not src.is_dir():
        return False
    if hasattr(backend, "load_reference"):
        backend.load_reference(src)
    else:
        state = {"model": get_model_state_dict(backend.ref_model)}
        dcp_load(state, src)  # data only (slime.utils.checkpoint_data)
        set_model_state_dict(backend.ref_model, state["model"])
    return True
