"""RolloutManager: the Ray actor that turns prompts into training data.

It owns the data source, the engines (one `EngineServer` actor each) and the
reward function. `generate(rollout_id)` takes `rollout_batch_size` prompts,
makes `n_samples_per_prompt` samples of each, generates and scores them
concurrently over HTTP, turns scores into training rewards (per-estimator group
normalization, or `--custom-reward-post-process-path`) and returns one object ref
per data-parallel rank plus the rollout's metrics.

Dynamic sampling (DAPO, `--dynamic-sampling-filter-path`): prompts are launched in
rounds of `--over-sampling-batch-size`; each round's groups are generated
concurrently, then filtered, until `rollout_batch_size` groups are kept.

SFT (`--loss-type sft_loss`): no engines; each rollout is the next `rollout_batch_size`
conversations of the chat data, masked to their assistant turns (`slime.rollout.sft`).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import statistics
import threading
import time

import ray
import torch

from slime.algorithms.advantages import overlong_penalty, post_process_rewards
from slime.data.dataset import load_prompts
from slime.data.source import DataSource, RolloutDataSource, prompt_sample
from slime.engines.fleet import EngineFleet
from slime.engines.health import EngineRestartError
from slime.rollout import api, debug_data, sft
from slime.rollout.group_generation import FullyAsyncGenerator, GroupRunner, generate_groups, generate_until
from slime.rollout.filters import as_filter_output
from slime.rollout.rewards import build_reward
from slime.types import RolloutBatch, Sample, SampleStatus


async def _generate_all(args, engines, reward, groups: list[list[Sample]], rollout_id: int, evaluation: bool,
                        progress: list[int] | None = None, generate_fn=None,
                        version_now=lambda: None) -> list[list[Sample]]:
    """Generate and score every group concurrently (`slime.rollout.group_generation`); each request
    gets its own sampling seed (`sampling_seed`, SGLang's name; the native engine takes it too).

    `generate_fn` is `--custom-generate-function-path` (`async fn(args, sample, sampling_params)`
    returning a Sample or a list of Samples, which keep the group's index) or the default single
    `/generate` call. A per-sample reward scores each sample as soon as it is generated; a group
    reward (`--group-rm`) scores the group once all of it is generated.

    (A module function: a coroutine method would make Ray run the manager as an async actor.)
    """
    runner = GroupRunner(args, engines, reward, generate_fn, progress if progress is not None else [0, 0],
                         version_now)
    return await generate_groups(runner, groups, rollout_id, evaluation)


def number_samples(groups: list[list[Sample]], first_group: int = 0) -> None:
    """Give the groups consecutive group indices (from `first_group`) and their samples unique
    indices (group * n + j), which also fix each sample's sampling seed."""
    for g, group in enumerate(groups, start=first_group):
        for j, s in enumerate(group):
            s.group_index, s.index = g, g * len(group) + j


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with c passing samples out of n (Chen et al., 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


class RolloutManager:
    def __init__(self, args, placement=None):
        self.args = args
        self.placement = placement
        self._progress = [0, 0]  # samples (done, launched) of the generate/eval call in flight
        self.weight_version: int | None = None  # the policy version the engines serve (set by the driver)
        self.stale = {"regenerated_samples": 0, "dropped_groups": 0}  # --max-staleness, over the whole run
        self.fully_async: FullyAsyncGenerator | None = None
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="rollout-loop", daemon=True).start()
        self.fleet = EngineFleet(args, placement, self._loop)
        self._trainer = None  # --use-fault-tolerance: gives a restarted engine the current weights

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def init(self) -> list[str]:
        """Load prompt data, start the engines; returns the engine URLs. Data errors surface here."""
        from transformers import AutoTokenizer

        args = self.args
        tokenizer = AutoTokenizer.from_pretrained(args.hf_checkpoint)
        if args.loss_type == "sft_loss":  # the data is the training batch: no engines, no rewards
            self.data_source = DataSource(
                sft.load_conversations(args.prompt_data, tokenizer, args.input_key, args.metadata_key),
                shuffle=args.rollout_shuffle, seed=args.rollout_seed)
            self.urls = []
            return self.urls

        def load(path):
            return load_prompts(
                path, tokenizer, args.input_key, args.label_key, args.metadata_key,
                args.apply_chat_template, args.rollout_max_prompt_len, args.tool_key,
            )

        # custom code may ask for the tokenizer and config before the engines are up
        api.set_context(api.RolloutContext(args, tokenizer, None, "", args.custom_config))
        if args.data_source_path:
            self.data_source = self._hook("data_source_path")(args)
        elif args.prompt_data is not None:
            self.data_source = RolloutDataSource(args, load(args.prompt_data))
        else:  # --rollout-function-path brings its own data
            self.data_source = None
        self.eval_sets = {name: load(path) for name, path in args.eval_sets.items()}
        self.reward = build_reward(args)
        self.dynamic_filter = self._hook("dynamic_sampling_filter_path")
        self.reward_post_process = self._hook("custom_reward_post_process_path")
        self.rollout_fn = self._hook("rollout_function_path")
        self.generate_fn = self._hook("custom_generate_function_path")
        self.sample_filter = self._hook("rollout_sample_filter_path")
        self.eval_fn = self._hook("eval_function_path")

        # --debug-train-only replays saved rollouts and starts no engines
        self.urls = self.fleet.start(self._give_weights) if args.num_engines else []
        self.engines = self.fleet if self.urls else None
        api.set_context(api.RolloutContext(args, tokenizer, self.engines, self.urls[0] if self.urls else "",
                                           args.custom_config, loop=self._loop))
        return self.urls

    def _hook(self, flag: str):
        from slime.utils.hooks import load_function

        path = getattr(self.args, flag)
        return load_function(path, "--" + flag.replace("_", "-")) if path else None

    def progress(self) -> tuple[int, int]:
        """(samples done, samples launched) of the generate or eval call in flight; the driver polls
        it for a progress bar (the actor runs with max_concurrency=2 so this answers meanwhile)."""
        return self._progress[0], self._progress[1]

    def num_prompts(self) -> int:
        return len(self.data_source)

    # ------------------------------------------------------------------ rollout
    def generate(self, rollout_id: int) -> tuple[list[ray.ObjectRef], dict[str, float]]:
        args = self.args
        self._progress = [0, 0]
        if args.loss_type == "sft_loss":
            return self._sft_batch()
        start = time.perf_counter()
        metrics: dict[str, float] = {}
        self.partial_metrics = {"aborted_groups": 0}
        if args.load_debug_rollout_data:  # replay a saved rollout instead of generating
            samples = generated = debug_data.load_samples(args.load_debug_rollout_data, rollout_id)
        elif self.rollout_fn is not None:
            groups = self._call(self.rollout_fn, args, rollout_id, self.data_source, evaluation=False)
            samples = generated = self._check_groups(groups, "--rollout-function-path")
        else:
            samples, generated, metrics = self._sample_groups(rollout_id)
        samples = self._fit_batch(samples, metrics)
        metrics.update(self._staleness_metrics(samples, rollout_id))
        if args.partial_rollout:
            metrics["rollout/aborted_groups"] = float(self.partial_metrics["aborted_groups"])
        if args.save_debug_rollout_data:
            debug_data.save_samples(args.save_debug_rollout_data, rollout_id, samples)
        elapsed = time.perf_counter() - start
        batch = self._to_train_batch(samples)
        refs = [ray.put(b) for b in batch.split_for_ranks(args.dp_size, args.global_batch_size, balance=args.balance_data)]
        metrics.update(self._rollout_metrics(samples))
        if args.overlong_buffer_len > 0:
            metrics["rollout/overlong_penalty"] = statistics.fmean(self._overlong(samples).tolist())
        if args.mask_truncated_samples:
            metrics["rollout/overlong_filtered"] = float(sum(s.status == SampleStatus.TRUNCATED for s in samples))
        if self.sample_filter is not None:
            metrics["rollout/removed_samples"] = float(sum(s.remove_sample for s in samples))
        metrics["perf/rollout_time"] = elapsed
        metrics["perf/rollout_tokens_per_s"] = sum(s.response_length for s in generated) / max(elapsed, 1e-9)
        restarts = self.fleet.take_restart_count()
        if restarts is not None:
            metrics["rollout/engine_restarts"] = float(restarts)
        return refs, metrics

    def _call(self, fn, *a, **kw):
        """Call a user function that may be sync or async (async ones run on the rollout loop)."""
        out = fn(*a, **kw)
        return self._run(out) if inspect.isawaitable(out) else out

    @staticmethod
    def _check_groups(groups, flag: str) -> list[Sample]:
        if not isinstance(groups, (list, tuple)) or not all(
                isinstance(g, (list, tuple)) and g and all(isinstance(s, Sample) for s in g) for g in groups):
            raise TypeError(f"{flag} must return a list of groups, each a non-empty list of Samples")
        samples = [s for g in groups for s in g]
        if any(s.group_index < 0 for s in samples):
            number_samples([list(g) for g in groups])
        return samples

    def _fit_batch(self, samples: list[Sample], metrics: dict[str, float]) -> list[Sample]:
        """The trainer takes exactly rollout_batch_size * n_samples_per_prompt samples. A custom
        generate function that returns several samples per call makes more: the extra ones at the
        end are dropped (counted in rollout/dropped_samples); fewer is an error."""
        want = self.args.rollout_batch_size * self.args.n_samples_per_prompt
        if len(samples) < want:
            raise ValueError(f"the rollout produced {len(samples)} samples, fewer than rollout_batch_size * "
                             f"n_samples_per_prompt = {want}")
        if len(samples) > want:
            metrics["rollout/dropped_samples"] = float(len(samples) - want)
        return samples[:want]

    def _runner(self) -> GroupRunner:
        return GroupRunner(self.args, self.engines, self.reward, self.generate_fn, self._progress,
                           lambda: self.weight_version)

    def _generate_groups(self, groups: list[list[Sample]], rollout_id: int, evaluation: bool) -> list[list[Sample]]:
        return self._run(_generate_all(self.args, self.engines, self.reward, groups, rollout_id, evaluation,
                                       self._progress, self.generate_fn, lambda: self.weight_version))

    def _keep(self, group: list[Sample], drops: dict[str, int]) -> bool:
        out = as_filter_output(self.dynamic_filter(self.args, group)) if self.dynamic_filter else None
        if out is None or out.keep:
            return True
        drops[out.reason or "filtered"] = drops.get(out.reason or "filtered", 0) + 1
        return False

    def _too_stale(self, s: Sample, rollout_id: int) -> bool:
        return self.args.max_staleness is not None and s.staleness(rollout_id) > self.args.max_staleness

    def _fresh_enough(self, groups: list[list[Sample]], rollout_id: int) -> list[list[Sample]]:
        """Partial samples from the buffer whose oldest tokens are beyond --max-staleness start over."""
        for g in groups:
            for s in g:
                if s.response_length and self._too_stale(s, rollout_id):
                    s.reset_response()
                    self.stale["regenerated_samples"] += 1
        return groups

    def _sample_groups(self, rollout_id: int) -> tuple[list[Sample], list[Sample], dict[str, float]]:
        """`rollout_batch_size` groups of scored samples: every group when there is no filter, else
        those the dynamic-sampling filter keeps. Without --partial-rollout, rounds of
        `over_sampling_batch_size` prompts are generated to completion until enough groups are kept
        (deterministic for a seed); with it, groups are kept as they complete and the rest are
        aborted and go back to the data buffer to continue next rollout; with --fully-async they come
        from the background generation loop. Then `--rollout-sample-filter-path` marks samples to
        keep out of the loss. Returns (kept samples in group order, every generated sample, metrics)."""
        args = self.args
        drops: dict[str, int] = {}
        if args.fully_async:
            kept, generated, rounds, fallback = self._take_fully_async(rollout_id, drops)
        else:
            kept, generated, rounds, fallback = self._launch_rounds(rollout_id, drops)
        kept = sorted(kept, key=lambda grp: grp[0].group_index)
        if self.sample_filter is not None:
            self.sample_filter(args, kept)
        metrics: dict[str, float] = {}
        if self.dynamic_filter is not None:
            metrics = {f"rollout/dynamic_filter/drop_{k}": float(v) for k, v in drops.items()}
            metrics["rollout/dynamic_filter/rounds"] = float(rounds)
            metrics["rollout/dynamic_filter/fallback_groups"] = float(fallback)
            metrics["rollout/dynamic_filter/all_raw_reward"] = statistics.fmean(
                s.reward if s.reward is not None else 0.0 for s in generated)
        return [s for grp in kept for s in grp], generated, metrics

    def _launch_rounds(self, rollout_id: int, drops: dict[str, int]):
        args, target = self.args, self.args.rollout_batch_size
        kept: list[list[Sample]] = []
        dropped: list[list[Sample]] = []
        generated: list[Sample] = []
        rounds = 0
        while len(kept) < target and rounds < args.dynamic_sampling_max_rounds:
            groups = self._fresh_enough(self.data_source.get_samples(args.over_sampling_batch_size), rollout_id)
            number_samples(groups, first_group=rounds * args.over_sampling_batch_size)
            if args.partial_rollout:
                new_kept, new_dropped, rest = self._run(generate_until(
                    self._runner(), groups, rollout_id, target - len(kept), lambda g: self._keep(g, drops)))
                kept += new_kept
                dropped += new_dropped
                self.data_source.add_samples(rest)  # aborted (partial) or late groups continue next rollout
                self.partial_metrics["aborted_groups"] += sum(
                    any(s.status == SampleStatus.ABORTED for s in g) for g in rest)
                groups = new_kept + new_dropped
            else:
                groups = self._generate_groups(groups, rollout_id, False)
                for group in groups:
                    (kept if self._keep(group, drops) else dropped).append(group)
            generated.extend(s for g in groups for s in g)
            rounds += 1
        fallback = max(0, target - len(kept))
        return kept[:target] + dropped[:fallback], generated, rounds, fallback

    def _take_fully_async(self, rollout_id: int, drops: dict[str, int]):
        """`rollout_batch_size` completed groups from the background loop (started on first use);
        groups beyond --max-staleness are dropped and replaced."""
        if self.fully_async is None:
            def next_groups(k):
                return self.data_source.get_samples(k)

            self.fully_async = FullyAsyncGenerator(self._runner(), next_groups, self.args.async_groups_in_flight,
                                                   lambda g: self._keep(g, drops))
            self._loop.call_soon_threadsafe(self.fully_async.start)
        self.fully_async.runner.progress = self._progress
        self.fully_async.keep = lambda g: self._keep(g, drops)
        kept: list[list[Sample]] = []
        while len(kept) < self.args.rollout_batch_size:
            for g in self._run(self.fully_async.take(self.args.rollout_batch_size - len(kept))):
                if any(self._too_stale(s, rollout_id) for s in g):
                    self.stale["dropped_groups"] += 1
                else:
                    kept.append(g)
        return kept, [s for g in kept for s in g], 1, 0

    # ------------------------------------------------------------ weight versions
    def set_weight_version(self, version: int) -> None:
        """The driver pushed policy `version` to the engines."""
        self.weight_version = version

    def pause_generation(self) -> None:
        """--fully-async: hold every request in flight (in place) while the weights change."""
        self._run(self.fleet.pause())

    def continue_generation(self, version: int) -> None:
        self.weight_version = version
        self._run(self.fleet.continue_generation())

    def _staleness_metrics(self, samples: list[Sample], rollout_id: int) -> dict[str, float]:
        """How many policy versions each sample's oldest token lags the policy that trains on it
        (policy version = rollouts trained = rollout_id): mean, max, and the count per value."""
        lags = [s.staleness(rollout_id) for s in samples]
        metrics = {"rollout/staleness/mean": statistics.fmean(lags), "rollout/staleness/max": float(max(lags))}
        for lag in sorted(set(lags)):
            metrics[f"rollout/staleness/count_{lag}"] = float(lags.count(lag))
        metrics["rollout/stale_regenerated_samples_total"] = float(self.stale["regenerated_samples"])
        metrics["rollout/stale_dropped_groups_total"] = float(self.stale["dropped_groups"])
        return metrics

    def _overlong(self, samples: list[Sample]) -> torch.Tensor:
        args = self.args
        return overlong_penalty([s.response_length for s in samples], args.rollout_max_response_len,
                                args.overlong_buffer_len, args.overlong_penalty_factor)

    def _train_rewards(self, samples: list[Sample]) -> list[float]:
        """Training rewards: the user's post-process hook, or (reward + overlong penalty) normalized
        per the estimator over the samples whose reward did not fail (failed ones get 0)."""
        args = self.args
        if self.reward_post_process is not None:
            rewards = [float(r) for r in self.reward_post_process(args, samples)]
            if len(rewards) != len(samples):
                raise ValueError(f"--custom-reward-post-process-path returned {len(rewards)} rewards "
                                 f"for {len(samples)} samples")
            return rewards
        valid = [i for i, s in enumerate(samples) if s.status != SampleStatus.FAILED]
        rewards = [0.0] * len(samples)
        if valid:
            scores = torch.tensor([samples[i].reward for i in valid], dtype=torch.float32)
            if args.overlong_buffer_len > 0:
                scores = scores + self._overlong([samples[i] for i in valid])
            normalized = post_process_rewards(
                scores, [samples[i].group_index for i in valid], args.advantage_estimator,
                args.rewards_normalization, args.grpo_std_normalization,
            )
            for i, r in zip(valid, normalized.tolist()):
                rewards[i] = r
        return rewards

    def _sft_batch(self) -> tuple[list[ray.ObjectRef], dict[str, float]]:
        """The next `rollout_batch_size` conversations as training data (`--loss-type sft_loss`)."""
        args = self.args
        samples = sft.to_samples(self.data_source.next_prompts(args.rollout_batch_size))
        n = len(samples)
        batch = RolloutBatch(
            tokens=[s.tokens for s in samples], response_lengths=[s.response_length for s in samples],
            loss_masks=[s.loss_mask for s in samples], rewards=[0.0] * n, raw_rewards=[0.0] * n,
            rollout_log_probs=[None] * n, group_indices=[s.group_index for s in samples],
        )
        refs = [ray.put(b) for b in batch.split_for_ranks(args.dp_size, args.global_batch_size, balance=args.balance_data)]
        return refs, {
            "rollout/sequence_len/mean": statistics.fmean(len(s.tokens) for s in samples),
            "rollout/response_len/mean": statistics.fmean(s.response_length for s in samples),
            "rollout/loss_tokens/mean": statistics.fmean(sum(s.loss_mask) for s in samples),
        }

    def _loss_mask(self, s: Sample) -> list[int]:
        """A sample whose reward failed trains on nothing; nor does one a --rollout-sample-filter-path
        function removed, nor, with --mask-truncated-samples (DAPO overlong filtering), one cut off
        at the length limit."""
        if s.status == SampleStatus.FAILED or s.remove_sample or (
                self.args.mask_truncated_samples and s.status == SampleStatus.TRUNCATED):
            return [0] * s.response_length
        return s.loss_mask

    def _to_train_batch(self, samples: list[Sample]) -> RolloutBatch:
        rewards = self._train_rewards(samples)
        return RolloutBatch(
            tokens=[s.tokens for s in samples],
            response_lengths=[s.response_length for s in samples],
            loss_masks=[self._loss_mask(s) for s in samples],
            rewards=rewards,
            raw_rewards=[s.reward if s.reward is not None else 0.0 for s in samples],
            rollout_log_probs=[s.rollout_log_probs for s in samples],
            group_indices=[s.group_index for s in samples],
        )

    @staticmethod
    def _rollout_metrics(samples: list[Sample]) -> dict[str, float]:
        scored = [s.reward for s in samples if s.reward is not None]
        lengths = [s.response_length for s in samples]
        groups: dict[int, list[float]] = {}
        for s in samples:
            if s.reward is not None:
                groups.setdefault(s.group_index, []).append(s.reward)
        metrics = {
            "rollout/raw_reward": statistics.fmean(scored) if scored else 0.0,
            "rollout/response_len/mean": statistics.fmean(lengths),
            "rollout/response_len/max": float(max(lengths)),
            "rollout/response_len/min": float(min(lengths)),
            "rollout/truncated_ratio": sum(s.status == SampleStatus.TRUNCATED for s in samples) / len(samples),
            "rollout/zero_std_group_ratio": sum(len(set(g)) == 1 for g in groups.values()) / max(len(groups), 1),
            "rollout/reward_failures": float(len(samples) - len(scored)),
        }
        entries: dict[str, list[float]] = {}  # dict rewards (--reward-key): every numeric entry's mean
        for s in samples:
            for k, v in (s.reward_dict or {}).items():
                if isinstance(v, (int, float)):
                    entries.setdefault(k, []).append(float(v))
        metrics.update({f"rollout/reward/{k}": statistics.fmean(v) for k, v in entries.items()})
        return metrics

    # --------------------------------------------------------------- evaluation
    def eval(self, rollout_id: int) -> dict[str, float]:
        """Score every eval set with the current engine weights (or call --eval-function-path).

        Per set: `eval/<name>` (mean reward), `eval/<name>/pass@k` for k = 1, 2, 4, ... up to
        --n-samples-per-eval-prompt (a sample passes when its reward is > 0), response length,
        truncation ratio and reward failures."""
        self._progress = [0, 0]
        if self.eval_fn is not None:
            metrics = self._call(self.eval_fn, self.args, rollout_id)
            return {(k if k.startswith("eval/") else f"eval/{k}"): float(v) for k, v in metrics.items()}
        metrics: dict[str, float] = {}
        n = self.args.n_samples_per_eval_prompt
        for name, prompts in self.eval_sets.items():
            start = time.perf_counter()
            groups = [[prompt_sample(p) for _ in range(n)] for p in prompts]
            number_samples(groups)
            groups = self._generate_groups(groups, rollout_id, True)
            samples = [s for g in groups for s in g]
            metrics[f"eval/{name}"] = statistics.fmean(s.reward if s.reward is not None else 0.0 for s in samples)
            k = 1
            while k <= n:
                metrics[f"eval/{name}/pass@{k}"] = statistics.fmean(
                    pass_at_k(len(g), sum(s.reward is not None and s.reward > 0 for s in g), k) for g in groups)
                k *= 2
            metrics[f"eval/{name}/response_len/mean"] = statistics.fmean(s.response_length for s in samples)
            metrics[f"eval/{name}/truncated_ratio"] = statistics.fmean(
                s.status == SampleStatus.TRUNCATED for s in samples)
            metrics[f"eval/{name}/reward_failures"] = float(sum(s.reward is None for s in samples))
            metrics[f"perf/eval_time/{name}"] = time.perf_counter() - start
        return metrics

    # ------------------------------------------------------------------- state
    def state_dict(self) -> dict:
        return {"data_source": self.data_source.state_dict() if self.data_source is not None else None,
                "staleness": dict(self.stale)}

    def load_state_dict(self, state: dict) -> None:
        if self.data_source is not None and state.get("data_source") is not None:
            self.data_source.load_state_dict(state["data_source"])
        self.stale.update(state.get("staleness", {}))

    def shutdown(self) -> None:
        if self.fully_async is not None:
            self._run(self.fully_async.stop())
        self.fleet.close()

    # ------------------------------------------------------- router, fault tolerance
    def router_url(self) -> str | None:
        """The URL generation goes to (sglang-router in front of the engines)."""
        return self.fleet.router_url

    def attach_trainer(self, trainer) -> None:
        """--use-fault-tolerance: the train group (slime.ray.actor_group.TrainGroup) that gives a
        restarted engine the current weights before it serves again."""
        self._trainer = trainer

    def _give_weights(self, url: str, version: str) -> None:
        """Called by the health monitor (in a worker thread) for a restarted engine at `url`."""
        if self._trainer is None:
            raise EngineRestartError(
                f"engine {url} was restarted but no trainer is attached to give it the current weights "
                "(the driver calls rollout.attach_trainer.remote(actor) with --use-fault-tolerance)")
        if self.weight_version is not None:
            version = str(self.weight_version)
        self._trainer.update_weights([url], weight_version=int(version) if version.isdigit() else version)
        if self.args.check_weight_update_equal and hasattr(self._trainer, "check_weights"):
            self._trainer.check_weights([url])

    def wait_for_engines(self) -> None:
        """--use-fault-tolerance: check every engine now and return once no restart is in progress
        (a restarted engine has its weights and is back in the router). The driver calls it before
        it pushes weights, so a push never meets an engine in the middle of a restart."""
        self._run(self.fleet.settle())

    def engine_restart_events(self) -> list[dict]:
        """Every restart of this run (rank, url, reason, weight_version, seconds)."""
        return self.fleet.restart_events

    def engine_pids(self) -> list[int | None]:
        """The engine processes' pids (tests kill them)."""
        return self.fleet.pids()

    # ------------------------------------------------------------ colocated memory hand-off
    def offload(self) -> dict[str, float]:
        """--colocate: the engines release their KV cache and weights for training."""
        before = self.fleet.resident_memory_mb()
        seconds = self.fleet.release_memory(["kv_cache", "weights"])
        return {"memory/engine_rss_mb_serving": before, "perf/engine_release_time": seconds,
                "memory/engine_rss_mb_released": self.fleet.resident_memory_mb()}

    def onload_weights(self) -> float:
        """--colocate: the engines take their weights memory back (before a push overwrites it)."""
        return self.fleet.resume_memory(["weights"])

    def onload_kv(self) -> dict[str, float]:
        """--colocate: the engines take their KV cache back for the next generation."""
        seconds = self.fleet.resume_memory(["kv_cache"])
        return {"perf/engine_resume_time": seconds, "memory/engine_rss_mb_resumed": self.fleet.resident_memory_mb()}
