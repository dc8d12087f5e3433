"""Evaluation: every eval set scored with the engines' current weights, or `--eval-function-path`.

Each set (`args.eval_datasets`: from `--eval-prompt-data`, or `--eval-config` with per-set settings,
slime.eval_flags) is read with its own data keys and generated with its own sampling parameters,
samples per prompt, reward and generate function: the set's runner is the run's, with the set's
view of the args (`EvalDataset.args_view`) and, where the set names one, its own reward or generate
function.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from slime.data.dataset import load_prompts
from slime.data.source import prompt_sample
from slime.eval_flags import EvalDataset
from slime.rollout.extensions import call_user
from slime.rollout.group_generation import GroupRunner, generate_groups
from slime.rollout.metrics import eval_metrics
from slime.rollout.rewards import build_reward
from slime.rollout.sampling import number_samples
from slime.utils.hooks import load_function


@dataclass
class EvalSet:
    """An eval set's settings and prompts; `runner(base)` is the run's runner as this set uses it."""

    dataset: EvalDataset
    prompts: list
    _runners: dict = field(default_factory=dict, repr=False)

    def runner(self, base: GroupRunner) -> GroupRunner:
        key = id(base)
        if key not in self._runners:
            d = self.dataset
            view = d.args_view(base.args)
            reward = build_reward(view) if d.own_reward else base.reward
            gen = (load_function(d.custom_generate_function_path, f"--eval-config dataset {d.name}: "
                                 "custom_generate_function_path")
                   if d.custom_generate_function_path is not None else base.generate_fn)
            # the same progress counter and engines as the run's runner
            self._runners[key] = (base, dataclasses.replace(base, args=view, reward=reward, generate_fn=gen))
        return self._runners[key][1]

    def sample(self, p):
        s = prompt_sample(p)
        if self.dataset.metadata_overrides:
            s.metadata = {**s.metadata, **self.dataset.metadata_overrides}
        return s


def load_eval_sets(args, tokenizer) -> dict[str, EvalSet]:
    """Every eval set's prompts, read with the set's own keys (data errors name the file and line)."""
    return {d.name: EvalSet(d, load_prompts(d.path, tokenizer, d.input_key, d.label_key, d.metadata_key,
                                            args.apply_chat_template, args.rollout_max_prompt_len, d.tool_key,
                                            args.apply_chat_template_kwargs, args.multimodal_keys))
            for d in args.eval_datasets}


def evaluate(args, eval_sets: dict[str, EvalSet], runner: GroupRunner, run, evaluate_fn,
             rollout_id: int) -> dict[str, float]:
    """`eval/*` metrics (see `slime.rollout.metrics.eval_metrics`) and each set's `perf/eval_time/<name>`;
    a `--eval-function-path` function replaces all of it (its keys are logged under `eval/`)."""
    if evaluate_fn is not None:
        metrics = call_user(evaluate_fn, run, args, rollout_id)
        return {(k if k.startswith("eval/") else f"eval/{k}"): float(v) for k, v in metrics.items()}
    metrics: dict[str, float] = {}
    for name, es in eval_sets.items():
        start = time.perf_counter()
        n = es.dataset.n_samples_per_eval_prompt
        groups = [[es.sample(p) for _ in range(n)] for p in es.prompts]
        number_samples(groups)
        groups = run(generate_groups(es.runner(runner), groups, rollout_id, True))
        metrics.update(eval_metrics(name, groups, n))
        metrics[f"perf/eval_time/{name}"] = time.perf_counter() - start
    return metrics
