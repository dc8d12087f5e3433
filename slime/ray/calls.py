"""Waiting on Ray actors without hanging: every wait is bounded and every failure names
the stage and the actor."""

from __future__ import annotations

from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from slime.utils.errors import RunFailure


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def get(ref, stage: str, actor: str, timeout: float | None) -> Any:
    """`ray.get` that turns a timeout or a dead actor into a RunFailure naming `stage` and `actor`.

    An exception raised by the actor's own code propagates unchanged (with its traceback)."""
    try:
        return ray.get(ref, timeout=timeout)
    except GetTimeoutError:
        raise RunFailure(f"{stage}: {actor} did not finish within {timeout:.0f} s (--stage-timeout)") from None
    except RayActorError as e:
        raise RunFailure(f"{stage}: {actor} died ({first_line(e)})") from None
