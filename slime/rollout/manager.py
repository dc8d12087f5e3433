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
import statistics
import threading
import time

import ray
import torch

from slime.algorithms.advantages import overlong_penalty, post_process_rewards
from slime.data.dataset import load_prompts
from slime.data.source import DataSource
from slime.engines.launcher import EngineServer
from slime.engines.router import EnginePool
from slime.rollout import debug_data, sft
from slime.rollout.generate import generate_and_rm, sample_seed, sampling_params
from slime.rollout.filters import as_filter_output
from slime.rollout.rewards import get_reward_function
from slime.types import RolloutBatch, Sample, SampleStatus


async def _generate_all(args, engines, reward_fn, samples: list[Sample], rollout_id: int, evaluation: bool,
                        progress: list[int] | None = None):
    """Generate and score every sample concurrently; each request gets its own sampling seed
    (`sampling_seed`, SGLang's name; the native engine takes it too).

    (A module function: a coroutine method would make Ray run the manager as an async actor.)
    """
    base = sampling_params(args, evaluation=evaluation)
    if progress is not None:
        progress[1] += len(samples)

    async def one(s: Sample) -> Sample:
        params = dict(base, sampling_seed=sample_seed(args.seed, rollout_id, s.index, evaluation))
        out = await generate_and_rm(engines, s, params, reward_fn, args.reward_key)
        if progress is not None:
            progress[0] += 1
        return out

    return await asyncio.gather(*(one(s) for s in samples))


