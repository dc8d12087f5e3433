"""Waiting on Ray actors without hanging: every wait is bounded and every failure names
the stage and the actor."""

from __future__ import annotations

import time
from typing import Any, Callable

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from tqdm import tqdm

from slime.utils.errors import RunFailure


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def get(ref, stage: str, actor: str, timeout: float | None,
        progress: Callable[[], Any] | None = None) -> Any:
    """`ray.get` that turns a timeout or a dead actor into a RunFailure naming `stage` and `actor`.

    `progress`, when given, returns an object ref of `(done, total)`; it is polled while waiting
    and shown as a progress bar. A RunFailure raised inside the actor (an engine that stopped
    answering, say) comes back with the stage and actor prefixed; any other exception raised by
    the actor's own code propagates unchanged (with its traceback)."""
    try:
        if progress is not None:
            _wait_with_progress(ref, stage, progress, timeout)
        return ray.get(ref, timeout=timeout)
    except GetTimeoutError:
        raise RunFailure(f"{stage}: {actor} did not finish within {timeout:.0f} s (--stage-timeout)") from None
    except RayActorError as e:
        raise RunFailure(f"{stage}: {actor} died ({first_line(e)})") from None
    except RayTaskError as e:  # e.g. an engine died under the rollout manager: say where
        if isinstance(e.cause, RunFailure):
            raise RunFailure(f"{stage}: {actor}: {e.cause}") from None
        raise


def _wait_with_progress(ref, stage: str, progress: Callable[[], Any], timeout: float | None) -> None:
    deadline = None if timeout is None else time.monotonic() + timeout
    with tqdm(desc=stage, unit="sample", leave=False, dynamic_ncols=True) as bar:
        while True:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise GetTimeoutError()
            ready, _ = ray.wait([ref], timeout=0.5 if remaining is None else min(0.5, remaining))
            if ready:
                return
            try:
                done, total = ray.get(progress(), timeout=10)
            except GetTimeoutError:  # a busy actor answers late; the bar just waits
                continue
            if (bar.n, bar.total) != (done, total):
                bar.total, bar.n = total, done
                bar.refresh()
