"""RolloutManager: the Ray actor that turns prompts into training data, a thin front over named parts.

- data: the run's data source (`slime.data.source`, one interface) and eval sets;
- `Extensions`: the user functions, loaded once (`slime.rollout.extensions`);
- the sampler: how a rollout's samples are made, chosen once (`slime.rollout.sampling`: rounds,
  partial rollout, fully async, a rollout function, replayed rollouts, SFT conversations);
- train data and metrics: Samples -> RolloutBatch (`train_data`), rollout and eval metrics (`metrics`,
  `evaluation`);
- the fleet: the engines, the router, health and restarts (`slime.engines.fleet.EngineFleet`); one
  more fleet per frozen model of `--sglang-config` (a teacher, a judge), reached by custom code as
  `api.context().model(name)`. Those keep their memory under --colocate and take no weights.

`generate(rollout_id)` returns one object ref of a RolloutBatch per data-parallel rank and the
rollout's metrics. The driver calls everything else by name: `eval`, `offload` / `onload_weights` /
`onload_kv` (--colocate), `pause_generation` / `continue_generation` (--fully-async weight updates),
`set_weight_version`, `wait_for_engines`, `state_dict` / `load_state_dict`, `shutdown`.
"""

from __future__ import annotations

import asyncio
import threading
import time

import ray

from slime.data.source import make_data_source
from slime.engines.fleet import EngineFleet, LaunchedEngines, launch_engines
from slime.engines.health import EngineRestartError
from slime.engines.served_models import model_args
from slime.observability import spans
from slime.rollout import api, debug_data
from slime.rollout.evaluation import evaluate, load_eval_sets
from slime.rollout.extensions import Extensions
from slime.rollout.group_generation import GroupRunner
from slime.rollout.metrics import rollout_metrics, sft_metrics, staleness_metrics
from slime.rollout.rewards import build_reward
from slime.rollout.sampling import Staleness, make_sampler
from slime.rollout.train_data import fit_batch, sft_batch, to_train_batch
from slime.types import RolloutBatch, Sample


def start_rollout_manager(args, placement):
    """The RolloutManager actor and a ref of its `init` (the engine URLs). Its engines (the policy's and
    each --sglang-config model's) are launched here, beside it, rather than by it once its own process
    is up (with the router now started while the engines come up, a quick-start-shaped run of 3
    rollouts took 23 s instead of 31 s, median of 4 pairs on 2 cores)."""
    launched = {}
    if args.num_engines:  # SFT and --debug-train-only start no engines
        launched = {None: launch_engines(args, placement),
                    **{m.name: launch_engines(model_args(args, m), placement, m.name) for m in args.served_models}}
    # max_concurrency=2: progress polls and control calls answer while a generate call is in flight
    manager = ray.remote(num_cpus=0, max_concurrency=2)(RolloutManager).remote(args, placement, launched=launched)
    return manager, manager.init.remote()


