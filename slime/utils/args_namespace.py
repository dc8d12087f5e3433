"""The run's flags as one namespace (`slime.arguments.parse_args` builds it).

Kept apart from the parser and its checks: every Ray actor that receives `args` unpickles this
class, so importing its module must cost nothing (the parser's checks import transformers and
torch)."""

from __future__ import annotations

import argparse


class Args(argparse.Namespace):
    """argparse namespace that refuses writes once validation has frozen it."""

    def __setattr__(self, name, value):
        if self.__dict__.get("_frozen"):
            raise AttributeError(f"args are read-only after validation (tried to set {name!r})")
        super().__setattr__(name, value)

    def freeze(self) -> "Args":
        self.__dict__["_frozen"] = True
        return self
