"""TrainGroup: `args.dp_size` TrainActor Ray actors forming one data-parallel group.

Every method blocks and returns rank 0's result (the ranks agree). A failure in any
rank is raised at once (the others may be stuck in a collective) with the role and
rank in the message; a `SlimeError` keeps its type so `run_main` prints one line.

PPO: an actor group built with `critic=TrainGroup(args, role="critic", ...)` (same
bundles) drives it: `train` gets the critic's values first, trains the actor on
advantages built from them, then trains the critic on the actor's returns (rank i to
rank i, object refs only); `init`, `save`/`load` (under `<path>/critic`) and
`shutdown` include the critic.
"""

from __future__ import annotations

from typing import Any

import ray
from ray.exceptions import RayActorError
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from slime.utils.ray_calls import first_line
from slime.training.actor import TrainActor
from slime.utils.errors import RunFailure, SlimeError
from slime.utils.threads import cpu_threads

class TrainGroupError(RunFailure):
    """A train rank failed; the message names the role, rank and method."""



_RemoteTrainActor = ray.remote(TrainActor)


class TrainGroup:
    def __init__(self, args, role: str = "actor", bundles: list[tuple[PlacementGroup, int]] | None = None,
                 critic: "TrainGroup | None" = None):
        self.args = args
        self.role = role
        self.critic = critic
        n = args.dp_size
        if bundles is not None and len(bundles) < n:
            raise ValueError(f"TrainGroup needs {n} bundles, got {len(bundles)}")
        threads = str(cpu_threads(args, "train", n))
        env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false"}
        self._actors = []
        for rank in range(n):
            opts: dict[str, Any] = {"num_cpus": 0, "runtime_env": {"env_vars": dict(env, RANK=str(rank),
                                                                                    WORLD_SIZE=str(n))}}
            if bundles is not None:
                pg, idx = bundles[rank]
                opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=idx
                )
                if pg.bundle_specs[idx].get("GPU", 0) > 0:  # actor and critic share a device under PPO
                    opts["num_gpus"] = 0.2 if args.colocate else (0.5 if args.use_critic else 1)
            elif ray.cluster_resources().get("GPU", 0) > 0:
                opts["num_gpus"] = 1
            self._actors.append(
                _RemoteTrainActor.options(**opts).remote(args, rank, n, role)
            )

    def __len__(self) -> int:
        return len(self._actors)

    # ------------------------------------------------------------ plumbing

    def _call(self, method: str, *per_rank_args: list, **kwargs) -> list:
        """Call `method` on every rank (rank i gets per_rank_args[j][i]); wait for all, fail fast."""
        refs = [
            getattr(a, method).remote(*(arg[i] for arg in per_rank_args), **kwargs)
            for i, a in enumerate(self._actors)
        ]
        return self._wait(method, refs)

    def _wait(self, method: str, refs: list) -> list:
        rank_of = {r: i for i, r in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        timeout = getattr(self.args, "stage_timeout", None)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=timeout)
            if not ready:
                ranks = sorted(rank_of[r] for r in pending)
                raise TrainGroupError(
                    f"{self.role} rank(s) {ranks}: {method} did not finish within {timeout:.0f} s (--stage-timeout)"
                )
            ref = ready[0]
            rank = rank_of[ref]
            try:
                results[rank] = ray.get(ref, timeout=timeout)  # ready: bounded for the transfer alone
            except RayActorError as e:
                raise TrainGroupError(f"{self.role} rank {rank}: died during {method} ({first_line(e)})") from None
            except Exception as e:  # noqa: BLE001 - re-raised with the rank
                cause = getattr(e, "cause", None) or e
                msg = f"{self.role} rank {rank}: {method} failed: {type(cause).__name__}: {cause}"
                if isinstance(cause, SlimeError):
                    try:
                        err = type(cause)(msg)
                    except Exception:  # noqa: BLE001 - an unusual constructor
                        err = SlimeError(msg)
                    raise err from e
                raise TrainGroupError(msg) from e
        return results

    def _all(self, method: str, *args, **kwargs) -> list:
        return self._call(method, *[[a] * len(self._actors) for a in args], **kwargs)

    # ------------------------------------------------------------ API

    def init(self) -> None:
        # the group's store lives on rank 0's node, at the address Ray knows that node by
        master_addr, master_port = self._wait("rendezvous", [self._actors[0].rendezvous.remote()])[0]
        self._all("init", master_addr, master_port)
        if self.critic is not None:
            self.critic.init()

    def addresses(self) -> list[str]:
        """The node address of each rank (rank i at index i)."""
        return self._all("address")

    def train(self, rollout_id: int, batches: list) -> dict[str, float]:
        """batches[i] (a RolloutBatch or an ObjectRef to one) is rank i's data; returns the metrics
        (with the critic's `critic/*` ones when a critic is attached)."""
        if len(batches) != len(self._actors):
            raise ValueError(f"train got {len(batches)} batches for {len(self._actors)} ranks")
        if self.critic is None:
            return self._call("train", [rollout_id] * len(self._actors), list(batches))[0]
        critic = self.critic._actors
        values = [c.compute_values.remote(rollout_id, b) for c, b in zip(critic, batches)]
        trained = [a.train.remote(rollout_id, b, v) for a, b, v in zip(self._actors, batches, values)]
        returns = [a.last_returns.remote() for a in self._actors]  # runs after train on each rank
        critic_trained = [c.train_critic.remote(rollout_id, b, r) for c, b, r in zip(critic, batches, returns)]
        metrics = self._wait("train", trained)[0]
        metrics.update(self.critic._wait("train_critic", critic_trained)[0])
        return metrics

    def update_weights(self, engine_urls: list[str], weight_version: int) -> dict[str, float]:
        """Push the current weights to every engine; returns rank 0's
        {"bytes", "payload_bytes", "buckets", "seconds", "num_engines"}."""
        return self._all("update_weights", list(engine_urls), weight_version)[0]

    def offload(self) -> dict[str, float]:
        """--colocate: every rank (and the critic's) frees its model and optimizer memory while the
        engines generate; returns {"bytes", "seconds", "rss"} summed over ranks (seconds: max)."""
        return self._sum_stats("offload")

    def onload(self) -> dict[str, float]:
        """Undo `offload` before training; same return as `offload`."""
        return self._sum_stats("onload")

    def _sum_stats(self, method: str) -> dict[str, float]:
        stats = self._all(method)
        if self.critic is not None:
            stats += self.critic._all(method)
        return {"bytes": sum(s["bytes"] for s in stats), "rss": sum(s["rss"] for s in stats),
                "seconds": max(s["seconds"] for s in stats)}

    def check_weights(self, engine_urls: list[str]) -> int:
        """`--check-weight-update-equal`: every engine's weights equal the trainer's, bit for bit
        (a mismatch is an error naming the engine and parameters); returns parameters compared."""
        return self._all("check_weights", list(engine_urls))[0]

    def save(self, path: str) -> None:
        self._all("save", str(path))
        if self.critic is not None:
            self.critic.save(f"{path}/critic")

    def load(self, path: str) -> None:
        self._all("load", str(path))
        if self.critic is not None:
            self.critic.load(f"{path}/critic")

    def full_state(self, optimizer: bool = True) -> tuple[dict, dict | None]:
        """Full model (and optimizer) state from rank 0, for tests and tools."""
        return self._all("full_state", optimizer)[0]

    def shutdown(self) -> None:
        if self.critic is not None:
            self.critic.shutdown()
        if not self._actors:
            return
        refs = [a.shutdown.remote() for a in self._actors]
        ray.wait(refs, num_returns=len(refs), timeout=30)  # best effort; a stuck rank is killed below
        for a in self._actors:
            ray.kill(a)
        self._actors = []


class NoTraining:
    """Stands in for the train group under --debug-rollout-only: rollouts are generated and
    scored, nothing is trained and the engines keep the --hf-checkpoint weights."""

    def init(self) -> None:
        pass

    def addresses(self) -> list[str]:
        return []

    def train(self, rollout_id: int, batches: list) -> dict[str, float]:
        return {}

    def update_weights(self, engine_urls: list[str], weight_version: int) -> dict[str, float]:
        return {}

    def shutdown(self) -> None:
        pass

