"""`--use-distributed-optimizer` for the megatron backend: AdamW with its state sharded over the
data-parallel group (ZeRO stage 1), on CPU (gloo) and GPU alike.

Every parameter - a whole tensor, as this rank holds it (its TP shard) - is owned by one
data-parallel rank: parameters are taken largest first (ties in parameter order) and each goes
to the rank with the fewest elements so far (ties to the lower rank), so the split is the same
on every rank of the group and balanced to within one parameter. The owner alone keeps the
parameter's AdamW state (`step`, `exp_avg`, `exp_avg_sq`) and updates it; after the step every
parameter is broadcast from its owner over the group (one flat buffer per owner and dtype, in
buckets of at most `BUCKET_NUMEL` elements). The update itself is torch's `AdamW` on the owned
parameters, so the numbers are torch AdamW's exactly.

Parameters need not all be replicated over the same group: `dp_group_of(p)` names the group a
parameter is replicated over (default: `dp_group` for all). With expert parallelism an expert's
weights are replicated over the expert-data-parallel group (the ranks holding the same experts),
every other parameter over the data-parallel group. Parameters are split by their group, owners
are assigned within each split as above, and each split's owners broadcast over its own group.

Gradients must arrive already summed over each parameter's group (the backend all-reduces
them), and every rank of the groups calls `step()` / `zero_grad()` together. Per rank the state
is about 1 / (group size) of plain AdamW's (two fp32 tensors per owned parameter element).

Not megatron's `DistributedOptimizer` (contiguous CUDA grad buffers, reduce-scatter, fp32 main
copies of bf16 parameters; shims.py says why it is not used): plain torch, any process group
(the backend passes megatron's `parallel_state.get_data_parallel_group()`; None: one rank).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch import Tensor

BUCKET_NUMEL = 1 << 26  # elements per broadcast buffer (256 MiB of fp32)
STATE_KEYS = ("exp_avg", "exp_avg_sq")


def assign_owners(numels: list[int], dp_size: int) -> list[int]:
    """The owning data-parallel rank of each parameter: largest first (ties in order), each to the
    least-loaded rank (ties to the lower rank). Deterministic: the same on every rank."""
    load = [0] * dp_size
    owners = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        r = min(range(dp_size), key=lambda r: (load[r], r))
        owners[i] = r
        load[r] += numels[i]
    return owners


@dataclass
class _Replicas:
    """The parameters replicated over one process group: their positions in `ShardedAdamW.params`."""
    group: object  # a torch.distributed group; None: this rank alone
    size: int
    rank: int
    members: list[int]

    def global_rank(self, r: int) -> int:
        return dist.get_global_rank(self.group, r)


class ShardedAdamW:
    """torch.optim.AdamW with each parameter's state on one data-parallel rank (see the module
    docstring). The surface the backend uses: `param_groups` (set `lr` there), `state`
    (this rank's owned parameters only), `step()`, `zero_grad()`, `state_dict()`,
    `load_state_dict()`, `full_state()`; `params`, `owner_of()`, `owns()` for checkpoints."""

    def __init__(self, params: Iterable, dp_group=None, *, dp_group_of: Callable[[Tensor], object] | None = None,
                 lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False):
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        groups = [{**g, "params": list(g["params"])} for g in groups]
        self.params: list[Tensor] = [p for g in groups for p in g["params"]]  # torch's parameter ids
        if len({id(p) for p in self.params}) != len(self.params):
            raise ValueError("ShardedAdamW: a parameter appears more than once")
        self.dp_group = dp_group
        # the parameters split by the group they are replicated over, in order of first appearance
        # (the same on every rank), each split's owners assigned within it
        self._replicas: list[_Replicas] = []
        self._split: list[_Replicas] = []  # per parameter
        for i, p in enumerate(self.params):
            group = dp_group_of(p) if dp_group_of is not None else dp_group
            split = next((r for r in self._replicas if r.group is group), None)
            if split is None:
                split = _Replicas(group, dist.get_world_size(group) if group is not None else 1,
                                  dist.get_rank(group) if group is not None else 0, [])
                self._replicas.append(split)
            split.members.append(i)
            self._split.append(split)
        self._owner = [0] * len(self.params)  # within the parameter's group
        for split in self._replicas:
            for i, r in zip(split.members, assign_owners([self.params[i].numel() for i in split.members], split.size)):
                self._owner[i] = r
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._group_index = [[self._index[id(p)] for p in g["params"]] for g in groups]
        inner = [{**g, "params": [p for p in g["params"] if self.owns(p)]} for g in groups]
        self.inner = torch.optim.AdamW(inner or [{"params": []}], lr=lr, betas=betas, eps=eps,
                                       weight_decay=weight_decay, amsgrad=amsgrad)

    # ------------------------------------------------------------ ownership

    def owner_of(self, p: Tensor) -> int:
        """The rank, in the group p is replicated over, that keeps p's state."""
        return self._owner[self._index[id(p)]]

    def owns(self, p: Tensor) -> bool:
        return self._owns(self._index[id(p)])

    def _owns(self, i: int) -> bool:
        return self._owner[i] == self._split[i].rank

    @property
    def param_groups(self) -> list[dict]:
        """The groups of torch's AdamW on this rank (their `params` are this rank's owned ones; the
        hyperparameters are the same on every rank)."""
        return self.inner.param_groups

    @property
    def state(self):
        """{parameter: AdamW state} of the parameters this rank owns."""
        return self.inner.state

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds."""
        return sum(v.numel() * v.element_size() for st in self.inner.state.values() for v in st.values()
                   if isinstance(v, Tensor))

    # ------------------------------------------------------------ step

    @torch.no_grad()
    def step(self) -> None:
        """AdamW on the owned parameters, then every parameter from its owner. Collective over the groups."""
        self.inner.step()
        for split in self._replicas:
            for r in range(split.size):
                self._move(split, [self.params[i].data for i in split.members if self._owner[i] == r], r, None)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().zero_()

    # ------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """torch's optimizer state-dict format over *all* parameters (ids = positions in `params`),
        with this rank's owned parameters' state only: local, like one rank's shard."""
        sd = self.inner.state_dict()
        owned = [i for i in range(len(self.params)) if self._owns(i)]
        return {"state": {owned[k]: v for k, v in sd["state"].items()},
                "param_groups": [{**{k: v for k, v in g.items() if k != "params"}, "params": list(ids)}
                                 for g, ids in zip(sd["param_groups"], self._group_index)]}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict in torch's format over all parameters (a plain AdamW's, or any rank's
        `state_dict()` that holds this rank's owned parameters): takes the owned parameters' state."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self._group_index):
            raise ValueError(f"the state dict has {len(groups)} parameter groups, the optimizer "
                             f"{len(self._group_index)}")
        local = {}  # global id -> local id of the owned parameters
        for i in range(len(self.params)):
            if self._owns(i):
                local[i] = len(local)
        state = {}
        for i, j in local.items():
            if i in state_dict["state"]:
                state[j] = state_dict["state"][i]
        missing = [i for i in local if i not in state_dict["state"]]
        if state and missing:
            raise ValueError(f"the state dict has no state for parameter(s) {missing[:5]} this rank owns")
        inner_groups = []
        for g, ids in zip(groups, self._group_index):
            if len(g["params"]) != len(ids):
                raise ValueError("a parameter group of the state dict does not match the optimizer's")
            inner_groups.append({**{k: v for k, v in g.items() if k != "params"},
                                 "params": [local[i] for i in ids if i in local]})
        self.inner.load_state_dict({"state": state, "param_groups": inner_groups})

    def full_state(self, named_params: Iterable[tuple[str, Tensor]], all_ranks: bool = False) -> dict:
        """{name: {"step", "exp_avg", "exp_avg_sq"}} of every given parameter that has state (this
        rank's TP shards), on rank 0 of the parameter's group (every rank of it with `all_ranks`);
        {} elsewhere. Collective over the groups."""
        named = [(n, p) for n, p in named_params if id(p) in self._index]
        keys = STATE_KEYS + (("max_exp_avg_sq",) if self.param_groups[0].get("amsgrad") else ())
        out: dict = {}
        for split in self._replicas:
            mine = [(n, p) for n, p in named if self._split[self._index[id(p)]] is split]
            # which parameters have state is known to their owners only
            have = [self._index[id(p)] for _, p in mine if self.owns(p) and self.state.get(p)]
            if split.size > 1:
                parts: list = [None] * split.size
                dist.all_gather_object(parts, have, group=split.group)
                have = [i for part in parts for i in part]
            have = set(have)
            receive = all_ranks or split.rank == 0
            for r in range(split.size):
                tensors, slots = [], []
                for name, p in mine:
                    i = self._index[id(p)]
                    if self._owner[i] != r or i not in have:
                        continue
                    st = self.state[p] if r == split.rank else None
                    for key in ("step",) + keys:
                        if st is not None:  # the step travels as an fp32 scalar on the parameter's device
                            t = st[key].detach().to(p.device, torch.float32) if key == "step" else st[key].detach()
                        elif receive:
                            t = torch.empty((), dtype=torch.float32, device=p.device) if key == "step" \
                                else torch.empty_like(p)
                        else:
                            t = None
                        tensors.append(t)
                        slots.append((name, key))
                if not slots:
                    continue
                self._move(split, tensors, r, None if all_ranks else 0)
                if receive:
                    for (name, key), t in zip(slots, tensors):
                        out.setdefault(name, {})[key] = t.clone()
        return out

    # ------------------------------------------------------------ communication

    def _move(self, split: _Replicas, tensors: list, src: int, dst: int | None) -> None:
        """Copy the owner `src`'s tensors to rank `dst` of the split's group (every rank when None), in
        place, through flat buffers per dtype and device. Ranks that receive nothing pass Nones."""
        if split.size == 1 or not tensors or src == dst:
            return
        me, group = split.rank, split.group
        if dst is not None and me not in (src, dst):
            return
        peer = split.global_rank(src if me != src else (dst if dst is not None else src))
        buckets: dict = {}
        for t in tensors:
            key = (t.dtype, t.device)
            bucket = buckets.setdefault(key, [[]])
            if bucket[-1] and sum(x.numel() for x in bucket[-1]) + t.numel() > BUCKET_NUMEL:
                bucket.append([])
            bucket[-1].append(t)
        for (dtype, device), chunks in buckets.items():
            for chunk in chunks:
                if me == src:
                    buf = torch.cat([t.reshape(-1) for t in chunk])
                else:
                    buf = torch.empty(sum(t.numel() for t in chunk), dtype=dtype, device=device)
                if dst is None:
                    dist.broadcast(buf, src=split.global_rank(src), group=group)
                elif me == src:
                    dist.send(buf, dst=peer, group=group)
                else:
                    dist.recv(buf, src=peer, group=group)
                if me != src:
                    offset = 0
                    for t in chunk:
                        t.copy_(buf[offset:offset + t.numel()].view_as(t))
                        offset += t.numel()
