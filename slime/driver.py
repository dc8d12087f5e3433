"""The parts of a training run that `train.py` and `train_async.py` share.

`Run(args)` starts everything (Ray, placement, the RolloutManager and its engines, the train
ranks, resume from `--load`, metrics) and offers the loop's steps by name: `generate`, `train`,
`push_weights`, `finish_rollout` (log, save, evaluate). The drivers stay a readable loop.

With `--colocate` the engines and the train ranks share devices and take turns with the memory
(docs/cluster.md): `train` first has the engines release their KV cache and weights
(`rollout.offload`) and the ranks take their state back (`before_train`); `push_weights` brings
the engines' weights back (`rollout.onload_weights`), pushes the new ones, offloads the ranks and
then gives the engines their KV cache again (`rollout.onload_kv`, in `before_generate`), so the
next generation runs with the trainer offloaded. The memory each side holds at every turn is
measured and logged (`memory/*`, `perf/*load*`). The driver talks to engines only through such
named calls of the RolloutManager; it imports nothing from `slime.engines`.
"""

from __future__ import annotations

import tempfile
import time

from tqdm import tqdm

from slime import checkpoint
from slime.observability.metrics import MetricsLogger, console_line
from slime.ray import cluster, placement
from slime.ray.actor_group import NoTraining, TrainGroup
from slime.utils import run_dirs
from slime.utils.ray_calls import get
from slime.rollout.manager import start_rollout_manager