class RolloutManager:
    def __init__(self, args, placement=None):
        self.args = args
        self.placement = placement
        self.servers: list = []
        self._progress = [0, 0]  # samples (done, launched) of the generate/eval call in flight
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="rollout-loop", daemon=True).start()

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
                args.apply_chat_template, args.rollout_max_prompt_len,
            )

        self.data_source = DataSource(load(args.prompt_data), shuffle=args.rollout_shuffle, seed=args.rollout_seed)
        self.eval_sets = {name: load(path) for name, path in args.eval_sets.items()}
        self.reward_fn = get_reward_function(args.rm_type)
        self.dynamic_filter = self._hook("dynamic_sampling_filter_path")
        self.reward_post_process = self._hook("custom_reward_post_process_path")

        server_cls = ray.remote(num_cpus=0)(EngineServer)
        for rank in range(args.num_engines):
            opts = {}
            if self.placement is not None:
                opts["scheduling_strategy"] = self.placement.strategy(self.placement.engine_bundles[rank])
            self.servers.append(server_cls.options(**opts).remote(args, rank))
        self.urls = ray.get([s.start.remote() for s in self.servers])
        # --debug-train-only replays saved rollouts and starts no engines
        self.engines = EnginePool(self.urls, timeout=args.rollout_request_timeout) if self.urls else None
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
    def _make_samples(self, prompts, n: int, first_group: int = 0) -> list[Sample]:
        return [
            Sample(
                prompt=p.prompt, label=p.label, metadata=dict(p.metadata),
                index=g * n + j, group_index=g, tokens=list(p.input_ids),
            )
            for g, p in enumerate(prompts, start=first_group)
            for j in range(n)
        ]

    def generate(self, rollout_id: int) -> tuple[list[ray.ObjectRef], dict[str, float]]:
        args = self.args
        self._progress = [0, 0]
        if args.loss_type == "sft_loss":
            return self._sft_batch()
        start = time.perf_counter()
        if args.load_debug_rollout_data:  # replay a saved rollout instead of generating
            samples = generated = debug_data.load_samples(args.load_debug_rollout_data, rollout_id)
            metrics = {}
        else:
            samples, generated, metrics = self._sample_groups(rollout_id)
        if args.save_debug_rollout_data:
            debug_data.save_samples(args.save_debug_rollout_data, rollout_id, samples)
        elapsed = time.perf_counter() - start
        batch = self._to_train_batch(samples)
        refs = [ray.put(b) for b in batch.split_for_ranks(args.dp_size, args.global_batch_size)]
        metrics.update(self._rollout_metrics(samples))
        if args.overlong_buffer_len > 0:
            metrics["rollout/overlong_penalty"] = statistics.fmean(self._overlong(samples).tolist())
        if args.mask_truncated_samples:
            metrics["rollout/overlong_filtered"] = float(sum(s.status == SampleStatus.TRUNCATED for s in samples))
        metrics["perf/rollout_time"] = elapsed
        metrics["perf/rollout_tokens_per_s"] = sum(s.response_length for s in generated) / max(elapsed, 1e-9)
        return refs, metrics

    def _sample_groups(self, rollout_id: int) -> tuple[list[Sample], list[Sample], dict[str, float]]:
        """`rollout_batch_size` groups of scored samples: every group when there is no filter, else
        those the dynamic-sampling filter keeps, launching rounds of `over_sampling_batch_size`
        prompts (each round generated concurrently). Returns (kept samples in group order,
        every generated sample, filter metrics)."""
        args, n, target = self.args, self.args.n_samples_per_prompt, self.args.rollout_batch_size
        kept: list[list[Sample]] = []
        dropped: list[list[Sample]] = []
        generated: list[Sample] = []
        drops: dict[str, int] = {}
        rounds = 0
        while len(kept) < target and rounds < args.dynamic_sampling_max_rounds:
            prompts = self.data_source.next_prompts(args.over_sampling_batch_size)
            samples = self._make_samples(prompts, n, first_group=rounds * args.over_sampling_batch_size)
            samples = self._run(_generate_all(args, self.engines, self.reward_fn, samples, rollout_id, False,
                                                    self._progress))
            generated.extend(samples)
            rounds += 1
            for g in range(len(prompts)):
                group = samples[g * n : (g + 1) * n]
                out = as_filter_output(self.dynamic_filter(args, group)) if self.dynamic_filter else None
                if out is None or out.keep:
                    kept.append(group)
                else:
                    dropped.append(group)
                    drops[out.reason or "filtered"] = drops.get(out.reason or "filtered", 0) + 1
        fallback = max(0, target - len(kept))
        kept = sorted(kept[:target] + dropped[:fallback], key=lambda grp: grp[0].group_index)
        metrics: dict[str, float] = {}
        if self.dynamic_filter is not None:
            metrics = {f"rollout/dynamic_filter/drop_{k}": float(v) for k, v in drops.items()}
            metrics["rollout/dynamic_filter/rounds"] = float(rounds)
            metrics["rollout/dynamic_filter/fallback_groups"] = float(fallback)
            metrics["rollout/dynamic_filter/all_raw_reward"] = statistics.fmean(
                s.reward if s.reward is not None else 0.0 for s in generated)
        return [s for grp in kept for s in grp], generated, metrics

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
        refs = [ray.put(b) for b in batch.split_for_ranks(args.dp_size, args.global_batch_size)]
        return refs, {
            "rollout/sequence_len/mean": statistics.fmean(len(s.tokens) for s in samples),
            "rollout/response_len/mean": statistics.fmean(s.response_length for s in samples),
            "rollout/loss_tokens/mean": statistics.fmean(sum(s.loss_mask) for s in samples),
        }

    def _loss_mask(self, s: Sample) -> list[int]:
        """A sample whose reward failed trains on nothing; nor, with --mask-truncated-samples (DAPO
        overlong filtering), does one cut off at the length limit."""
        if s.status == SampleStatus.FAILED or (self.args.mask_truncated_samples and s.status == SampleStatus.TRUNCATED):
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
        """Score every eval set with the current engine weights: `eval/<name>` is the mean reward."""
        self._progress = [0, 0]
        metrics: dict[str, float] = {}
        for name, prompts in self.eval_sets.items():
            start = time.perf_counter()
            samples = self._make_samples(prompts, self.args.n_samples_per_eval_prompt)
            samples = self._run(_generate_all(self.args, self.engines, self.reward_fn, samples, rollout_id, True,
                                                    self._progress))
            metrics[f"eval/{name}"] = statistics.fmean(s.reward if s.reward is not None else 0.0 for s in samples)
            metrics[f"eval/{name}/response_len/mean"] = statistics.fmean(s.response_length for s in samples)
            metrics[f"eval/{name}/reward_failures"] = float(sum(s.reward is None for s in samples))
            metrics[f"perf/eval_time/{name}"] = time.perf_counter() - start
        return metrics

    # ------------------------------------------------------------------- state
    def state_dict(self) -> dict:
        return {"data_source": self.data_source.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.data_source.load_state_dict(state["data_source"])

    def shutdown(self) -> None:
        if getattr(self, "engines", None) is not None:
            self._run(self.engines.close())
        ray.get([s.shutdown.remote() for s in self.servers])
