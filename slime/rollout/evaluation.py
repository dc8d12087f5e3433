"""Evaluation: every eval set scored with the engines' current weights, or `--eval-function-path`."""

from __future__ import annotations

import time

from slime.data.source import prompt_sample
from slime.rollout.extensions import call_user
from slime.rollout.group_generation import GroupRunner, generate_groups
from slime.rollout.metrics import eval_metrics
from slime.rollout.sampling import number_samples


def evaluate(args, eval_sets: dict, runner: GroupRunner, run, evaluate_fn, rollout_id: int) -> dict[str, float]:
    """`eval/*` metrics (see `slime.rollout.metrics.eval_metrics`) and each set's `perf/eval_time/<name>`;
    a `--eval-function-path` function replaces all of it (its keys are logged under `eval/`)."""
    if evaluate_fn is not None:
        metrics = call_user(evaluate_fn, run, args, rollout_id)
        return {(k if k.startswith("eval/") else f"eval/{k}"): float(v) for k, v in metrics.items()}
    metrics: dict[str, float] = {}
    n = args.n_samples_per_eval_prompt
    for name, prompts in eval_sets.items():
        start = time.perf_counter()
        groups = [[prompt_sample(p) for _ in range(n)] for p in prompts]
        number_samples(groups)
        groups = run(generate_groups(runner, groups, rollout_id, True))
        metrics.update(eval_metrics(name, groups, n))
        metrics[f"perf/eval_time/{name}"] = time.perf_counter() - start
    return metrics
