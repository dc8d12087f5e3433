#!/usr/bin/env python
"""Synchronous RL training with slime: generate a rollout, train on it, push the weights, repeat.

    python train.py --hf-checkpoint DIR --prompt-data data.jsonl --input-key prompt --label-key label \
        --rollout-batch-size 4 --n-samples-per-prompt 4 --global-batch-size 16 --num-rollout 3 ...

Flags: `python train.py --help`; the loop's parts: docs/ and ../shared/DESIGN.md.
"""

import time

import ray
from tqdm import tqdm

from slime import checkpoint
from slime.arguments import parse_args
from slime.observability.metrics import MetricsLogger, console_line
from slime.ray import cluster, placement
from slime.ray.calls import get
from slime.ray.actor_group import NoTraining, TrainGroup
from slime.rollout.manager import RolloutManager
from slime.utils.errors import run_main


def main() -> None:
    args = parse_args()
    cluster.init()
    pgs = placement.create(args)

    # Rollout: data source, engines, rewards.
    rollout = ray.remote(num_cpus=0, max_concurrency=2)(RolloutManager).remote(args, pgs)  # 2: progress polls
    engine_urls = get(rollout.init.remote(), "start-up", "RolloutManager", args.stage_timeout)

    # Training: data-parallel train ranks, resumed from --load when it holds a checkpoint.
    bundles = [(pgs.pg, b) for b in pgs.actor_bundles]
    critic = TrainGroup(args, role="critic", bundles=bundles) if args.use_critic else None  # PPO value model
    actor = (NoTraining() if args.debug_rollout_only  # generate and score only
             else TrainGroup(args, role="actor", bundles=bundles, critic=critic))
    actor.init()
    start_rollout_id = checkpoint.load(args, actor, rollout)
    logger = MetricsLogger.from_args(args, start_rollout_id)
    print(f"slime: {len(engine_urls)} engine(s) at {', '.join(engine_urls) or '-'}; "
          f"{args.dp_size} train rank(s); metrics in {logger.path}")

    def push_weights(version: int) -> None:
        """The engines serve the trainer's weights (policy version = rollouts trained). SFT and
        --debug-train-only start no engines, so there is nothing to push."""
        if engine_urls:
            actor.update_weights(engine_urls, weight_version=version)
            if args.check_weight_update_equal:
                actor.check_weights(engine_urls)

    push_weights(start_rollout_id)

    def evaluate(trained_rollouts: int) -> None:
        if not (args.eval_sets or args.eval_function_path):
            return
        due = trained_rollouts % args.eval_interval == 0 or trained_rollouts == args.num_rollout
        if due:
            metrics = get(rollout.eval.remote(trained_rollouts), "eval", "RolloutManager", args.stage_timeout,
                          progress=rollout.progress.remote)
            logger.log(trained_rollouts, {"rollout_id": trained_rollouts, "trained_rollouts": trained_rollouts, **metrics})
            tqdm.write(f"eval after {trained_rollouts} rollouts: "
                       + ", ".join(f"{k}={v:.3f}" for k, v in metrics.items() if k.count("/") == 1))

    # A dead or stuck actor ends the run with an error that says where to resume from.
    with checkpoint.resume_hint_on_failure(args):
        if start_rollout_id == 0 and not args.skip_eval_before_train:
            evaluate(0)  # with --num-rollout 0 this is the whole (eval-only) run
        for rollout_id in tqdm(range(start_rollout_id, args.num_rollout), desc="rollouts", unit="rollout",
                               initial=start_rollout_id, total=args.num_rollout):
            step_start = time.perf_counter()
            data_refs, record = get(rollout.generate.remote(rollout_id), f"rollout {rollout_id}", "RolloutManager",
                                    args.stage_timeout, progress=rollout.progress.remote)

            train_start = time.perf_counter()
            record.update(actor.train(rollout_id, data_refs))
            record["perf/train_time"] = time.perf_counter() - train_start

            sync_start = time.perf_counter()
            push_weights(rollout_id + 1)
            record["perf/update_weights_time"] = time.perf_counter() - sync_start
            record["perf/step_time"] = time.perf_counter() - step_start

            logger.log(rollout_id, {"rollout_id": rollout_id, **record})
            tqdm.write(console_line(rollout_id, record))

            last = rollout_id + 1 == args.num_rollout
            if args.save and (last or (args.save_interval and (rollout_id + 1) % args.save_interval == 0)):
                path = checkpoint.save(args, rollout_id, actor, rollout)
                tqdm.write(f"saved {path}")
            evaluate(rollout_id + 1)

    logger.close()
    ray.get(rollout.shutdown.remote())
    actor.shutdown()


if __name__ == "__main__":
    run_main(main)
