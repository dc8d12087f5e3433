"""Generate and score groups of samples on the rollout's event loop.

A group is the n samples of one prompt. Three ways to run groups:
- `generate_groups`: every group to completion (the synchronous rollout, eval);
- `generate_until`: launch groups, keep them as they complete (through a keep filter) and, once
  `target` are kept, abort what is still running on the engines (over-sampling; partial rollout);
- `FullyAsyncGenerator`: a background loop that keeps a fixed number of groups in flight across
  rollout boundaries and queues the completed ones.

A sample that arrives finished (from the partial-rollout buffer) is not generated again; an aborted
sample with a partial response continues from its tokens with the rest of its token budget. With
`--mask-offpolicy-in-partial-rollout` the tokens it had before (written by older weights) get
loss mask 0. An aborted sample is not scored; a group with any aborted sample is unfinished.
With a served OPD teacher (`--opd-type sglang`) every training sample is sent to the teacher right
after its reward (`slime.rollout.teacher`; after the group's reward with `--group-rm`, the samples
of the group concurrently); evaluation samples are not.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Callable

from slime.observability.spans import GAP_TOLERANCE_S, add_span, close_sample, sample_span
from slime.rollout.generate import generate, sample_seed, sampling_params, score, score_group
from slime.rollout.teacher import score_teacher
from slime.types import Sample, SampleStatus

FINISHED = (SampleStatus.COMPLETED, SampleStatus.TRUNCATED, SampleStatus.FAILED)


@dataclass
class GroupRunner:
    """What generating a group needs: the run's args, engines, reward and custom generate function,
    the progress counter (samples done, launched) and the engines' current policy version."""

    args: object
    engines: object
    reward: object
    generate_fn: Callable | None = None
    progress: list[int] = field(default_factory=lambda: [0, 0])
    version_now: Callable[[], int | None] = lambda: None

    async def sample(self, s: Sample, rollout_id: int, evaluation: bool) -> list[Sample]:
        args = self.args
        if s.status in FINISHED:  # finished in an earlier rollout, kept in the buffer
            return [s]
        params = dict(sampling_params(args, evaluation=evaluation),
                      sampling_seed=sample_seed(args.seed, rollout_id, s.index, evaluation))
        if s.response_length:  # a partial response from an aborted request continues
            if args.mask_offpolicy_in_partial_rollout:
                s.loss_mask = [0] * s.response_length
            params["max_new_tokens"] -= s.response_length
            if params["max_new_tokens"] <= 0:
                s.status = SampleStatus.TRUNCATED
                return [await self._score(s, evaluation)]
        if args.rollout_max_context_len is not None:  # prompt + response (so far) + new tokens fit the context
            params["max_new_tokens"] = min(params["max_new_tokens"], args.rollout_max_context_len - len(s.tokens))
            if params["max_new_tokens"] <= 0:
                s.status = SampleStatus.TRUNCATED
                return [await self._score(s, evaluation)]
        launched = self.version_now()
        if launched is not None and (not s.weight_versions or s.weight_versions[-1] != launched):
            s.weight_versions = s.weight_versions + [launched]
        if self.generate_fn is None:
            out = [await generate(self.engines, s, params)]
        else:
            out = await self.generate_fn(args, s, params)
            out = list(out) if isinstance(out, (list, tuple)) else [out]
            if not out or not all(isinstance(x, Sample) for x in out):
                raise TypeError(f"--custom-generate-function-path returned {out!r}; expected a Sample or a "
                                "non-empty list of Samples")
            for x in out:
                x.group_index = s.group_index
        out = [await self._score(x, evaluation) for x in out]
        self.progress[0] += 1
        return out

    async def _score(self, s: Sample, evaluation: bool) -> Sample:
        """Reward one finished sample, then (--opd-type sglang) the teacher's log-probs; an aborted one
        is not scored, and with --group-rm `group` scores the whole group."""
        if s.status == SampleStatus.ABORTED or self.reward.group:
            return s
        return await self._teacher(await score(self.reward, self.args, s), evaluation)

    async def _teacher(self, s: Sample, evaluation: bool) -> Sample:
        if not self.args.opd_served or evaluation:
            return s
        with sample_span(s, "teacher"):
            return await score_teacher(self.args, s)

    async def _timed(self, s: Sample, rollout_id: int, evaluation: bool) -> tuple[float, float, list[Sample]]:
        start = time.time()
        out = await self.sample(s, rollout_id, evaluation)
        return start, time.time(), out

    async def group(self, g: list[Sample], rollout_id: int, evaluation: bool = False) -> list[Sample]:
        """Generate and score one group; every sample's timeline spans then cover its wall time
        (from its launch to its reward, or to the group's reward with --group-rm)."""
        timed = await asyncio.gather(*(self._timed(s, rollout_id, evaluation) for s in g))
        samples = [x for _, _, out in timed for x in out]
        grouped = self.reward.group and not any(s.status == SampleStatus.ABORTED for s in samples)
        if grouped:
            now = time.time()
            for _, done, out in timed:  # done early: waits for the rest of its group
                for x in out:
                    if now - done > GAP_TOLERANCE_S:
                        add_span(x, "wait", done, now, name="group")
            samples = await score_group(self.reward, self.args, samples)
            samples = list(await asyncio.gather(*(self._teacher(s, evaluation) for s in samples)))
        end = time.time()
        for start, done, out in timed:
            for x in out:
                close_sample(x, start, end if grouped else done)
        return samples


