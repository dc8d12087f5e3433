"""User-facing errors: one clear line, a non-zero exit, no traceback."""

from __future__ import annotations

import sys
from typing import Callable


class SlimeError(Exception):
    """An error caused by the user's input or environment; its message says what and where."""


class SlimeConfigError(SlimeError):
    """A bad flag or flag combination; the message names the flag."""


class DataError(SlimeError):
    """Bad prompt data; the message names the file and line (or row) and field."""


class RunFailure(SlimeError):
    """The run cannot go on (an actor died, a stage timed out); the message names the stage and the
    actor. Exit status 1 (bad input is 2)."""


def _user_error(exc: BaseException | None) -> SlimeError | None:
    """The SlimeError behind `exc`: itself, or the cause Ray wraps around an actor's exception."""
    seen = 0
    while exc is not None and seen < 10:
        cause = getattr(exc, "cause", None)  # ray.exceptions.RayTaskError keeps the original here
        if isinstance(cause, SlimeError):
            return cause
        if isinstance(exc, SlimeError) and not hasattr(exc, "cause"):
            return exc
        exc = cause if isinstance(cause, BaseException) else exc.__cause__
        seen += 1
    return None


def run_main(main: Callable[[], object]) -> None:
    """Run `main`, turning a SlimeError (also one raised inside a Ray actor) into one line and exit 2."""
    try:
        main()
    except Exception as e:
        err = _user_error(e)
        if err is None:
            raise
        print(f"slime: error: {err}", file=sys.stderr)
        sys.exit(1 if isinstance(err, RunFailure) else 2)
