"""`--sglang-*` / `--vllm-*` pass-through: one rule for turning slime's collected values into a
server's command-line flags (`slime.engines.kinds` says, per engine kind, which parser checks them,
which flags slime manages, and whether a flag the server does not take is an error or is skipped).
"""

from __future__ import annotations

import argparse
import difflib
import logging
from dataclasses import dataclass, field
from typing import Any

from slime.utils.errors import SlimeConfigError

logger = logging.getLogger(__name__)


class RaisingParser(argparse.ArgumentParser):
    """An ArgumentParser that raises SlimeConfigError instead of printing usage and exiting."""

    def error(self, message: str):
        raise SlimeConfigError(message)


def option_table(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """`foo_bar` -> the action of `--foo-bar` (every long option string, aliases included)."""
    table = {}
    for action in parser._actions:
        for s in action.option_strings:
            if s.startswith("--"):
                table[s[2:].replace("-", "_")] = action
    return table


@dataclass
class PassThrough:
    """How one engine kind takes pass-through flags.

    prefix:   the slime flag prefix users write (`--sglang-`, `--vllm-`)
    server:   the server's name in messages ("the installed SGLang's server")
    options:  the server's own options (`option_table` of its parser), or None when slime cannot
              see the server's parser (vLLM lives in its own venv): then every flag is forwarded
    managed:  server dest -> why slime sets it (and what to use instead)
    strict:   a flag the server does not take, or a managed one, is an error naming the flag (True),
              or is skipped with a warning (False: the native engine takes the `--sglang-*` flags it
              shares with SGLang and skips those meant for a real SGLang server)
    one_only: dests that must stay 1 (they would make one engine use more devices than reserved)
    defaults: slime's values for flags the user did not give (the user's value wins)
    """

    prefix: str
    server: str
    options: dict[str, argparse.Action] | None = None
    managed: dict[str, str] = field(default_factory=dict)
    strict: bool = True
    one_only: tuple[str, ...] = ()
    defaults: dict[str, Any] = field(default_factory=dict)

    def flag(self, key: str) -> str:
        return self.prefix + key.replace("_", "-")

    def forward(self, values: dict[str, Any]) -> tuple[list[str], set[str]]:
        """(server argv, the server dests the user set). `True` is a bare flag, `False`/None leave a
        flag out; a value for an option taking a list (nargs '+', '*', N) is split on whitespace."""
        argv: list[str] = []
        dests: set[str] = set()
        skipped: list[str] = []
        for key, value in {**self.defaults, **values}.items():
            action = self.options.get(key) if self.options is not None else None
            dest = action.dest if action is not None else key
            why = None
            if self.options is not None and action is None:
                close = difflib.get_close_matches(key, list(self.options), n=1, cutoff=0.75)
                why = f"{self.flag(key)}: {self.server} has no flag --{key.replace('_', '-')}" + (
                    f" (did you mean {self.flag(close[0])}?)" if close else "")
            elif dest in self.managed:
                why = f"{self.flag(key)} is set by slime ({self.managed[dest]}); remove it"
            if why is not None:
                if self.strict:
                    raise SlimeConfigError(why)
                skipped.append(self.flag(key))
                continue
            if value is False or value is None:
                continue
            if dest in self.one_only and str(value) != "1":
                raise SlimeConfigError(
                    f"{self.flag(key)} {value}: slime gives each engine --rollout-num-gpus-per-engine devices as "
                    f"one tensor-parallel group; run more engines with --rollout-num-gpus instead")
            if action is not None:
                takes_value, value_optional = action.nargs != 0, action.nargs in ("?", "*")
                if takes_value and value is True and not value_optional:
                    raise SlimeConfigError(f"{self.flag(key)} needs a value")
                if not takes_value and value is not True:
                    raise SlimeConfigError(f"{self.flag(key)} is a switch and takes no value (got {value!r})")
            argv.append("--" + key.replace("_", "-"))
            if value is not True:
                many = action is not None and (action.nargs in ("+", "*") or
                                               (isinstance(action.nargs, int) and action.nargs > 1))
                if isinstance(value, list):  # several values given (`--sglang-cuda-graph-bs 1 2 4 8`)
                    if action is not None and not many:
                        raise SlimeConfigError(f"{self.flag(key)} takes one value, got {len(value)}: "
                                               f"{' '.join(map(str, value))}")
                    argv.extend(map(str, value))
                else:
                    argv.extend(str(value).split() if many else [str(value)])
            dests.add(dest)
        if skipped:
            logger.warning("the engine ignores %s", ", ".join(skipped))
        return argv, dests
