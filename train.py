#!/usr/bin/env python
"""Synchronous RL training with slime: generate a rollout, train on it, push the weights, repeat.

    python train.py --hf-checkpoint DIR --prompt-data data.jsonl --input-key prompt --label-key label \
        --rollout-batch-size 4 --n-samples-per-prompt 4 --global-batch-size 16 --num-rollout 3 ...

Flags: `python train.py --help`; the loop's parts: slime/driver.py, docs/ and ../shared/DESIGN.md.
`train_async.py` is the same loop with the next rollout generated while this one trains.
"""

import time

from slime import checkpoint
from slime.arguments import parse_args
from slime.driver import Run
from slime.utils.errors import run_main


def main() -> None:
    args = parse_args()
    run = Run(args)  # Ray, engines, train ranks, resume from --load, metrics

    # A dead or stuck actor ends the run with an error that says where to resume from.
    with checkpoint.resume_hint_on_failure(args):
        run.push_weights(run.start_rollout_id)
        run.evaluate_before_training()
        for rollout_id in run.rollout_ids():
            step_start = time.perf_counter()
            data_refs, record = run.wait_generate(run.start_generate(rollout_id), rollout_id)
            waited = time.perf_counter() - step_start  # the trainer idles while the rollout generates
            record.update(run.train(rollout_id, data_refs))
            record["perf/update_weights_time"] = run.push_weights(rollout_id + 1)
            record["perf/step_time"] = time.perf_counter() - step_start
            record["perf/wait_time_ratio"] = waited / record["perf/step_time"]
            run.finish_rollout(rollout_id, record)  # log, save and evaluate when due
    run.close()


if __name__ == "__main__":
    run_main(main)