def unfinished(group: list[Sample]) -> bool:
    return any(s.status == SampleStatus.ABORTED for s in group)


async def generate_groups(runner: GroupRunner, groups: list[list[Sample]], rollout_id: int,
                          evaluation: bool) -> list[list[Sample]]:
    """Every group to completion, concurrently; results in the groups' order."""
    runner.progress[1] += sum(len(g) for g in groups)
    return list(await asyncio.gather(*(runner.group(g, rollout_id, evaluation) for g in groups)))


async def generate_until(runner: GroupRunner, groups: list[list[Sample]], rollout_id: int, target: int,
                         keep: Callable[[list[Sample]], bool]):
    """Launch every group; keep completed groups that pass `keep` until `target` are kept, then abort
    the requests still running. Returns (kept, dropped, rest): kept and dropped in completion order,
    `rest` the groups that did not make it (aborted ones hold partial responses; groups that
    completed after the target was reached are finished)."""
    runner.progress[1] += sum(len(g) for g in groups)
    pending = {asyncio.ensure_future(runner.group(g, rollout_id)) for g in groups}
    kept: list[list[Sample]] = []
    dropped: list[list[Sample]] = []
    rest: list[list[Sample]] = []
    aborted = False
    try:
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                g = task.result()
                if aborted or len(kept) >= target or unfinished(g):
                    rest.append(g)
                elif keep(g):
                    kept.append(g)
                else:
                    dropped.append(g)
            if len(kept) >= target and pending and not aborted:
                aborted = True
                await runner.engines.abort_all()
    finally:
        for task in pending:
            task.cancel()
    return kept, dropped, rest


class FullyAsyncGenerator:
    """Keeps `in_flight` groups generating or waiting to be trained on, across rollout boundaries:
    a group holds its slot from launch until `take` hands it out (or the keep filter drops it), so
    memory and staleness stay bounded while the trainer is busy. Completed groups that pass `keep`
    wait in a queue; `take(n)` hands out n of them. `next_groups(k)` supplies new groups (from the
    data source)."""

    def __init__(self, runner: GroupRunner, next_groups: Callable[[int], list[list[Sample]]], in_flight: int,
                 keep: Callable[[list[Sample]], bool]):
        self.runner, self.next_groups, self.in_flight, self.keep = runner, next_groups, in_flight, keep
        self.done: asyncio.Queue = asyncio.Queue()
        self.dropped = 0
        self._slots = asyncio.Semaphore(in_flight)
        self._task: asyncio.Task | None = None
        self._launched = 0
        self._outstanding: dict[int, list[dict]] = {}  # group index -> the group as drawn, until handed out

    def outstanding(self) -> list[list[dict]]:
        """The groups drawn from the data source and not handed out yet (generating, or done and
        waiting in the queue), as they were drawn (fresh, as dicts), oldest first: what a
        checkpoint puts back so that a resume generates them again."""
        return list(self._outstanding.values())

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self._loop())

    async def _loop(self) -> None:
        running: set[asyncio.Task] = set()
        try:
            while True:
                await self._slots.acquire()
                (g,) = self.next_groups(1)
                drawn = [s.to_dict() for s in g]
                for j, s in enumerate(g):  # unique indices (and sampling seeds) across rollouts
                    s.group_index, s.index = self._launched, self._launched * len(g) + j
                self._outstanding[self._launched] = drawn
                self._launched += 1
                self.runner.progress[1] += len(g)
                task = asyncio.ensure_future(self.runner.group(g, rollout_id=0))
                running.add(task)
                task.add_done_callback(lambda t: (running.discard(t), self._finished(t)))
        except asyncio.CancelledError:
            for task in running:
                task.cancel()
            raise

    def _finished(self, task: asyncio.Task) -> None:
        if task.cancelled():
            return
        if task.exception() is not None:
            self.done.put_nowait(task.exception())  # surfaces in take()
            return
        g = task.result()
        if not unfinished(g) and self.keep(g):
            self.done.put_nowait(g)
        else:  # filtered out, or aborted at shutdown: its slot goes to a new group
            self.dropped += not unfinished(g)
            self._slots.release()
            if not unfinished(g):  # used (filtered out); an aborted one stays outstanding
                self._outstanding.pop(g[0].group_index, None)

    async def take(self, n: int) -> list[list[Sample]]:
        out = []
        while len(out) < n:
            if self._task is not None and self._task.done():
                self._task.result()  # re-raise what stopped the loop
            try:
                g = await asyncio.wait_for(self.done.get(), timeout=1.0)
            except asyncio.TimeoutError:
                continue
            if isinstance(g, BaseException):
                raise g
            self._slots.release()
            self._outstanding.pop(g[0].group_index, None)
            out.append(g)
        return out

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None
            await self.runner.engines.abort_all()
