"""Ray placement groups for train ranks and rollout engines.

On a CUDA cluster each device is a bundle `{"GPU": 1, "CPU": 1}`; on a machine
without CUDA a "GPU" is a process and each bundle is a sliver of CPU
(`{"CPU": 0.01}`), so `--actor-num-gpus-per-node 2` still means two ranks.
With `--colocate`, engines share the train ranks' bundles; otherwise they get
their own. Rank i always maps to bundle i (stable rank-to-device mapping). The
engines of models served beside the policy (`--sglang-config`) take the rollout
devices after the policy's, in the file's order (`--rollout-num-gpus` counts them all).

`--actor-num-nodes N` (N > 1) puts `--actor-num-gpus-per-node G` train ranks on each of N distinct
nodes, as slime does: ranks i*G .. i*G+G-1 are pinned to the i-th node (by Ray's node-id label)
among the alive nodes that have G devices; the engines go wherever the rest of the group fits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import ray
from ray.util.placement_group import NODE_ID_LABEL_KEY as NODE_ID_LABEL
from ray.util.placement_group import PlacementGroup, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from slime.utils.errors import SlimeError

CPU_BUNDLE = {"CPU": 0.01}
GPU_BUNDLE = {"GPU": 1, "CPU": 1}
PLACEMENT_TIMEOUT_S = 60.0


def use_gpus() -> bool:
    return bool(ray.cluster_resources().get("GPU", 0))


@dataclass
class Placement:
    pg: PlacementGroup
    actor_bundles: list[int]  # bundle index of train rank i
    engine_bundles: list[int]  # bundle index of the first device of engine i
    model_bundles: dict[str, list[int]] = field(default_factory=dict)  # a served model's: of its engine i

    def strategy(self, bundle: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=bundle)


def create(args) -> Placement:
    """Reserve every device the run needs, or fail with what is missing."""
    bundle = GPU_BUNDLE if use_gpus() else CPU_BUNDLE
    n_actor = args.dp_size
    n_total = n_actor if args.colocate else n_actor + args.rollout_num_gpus
    need = {k: _num(v * n_total) for k, v in bundle.items()}
    served = "".join(f", {m.num_gpus} of them for {m.name}" for m in args.served_models)
    what = (f"{n_total} bundles of {bundle} ({n_actor} train ranks"
            f"{' with the engines colocated' if args.colocate else f' + {args.rollout_num_gpus} rollout devices'}"
            f"{served})")
    # train ranks on N distinct nodes: the nodes are counted and checked first (the error names them)
    selectors = _train_node_selectors(args, bundle, n_total) if args.actor_num_nodes > 1 else None
    # more than the whole cluster has: say so now instead of waiting (no autoscaler adds nodes here)
    total = ray.cluster_resources()
    missing = {k: _num(v - total.get(k, 0)) for k, v in need.items() if v > total.get(k, 0) + 1e-9}
    if missing:
        raise SlimeError(f"cannot place {what}: need {need}, the cluster has {_fmt(total, need)} in total "
                         f"(missing {missing}); lower --actor-num-gpus-per-node / --rollout-num-gpus or add nodes")
    pg = placement_group([dict(bundle) for _ in range(n_total)], strategy="PACK", bundle_label_selector=selectors)
    try:
        ray.get(pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        ray.util.remove_placement_group(pg)
        raise SlimeError(
            f"cannot place {what} within {PLACEMENT_TIMEOUT_S:.0f} s: need {need}, the cluster has "
            f"{_fmt(ray.available_resources(), need)} available of {_fmt(total, need)} (other jobs hold the rest, "
            "or no single set of nodes fits the bundles)"
        ) from None
    engine_start = 0 if args.colocate else n_actor
    engine_bundles = [engine_start + i * args.rollout_num_gpus_per_engine for i in range(args.num_engines)]
    model_bundles, start = {}, engine_start + args.num_engines * args.rollout_num_gpus_per_engine
    for m in args.served_models:  # the frozen models' engines, after the policy's
        model_bundles[m.name] = [start + i * m.gpus_per_engine for i in range(m.num_engines)]
        start += m.num_gpus
    return Placement(pg=pg, actor_bundles=list(range(n_actor)), engine_bundles=engine_bundles,
                     model_bundles=model_bundles)


def _train_node_selectors(args, bundle: dict, n_total: int) -> list[dict[str, str]]:
    """One label selector per bundle: train rank i's pins it to the (i // G)-th train node, the
    engines' bundles are free. Raises SlimeError naming the nodes when N of them do not fit."""
    n, g = args.actor_num_nodes, args.actor_num_gpus_per_node
    per_node = {k: _num(v * g) for k, v in bundle.items()}
    nodes = sorted((x for x in ray.nodes() if x["Alive"]), key=lambda x: x["NodeManagerAddress"])
    if len(nodes) < n:
        raise SlimeError(f"--actor-num-nodes {n}: the cluster has {len(nodes)} alive node(s) "
                         f"({', '.join(x['NodeManagerAddress'] for x in nodes)}); start more nodes or lower it")
    fits = [x for x in nodes if all(x["Resources"].get(k, 0) >= v - 1e-9 for k, v in per_node.items())]
    if len(fits) < n:
        short = "; ".join(f"node {x['NodeManagerAddress']} has {_fmt(x['Resources'], per_node)}"
                          for x in nodes if x not in fits)
        raise SlimeError(f"--actor-num-nodes {n} --actor-num-gpus-per-node {g}: each train node needs "
                         f"{per_node}, only {len(fits)} of {len(nodes)} node(s) have it ({short})")
    chosen = [x["NodeID"] for x in fits[:n]]
    return [{NODE_ID_LABEL: chosen[i // g]} for i in range(args.dp_size)] + [{} for _ in range(n_total - args.dp_size)]


def _fmt(resources: dict, like: dict) -> dict:
    """The entries of `resources` named in `like` (0 when absent), rounded."""
    return {k: _num(resources.get(k, 0)) for k in like}


def _num(v: float) -> float | int:
    v = round(float(v), 4)
    return int(v) if v.is_integer() else v
