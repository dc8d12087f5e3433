#!/usr/bin/env python
"""Asynchronous RL training with slime: rollout k+1 generates while the trainer trains on rollout k.

    python train_async.py <the flags of train.py> [--update-weights-interval N] [--max-staleness N]
                          [--partial-rollout --over-sampling-batch-size M] [--fully-async]

Engines and train ranks run on separate devices (no --colocate). Weights go to the engines every
--update-weights-interval rollouts, and only when no request is in flight: the driver first waits
for the generation under way to finish, so its samples are one policy version stale (more with a
longer interval; each Sample records the versions that wrote it). With --fully-async a background
loop keeps --async-groups-in-flight groups generating across rollouts; a weight update then pauses
the requests in flight, swaps the weights and continues them. Stale tokens are corrected with the
rollout log-probs (--use-tis); --max-staleness bounds the lag.
"""

import time

from slime import checkpoint
from slime.arguments import parse_args
from slime.driver import Run
from slime.utils.errors import SlimeConfigError, run_main


def main() -> None:
    args = parse_args(overlap_training=True)
    if args.colocate:
        raise SlimeConfigError("train_async.py overlaps generation and training, which needs separate devices; "
                               "drop --colocate, or use train.py for a colocated run")
    if args.debug_rollout_only or args.debug_train_only or args.loss_type == "sft_loss":
        raise SlimeConfigError("train_async.py needs both engines and train ranks; use train.py for "
                               "--debug-rollout-only, --debug-train-only and --loss-type sft_loss")
    run = Run(args)

    with checkpoint.resume_hint_on_failure(args):
        run.push_weights(run.start_rollout_id)
        run.evaluate_before_training()
        ids = list(run.rollout_ids())
        next_generation = run.start_generate(ids[0]) if ids else None  # an object ref in flight
        generated = None  # or its result, when the driver had to wait for it before a weight update
        for rollout_id in ids:
            step_start = time.perf_counter()
            data_refs, record = generated or run.wait_generate(next_generation, rollout_id)
            waited = time.perf_counter() - step_start  # the trainer idles only while waiting for data
            last = rollout_id + 1 == args.num_rollout
            # the next rollout generates (with the current weights) while this one trains
            next_generation, generated = (None if last else run.start_generate(rollout_id + 1)), None
            record.update(run.train(rollout_id, data_refs))

            if (rollout_id + 1) % args.update_weights_interval == 0 or last:
                if args.fully_async:  # requests stay in flight: hold them while the weights change
                    run.pause_generation()
                    record["perf/update_weights_time"] = run.push_weights(rollout_id + 1)
                    run.continue_generation(rollout_id + 1)
                else:  # weights never change under a request: let the generation under way finish first
                    if next_generation is not None:
                        wait_start = time.perf_counter()
                        generated = run.wait_generate(next_generation, rollout_id + 1)
                        waited += time.perf_counter() - wait_start
                    record["perf/update_weights_time"] = run.push_weights(rollout_id + 1)
            record["perf/step_time"] = time.perf_counter() - step_start
            record["perf/wait_time_ratio"] = waited / record["perf/step_time"]
            run.finish_rollout(rollout_id, record)
    run.close()


if __name__ == "__main__":
    run_main(main)
