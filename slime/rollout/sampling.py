"""How a rollout's samples are made: one strategy per run, chosen once at start by `make_sampler`.

- `Rounds` (default): rounds of `--over-sampling-batch-size` prompts generated to completion until
  `--rollout-batch-size` groups pass the dynamic-sampling filter (every group when there is none;
  after `--dynamic-sampling-max-rounds` rounds rejected groups fill the rest); deterministic for a seed.
- `PartialRollout` (`--partial-rollout`): groups are kept as they complete; once enough are kept the
  rest are aborted and go back to the data source's buffer to continue next rollout.
- `FullyAsync` (`--fully-async`): a background loop keeps `--async-groups-in-flight` groups
  generating across rollouts; a rollout takes the completed ones.
- `RolloutFunction` (`--rollout-function-path`): the user's function makes the groups.
- `ReplayRollouts` (`--load-debug-rollout-data`): samples saved by an earlier run.
- `ConversationBatches` (`--loss-type sft_loss`): the next conversations of the chat data.

`sampler.sample(rollout_id) -> Rollout(samples, generated, metrics)`; the samples are the
rollout's batch in group order (`--rollout-sample-filter-path` applied), `generated` everything
generated during the call. `Staleness` counts what `--max-staleness` regenerated or dropped over
the whole run (saved with checkpoints).
"""

from __future__ import annotations

import asyncio
import statistics
from dataclasses import dataclass, field

from slime.rollout import debug_data
from slime.rollout.extensions import Extensions, call_user, check_groups
from slime.rollout.filters import as_filter_output
from slime.rollout.group_generation import FullyAsyncGenerator, GroupRunner, generate_groups, generate_until
from slime.types import Sample, SampleStatus


@dataclass
class Rollout:
    samples: list[Sample]
    generated: list[Sample]
    metrics: dict[str, float] = field(default_factory=dict)


class Staleness:
    """`--max-staleness` over the whole run: partial samples that started over, groups dropped."""

    def __init__(self, max_staleness: int | None):
        self.max_staleness = max_staleness
        self.counts = {"regenerated_samples": 0, "dropped_groups": 0}

    def too_stale(self, s: Sample, rollout_id: int) -> bool:
        return self.max_staleness is not None and s.staleness(rollout_id) > self.max_staleness

    def refresh(self, groups: list[list[Sample]], rollout_id: int) -> list[list[Sample]]:
        """Partial samples from the buffer whose oldest tokens are beyond --max-staleness start over."""
        for g in groups:
            for s in g:
                if s.response_length and self.too_stale(s, rollout_id):
                    s.reset_response()
                    self.counts["regenerated_samples"] += 1
        return groups


def number_samples(groups: list[list[Sample]], first_group: int = 0) -> None:
    """Give the groups consecutive group indices (from `first_group`) and their samples unique
    indices (group * n + j), which also fix each sample's sampling seed."""
    for g, group in enumerate(groups, start=first_group):
        for j, s in enumerate(group):
            s.group_index, s.index = g, g * len(group) + j