class Run:
    def __init__(self, args):
        self.args = args
        left = [d for base in {run_dirs.shm_or_tmp(), tempfile.gettempdir()} for d in run_dirs.sweep(base)]
        if left:  # a killed run's weight buckets, stashes, offloaded state
            print(f"slime: removed {len(left)} temporary director{'y' if len(left) == 1 else 'ies'} of a run that "
                  f"ended without cleaning up: {', '.join(sorted(left))}")
        cluster.init(args)
        pgs = placement.create(args)

        # Rollout: data source, engines, rewards. The engines start while the train ranks do.
        self.rollout, rollout_ready = start_rollout_manager(args, pgs)

        # Training: data-parallel train ranks, resumed from --load when it holds a checkpoint.
        bundles = [(pgs.pg, b) for b in pgs.actor_bundles]
        critic = TrainGroup(args, role="critic", bundles=bundles) if args.use_critic else None  # PPO value model
        self.actor = (NoTraining() if args.debug_rollout_only  # generate and score only
                      else TrainGroup(args, role="actor", bundles=bundles, critic=critic))
        self.actor.init()
        self.engine_urls = get(rollout_ready, "start-up", "RolloutManager", args.stage_timeout)
        if args.use_fault_tolerance and self.engine_urls:  # a restarted engine gets the trainer's weights
            get(self.rollout.attach_trainer.remote(self.actor), "start-up", "RolloutManager", args.stage_timeout)
        self.start_rollout_id = checkpoint.load(args, self.actor, self.rollout)
        self.logger = MetricsLogger.from_args(args, self.start_rollout_id)
        self.handoff: dict[str, float] = {}  # --colocate: memory and times of the last turns
        nodes = ", ".join(sorted(set(self.actor.addresses()))) or "-"
        print(f"slime: {len(self.engine_urls)} engine(s) at {', '.join(self.engine_urls) or '-'}; "
              f"{args.dp_size} train rank(s) on {nodes}{'; colocated' if args.colocate else ''}; weights by "
              f"{'a LoRA adapter (peft directory)' if args.lora_sync == 'adapter' else args.update_weights_mode}; "
              f"metrics in {self.logger.path}")
        if args.served_models and self.engine_urls:  # --sglang-config: the frozen models beside the policy
            served = get(self.rollout.served_model_urls.remote(), "start-up", "RolloutManager", args.stage_timeout)
            print("slime: served beside the policy (" + args.policy_model_name + "): "
                  + "; ".join(f"{name} at {', '.join(urls)}" for name, urls in served.items()))
        for note in getattr(args, "start_up_notes", ()):  # what slime's script flags mean here (slime.script_flags)
            print(f"slime: {note}")

    def rollout_ids(self):
        args = self.args
        return tqdm(range(self.start_rollout_id, args.num_rollout), desc="rollouts", unit="rollout",
                    initial=self.start_rollout_id, total=args.num_rollout)

    def start_generate(self, rollout_id: int):
        return self.rollout.generate.remote(rollout_id)

    def wait_generate(self, ref, rollout_id: int):
        """(per-rank data refs, rollout metrics) of a generate call started with `start_generate`."""
        return get(ref, f"rollout {rollout_id}", "RolloutManager", self.args.stage_timeout,
                   progress=self.rollout.progress.remote)

    def pause_generation(self) -> None:
        """--fully-async: hold the requests in flight (the engines keep their state) while the weights change."""
        get(self.rollout.pause_generation.remote(), "pause generation", "RolloutManager", self.args.stage_timeout)

    def continue_generation(self, version: int) -> None:
        """Resume the held requests, now under policy `version`."""
        get(self.rollout.continue_generation.remote(version), "continue generation", "RolloutManager",
            self.args.stage_timeout)

    def _colocated(self) -> bool:
        return bool(self.args.colocate and self.engine_urls and hasattr(self.actor, "offload"))

    def before_train(self) -> None:
        """--colocate: the engines release their KV cache and weights, the train ranks onload."""
        if not self._colocated():
            return
        h = self.handoff
        h.update(get(self.rollout.offload.remote(), "engine memory release", "RolloutManager", self.args.stage_timeout))
        stats = self.actor.onload()
        h["perf/onload_time"], h["memory/train_rss_mb_training"] = stats["seconds"], stats["rss"] / 2**20

    def before_generate(self) -> None:
        """--colocate: the train ranks offload, the engines take their KV cache back (their weights
        are already back: `push_weights` onloads them before it pushes)."""
        if not self._colocated():
            return
        h = self.handoff
        stats = self.actor.offload()
        h["perf/offload_time"], h["memory/train_rss_mb_offloaded"] = stats["seconds"], stats["rss"] / 2**20
        h["memory/train_offloaded_mb"] = stats["bytes"] / 2**20
        h.update(get(self.rollout.onload_kv.remote(), "engine memory resume", "RolloutManager",
                     self.args.stage_timeout))

    def train(self, rollout_id: int, data_refs) -> dict[str, float]:
        start = time.perf_counter()
        self.before_train()
        metrics = self.actor.train(rollout_id, data_refs)
        metrics["perf/train_time"] = time.perf_counter() - start
        return metrics

    def push_weights(self, version: int) -> float:
        """The engines serve the trainer's weights (policy version = rollouts trained); returns the
        seconds it took. SFT and --debug-train-only start no engines: nothing to push."""
        start = time.perf_counter()
        if self.engine_urls:
            if self.args.use_fault_tolerance:  # never push into a half-restarted engine
                get(self.rollout.wait_for_engines.remote(), "engine restart", "RolloutManager",
                    self.args.stage_timeout)
            if self._colocated():  # released weights come back before they are overwritten
                get(self.rollout.onload_weights.remote(), "engine memory resume", "RolloutManager",
                    self.args.stage_timeout)
            stats = self.actor.update_weights(self.engine_urls, weight_version=version) or {}
            self.handoff.update({f"weights/{k}": float(stats[k]) for k in ("buckets", "bytes") if k in stats})
            if self.args.check_weight_update_equal:
                self.actor.check_weights(self.engine_urls)
            get(self.rollout.set_weight_version.remote(version), "weight push", "RolloutManager",
                self.args.stage_timeout)
        elapsed = time.perf_counter() - start
        self.before_generate()
        return elapsed

    def evaluate(self, trained_rollouts: int) -> None:
        args = self.args
        if not (args.eval_sets or args.eval_function_path):
            return
        if trained_rollouts % args.eval_interval == 0 or trained_rollouts == args.num_rollout:
            metrics = get(self.rollout.eval.remote(trained_rollouts), "eval", "RolloutManager", args.stage_timeout,
                          progress=self.rollout.progress.remote)
            self.logger.log(trained_rollouts, {"rollout_id": trained_rollouts, "trained_rollouts": trained_rollouts,
                                               **metrics})
            tqdm.write(f"eval after {trained_rollouts} rollouts: "
                       + ", ".join(f"{k}={v:.3f}" for k, v in metrics.items() if k.count("/") == 1))

    def evaluate_before_training(self) -> None:
        """Eval of the starting weights (with --num-rollout 0 this is the whole, eval-only run)."""
        if self.start_rollout_id == 0 and not self.args.skip_eval_before_train:
            self.evaluate(0)

    def finish_rollout(self, rollout_id: int, record: dict) -> None:
        """Log the rollout's record, save when due, evaluate when due."""
        args = self.args
        record = {**{k: v for k, v in self.handoff.items() if v is not None}, **record}
        self.logger.log(rollout_id, {"rollout_id": rollout_id, **record})
        tqdm.write(console_line(rollout_id, record))
        last = rollout_id + 1 == args.num_rollout
        if args.save and (last or (args.save_interval and (rollout_id + 1) % args.save_interval == 0)):
            tqdm.write(f"saved {checkpoint.save(args, rollout_id, self.actor, self.rollout)}")
        self.evaluate(rollout_id + 1)

    def close(self) -> None:
        self.logger.close()
        self.actor.shutdown()  # first: it leaves the engines' weight-update group while they still run
        get(self.rollout.shutdown.remote(), "shutdown", "RolloutManager", self.args.stage_timeout)
