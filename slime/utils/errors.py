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


def run_main(main: Callable[[], object]) -> None:
    """Run `main`, turning a SlimeError (also one raised inside a Ray actor) into one line and exit 2."""
    try:
        main()
    except SlimeError as e:
        print(f"slime: error: {e}", file=sys.stderr)
        sys.exit(2)
    except Exception as e:  # Ray wraps actor exceptions; unwrap ours
        cause = getattr(e, "cause", None)
        if isinstance(cause, SlimeError):
            print(f"slime: error: {cause}", file=sys.stderr)
            sys.exit(2)
        raise