class RolloutManager:
    """args: the run's; placement: where the engines go (slime.ray.placement); fleet: the engines
    (default: an EngineFleet, started by `init`; anything with its methods can stand in); launched:
    the engines `start_rollout_manager` already launched, by model name (None: the policy)."""

    def __init__(self, args, placement=None, fleet=None, launched: dict[str | None, LaunchedEngines] | None = None):
        self.args = args
        self.progress_counts = [0, 0]  # samples (done, launched) of the generate/eval call in flight
        self.weight_version: int | None = None  # the policy version the engines serve (set by the driver)
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="rollout-loop", daemon=True).start()
        launched = launched or {}
        self.fleet = fleet if fleet is not None else EngineFleet(args, placement, self.loop,
                                                                 launched=launched.get(None))
        # --sglang-config: the frozen models' engines, each fleet behind its own router
        self.served = {m.name: EngineFleet(model_args(args, m), placement, self.loop, name=m.name,
                                           launched=launched.get(m.name))
                       for m in args.served_models}
        self.staleness = Staleness(args.max_staleness)
        self.trainer = None  # --use-fault-tolerance: the train group that gives a restarted engine weights
        self.tokenizer = self.data_source = self.eval_sets = self.ext = self.sampler = self.runner = None
        self.urls: list[str] = []
        self._resume_points: dict[int, dict] = {}  # rollout id -> state_dict to resume after it

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def init(self) -> list[str]:
        """Load the data, start the engines; returns the engine URLs. Data errors surface here."""
        args = self.args
        from transformers import AutoTokenizer  # here, in the manager's process: the driver imports this module

        self.tokenizer = AutoTokenizer.from_pretrained(args.hf_checkpoint)
        # custom code may ask for the tokenizer and config before the engines are up
        api.set_context(api.RolloutContext(args, self.tokenizer, None, "", args.custom_config))
        self.data_source = make_data_source(args, self.tokenizer)
        self.eval_sets = load_eval_sets(args, self.tokenizer)  # each with its own keys and settings
        self.ext = Extensions.load(args)
        # SFT and --debug-train-only start no engines
        self.urls = self._start_engines() if args.num_engines else []
        engines = self.fleet if self.urls else None
        self.runner = GroupRunner(args, engines, build_reward(args), self.ext.generate, self.progress_counts,
                                  lambda: self.weight_version)
        self.sampler = make_sampler(args, self.data_source, self.runner, self.loop, self.ext, self.staleness)
        models = {args.policy_model_name: self.fleet, **self.served} if engines is not None else {}
        api.set_context(api.RolloutContext(args, self.tokenizer, engines, self.urls[0] if self.urls else "",
                                           args.custom_config, loop=self.loop, models=models))
        return self.urls

    def _start_engines(self) -> list[str]:
        """Start the policy's fleet and the frozen models' at once; the policy's engine URLs. A frozen
        engine restarted under --use-fault-tolerance starts from its own checkpoint: it is given no weights."""
        if not self.served:  # a stand-in fleet (tests) needs only `start`
            return self.fleet.start(self._give_weights)
        fleets = [self.fleet, *self.served.values()]
        for fleet in fleets:
            fleet.launch()
        urls = self.fleet.connect(self._give_weights)
        for fleet in fleets[1:]:
            fleet.connect(_frozen)
        return urls

    def progress(self) -> tuple[int, int]:
        """(samples done, samples launched) of the generate or eval call in flight; the driver polls
        it for a progress bar (the actor runs with max_concurrency=2 so this answers meanwhile)."""
        return self.progress_counts[0], self.progress_counts[1]

    def num_prompts(self) -> int:
        return len(self.data_source)

    # ------------------------------------------------------------------ rollout
    def generate(self, rollout_id: int) -> tuple[list[ray.ObjectRef], dict[str, float]]:
        args = self.args
        self.progress_counts[:] = [0, 0]
        start, wall_start = time.perf_counter(), time.time()
        rollout = self.sampler.sample(rollout_id)
        self._resume_points = {k: v for k, v in self._resume_points.items() if k >= rollout_id - 2}
        self._resume_points[rollout_id] = self._resume_point()
        if args.loss_type == "sft_loss":
            return self._per_rank(sft_batch(rollout.samples)), sft_metrics(rollout.samples)
        samples = fit_batch(args, rollout.samples, rollout.metrics)
        metrics = {**rollout.metrics, **staleness_metrics(samples, rollout_id, self.staleness.counts)}
        if args.save_debug_rollout_data:
            debug_data.save_samples(args.save_debug_rollout_data, rollout_id, samples)
        # every sample's spans: `python -m slime.timeline <output-dir> --rollout N` (docs/timeline.md)
        spans.write_rollout(args.output_dir, rollout_id, rollout.generated, samples, self.urls, wall_start, time.time())
        elapsed = time.perf_counter() - start
        batch = to_train_batch(args, samples, self.ext.reward_post_process)
        metrics.update(rollout_metrics(args, samples, rollout.generated, elapsed, self.ext.sample_filter is not None))
        restarts = self.fleet.take_restart_count()
        for fleet in self.served.values():  # --use-fault-tolerance: every served model's restarts
            restarts = restarts if restarts is None else restarts + fleet.take_restart_count()
        if restarts is not None:
            metrics["rollout/engine_restarts"] = float(restarts)
        return self._per_rank(batch), metrics

    def _per_rank(self, batch: RolloutBatch) -> list[ray.ObjectRef]:
        args = self.args
        return [ray.put(b) for b in batch.split_for_ranks(args.dp_size, args.global_batch_size,
                                                          balance=args.balance_data)]

    def eval(self, rollout_id: int) -> dict[str, float]:
        """Every eval set scored with the current engine weights (slime.rollout.evaluation)."""
        self.progress_counts[:] = [0, 0]
        return evaluate(self.args, self.eval_sets, self.runner, self._run, self.ext.evaluate, rollout_id)

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

    # ------------------------------------------------------------ fault tolerance
    def attach_trainer(self, trainer) -> None:
        """--use-fault-tolerance: the train group (slime.ray.actor_group.TrainGroup) that gives a
        restarted engine the current weights before it serves again."""
        self.trainer = trainer

    def _give_weights(self, url: str, version: str) -> None:
        """Called by the health monitor (in a worker thread) for a restarted engine at `url`."""
        if self.trainer is None:
            raise EngineRestartError(
                f"engine {url} was restarted but no trainer is attached to give it the current weights "
                "(the driver calls rollout.attach_trainer.remote(actor) with --use-fault-tolerance)")
        if self.weight_version is not None:
            version = str(self.weight_version)
        self.trainer.update_weights([url], weight_version=int(version) if version.isdigit() else version)
        if self.args.check_weight_update_equal:
            self.trainer.check_weights([url])

    def wait_for_engines(self) -> None:
        """--use-fault-tolerance: return once no engine restart is in progress (the driver calls it
        before it pushes weights, so a push never meets an engine in the middle of a restart)."""
        self._run(self.fleet.settle())

    def router_url(self) -> str | None:
        """The URL generation goes to (sglang-router in front of the engines)."""
        return self.fleet.router_url

    def engine_restart_events(self) -> list[dict]:
        """Every restart of this run (rank, url, reason, weight_version, seconds; `model` for an engine
        of a frozen served model)."""
        return self.fleet.restart_events + [{**e, "model": name} for name, f in self.served.items()
                                            for e in f.restart_events]

    def served_model_urls(self) -> dict[str, list[str]]:
        """The engine URLs of each frozen served model (--sglang-config)."""
        return {name: list(f.urls) for name, f in self.served.items()}

    def served_model_pids(self) -> dict[str, list[int | None]]:
        return {name: f.pids() for name, f in self.served.items()}

    def engine_pids(self) -> list[int | None]:
        """The engine processes' pids (tests kill them)."""
        return self.fleet.pids()

    # ------------------------------------------------------------------- state
    def _resume_point(self) -> dict:
        """What a run resumed from here starts with: the data source's state, the groups drawn but
        not trained on yet (put back first), the staleness counters."""
        if self.sampler is not None:
            data, in_flight = self.sampler.saved_data()
        else:
            data, in_flight = (self.data_source.state_dict() if self.data_source is not None else None), []
        return {"data_source": data, "groups_in_flight": in_flight, "staleness": dict(self.staleness.counts)}

    def state_dict(self, rollout_id: int | None = None) -> dict:
        """The state to resume after rollout `rollout_id`: taken when that rollout's data was
        complete, before a later rollout (train_async.py's next generation, --fully-async's
        background loop) drew more prompts; the state now when `rollout_id` is None or unknown."""
        point = self._resume_points.get(rollout_id)
        return point if point is not None else self._resume_point()

    def load_state_dict(self, state: dict) -> None:
        if self.data_source is not None and state.get("data_source") is not None:
            self.data_source.load_state_dict(state["data_source"])
            groups = [[Sample.from_dict(s) for s in g] for g in state.get("groups_in_flight", [])]
            if groups:
                self.data_source.add_samples(groups)
        self.staleness.counts.update(state.get("staleness", {}))

    def shutdown(self) -> None:
        if self.sampler is not None:
            self.sampler.stop()
        for fleet in [self.fleet, *self.served.values()]:
            fleet.close()


def _frozen(url: str, version: str) -> None:
    """A restarted engine of a frozen model already serves its weights (it started from its checkpoint)."""