class Sampler:
    """args; source: the data source; runner: generates and scores groups; loop: the rollout's event
    loop (the engine clients live on it); ext: the user functions; staleness: the run's counters."""

    def __init__(self, args, source, runner: GroupRunner, loop: asyncio.AbstractEventLoop, ext: Extensions,
                 staleness: Staleness):
        self.args, self.source, self.runner, self.loop, self.ext, self.staleness = (
            args, source, runner, loop, ext, staleness)

    def run(self, coro):
        """Run a coroutine on the rollout loop from the manager's thread and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def sample(self, rollout_id: int) -> Rollout:
        raise NotImplementedError

    def stop(self) -> None:
        """Stop background work (the fully-async loop)."""

    def saved_data(self) -> tuple[dict | None, list[list[dict]]]:
        """At one instant: the data source's state, and the groups drawn from it but not handed out
        in a rollout yet (as drawn, as dicts) that a resume must generate again."""
        return (self.source.state_dict() if self.source is not None else None), []


class ReplayRollouts(Sampler):
    def sample(self, rollout_id):
        samples = debug_data.load_samples(self.args.load_debug_rollout_data, rollout_id)
        return Rollout(samples, samples)


class RolloutFunction(Sampler):
    def sample(self, rollout_id):
        groups = check_groups(call_user(self.ext.rollout, self.run, self.args, rollout_id, self.source,
                                        evaluation=False), "--rollout-function-path")
        if any(s.group_index < 0 for g in groups for s in g):
            number_samples(groups)
        samples = [s for g in groups for s in g]
        return Rollout(samples, samples)


class ConversationBatches(Sampler):
    def sample(self, rollout_id):
        groups = self.source.get_samples(self.args.rollout_batch_size)
        number_samples(groups)
        samples = [s for g in groups for s in g]
        return Rollout(samples, samples)


class Rounds(Sampler):
    def sample(self, rollout_id):
        drops: dict[str, int] = {}
        kept, generated, rounds, fallback = self.groups(rollout_id, drops)
        return self.finish(kept, generated, rounds, fallback, drops)

    def keep(self, group: list[Sample], drops: dict[str, int]) -> bool:
        """The dynamic-sampling filter's verdict on a completed group; drops counted per reason."""
        out = as_filter_output(self.ext.dynamic_filter(self.args, group)) if self.ext.dynamic_filter else None
        if out is None or out.keep:
            return True
        drops[out.reason or "filtered"] = drops.get(out.reason or "filtered", 0) + 1
        return False

    def groups(self, rollout_id: int, drops: dict[str, int]):
        """(kept groups, every generated sample, rounds, fallback groups)."""
        args, target = self.args, self.args.rollout_batch_size
        kept: list[list[Sample]] = []
        dropped: list[list[Sample]] = []
        generated: list[Sample] = []
        rounds = 0
        while len(kept) < target and rounds < args.dynamic_sampling_max_rounds:
            groups = self.staleness.refresh(self.source.get_samples(args.over_sampling_batch_size), rollout_id)
            number_samples(groups, first_group=rounds * args.over_sampling_batch_size)
            finished = self.round(groups, rollout_id, target - len(kept), drops, kept, dropped)
            generated.extend(s for g in finished for s in g)
            rounds += 1
        fallback = max(0, target - len(kept))
        return kept[:target] + dropped[:fallback], generated, rounds, fallback

    def round(self, groups, rollout_id, need, drops, kept, dropped) -> list[list[Sample]]:
        """Generate one round's groups to completion, sorting them into kept and dropped; returns
        the groups generated."""
        groups = self.run(generate_groups(self.runner, groups, rollout_id, False))
        for group in groups:
            (kept if self.keep(group, drops) else dropped).append(group)
        return groups

    def finish(self, kept, generated, rounds, fallback, drops) -> Rollout:
        """Groups in group order, `--rollout-sample-filter-path` applied, dynamic-filter metrics."""
        kept = sorted(kept, key=lambda grp: grp[0].group_index)
        if self.ext.sample_filter is not None:
            self.ext.sample_filter(self.args, kept)
        metrics: dict[str, float] = {}
        if self.ext.dynamic_filter is not None:
            metrics = {f"rollout/dynamic_filter/drop_{k}": float(v) for k, v in drops.items()}
            metrics["rollout/dynamic_filter/rounds"] = float(rounds)
            metrics["rollout/dynamic_filter/fallback_groups"] = float(fallback)
            metrics["rollout/dynamic_filter/all_raw_reward"] = statistics.fmean(
                s.reward if s.reward is not None else 0.0 for s in generated)
        return Rollout([s for grp in kept for s in grp], generated, metrics)


class PartialRollout(Rounds):
    def sample(self, rollout_id):
        self.aborted_groups = 0
        rollout = super().sample(rollout_id)
        rollout.metrics["rollout/aborted_groups"] = float(self.aborted_groups)
        return rollout

    def round(self, groups, rollout_id, need, drops, kept, dropped):
        new_kept, new_dropped, rest = self.run(generate_until(
            self.runner, groups, rollout_id, need, lambda g: self.keep(g, drops)))
        kept += new_kept
        dropped += new_dropped
        self.source.add_samples(rest)  # aborted (partial) or late groups continue next rollout
        self.aborted_groups += sum(any(s.status == SampleStatus.ABORTED for s in g) for g in rest)
        return new_kept + new_dropped


class FullyAsync(Rounds):
    """Completed groups from a background loop (started on first use); groups beyond
    --max-staleness are dropped and replaced."""

    generator: FullyAsyncGenerator | None = None

    def groups(self, rollout_id, drops):
        if self.generator is None:
            self.generator = FullyAsyncGenerator(self.runner, self.source.get_samples,
                                                 self.args.async_groups_in_flight, lambda g: self.keep(g, drops))
            self.loop.call_soon_threadsafe(self.generator.start)
        self.generator.keep = lambda g: self.keep(g, drops)
        kept: list[list[Sample]] = []
        while len(kept) < self.args.rollout_batch_size:
            for g in self.run(self.generator.take(self.args.rollout_batch_size - len(kept))):
                if any(self.staleness.too_stale(s, rollout_id) for s in g):
                    self.staleness.counts["dropped_groups"] += 1
                else:
                    kept.append(g)
        return kept, [s for g in kept for s in g], 1, 0

    def stop(self):
        if self.generator is not None:
            self.run(self.generator.stop())
            self.generator = None

    def saved_data(self):
        """On the rollout loop, so the background loop draws nothing in between: the groups in
        flight and those done but not yet taken go back into the checkpoint."""
        async def snapshot():
            return super(FullyAsync, self).saved_data()[0], (self.generator.outstanding() if self.generator else [])

        return self.run(snapshot())


def make_sampler(args, source, runner: GroupRunner, loop: asyncio.AbstractEventLoop, ext: Extensions,
                 staleness: Staleness) -> Sampler:
    """The run's sampling strategy (see the module docstring)."""
    if args.loss_type == "sft_loss":
        cls = ConversationBatches
    elif args.load_debug_rollout_data:
        cls = ReplayRollouts
    elif ext.rollout is not None:
        cls = RolloutFunction
    elif args.fully_async:
        cls = FullyAsync
    elif args.partial_rollout:
        cls = PartialRollout
    else:
        cls = Rounds
    return cls(args, source, runner, loop, ext, staleness)
