"""The parts of parsing slime's command line that argparse does not do: unknown-flag errors with
suggestions of similar meaning, and the `--sglang-*` / `--vllm-*` pass-through values (lists included)."""

from __future__ import annotations

import argparse
import difflib
import json

from slime.utils.errors import SlimeConfigError


def json_object(text: str) -> dict:
    """argparse type of a flag whose value is a JSON object (`--apply-chat-template-kwargs`, `--env-args`)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e.msg} at column {e.colno}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object such as '{{\"enable_thinking\": false}}', "
                                         f"got {text!r}")
    return value


def known_flags(parser: argparse.ArgumentParser) -> list[str]:
    return [s for a in parser._actions for s in a.option_strings if s.startswith("--")]


def _words(flag: str) -> list[str]:
    return [w for w in flag.lstrip("-").split("-") if w]


def similar_flag(name: str, known: list[str]) -> str | None:
    """The known flag `name` is most likely a misspelling of, or None.

    A suggestion must be close as a string and share meaning: every word of the suggestion is close to
    a word of `name` (`--rollout-batchsize` -> `--rollout-batch-size`, `--lr-warmup-iter` ->
    `--lr-warmup-iters`), so `--spec` never suggests `--seed`."""
    words = _words(name)
    joined = "".join(words)
    for cand in difflib.get_close_matches(name, known, n=5, cutoff=0.6):
        cw = _words(cand)
        if "".join(cw) == joined:  # the same words, hyphenated differently
            return cand
        if len(words) == 1 and len(cw) == 1:  # one word each: letters must nearly all agree
            if difflib.SequenceMatcher(None, words[0], cw[0]).ratio() >= 0.85:
                return cand
            continue
        matched = sum(any(difflib.SequenceMatcher(None, w, c).ratio() >= 0.8 for w in words) for c in cw)
        if matched == len(cw) or (matched >= max(2, len(cw) - 1) and abs(len(cw) - len(words)) <= 1):
            return cand
    return None


def check_unknown_flags(argv: list[str], parser: argparse.ArgumentParser, pass_through: tuple[str, ...]) -> None:
    """Every `--flag` must be known or start with a pass-through prefix; an unknown one names a similar flag."""
    known = known_flags(parser)
    known_set = set(known)
    for tok in argv:
        name = tok.split("=", 1)[0]
        if name.startswith("--") and len(name) > 2 and name not in known_set and not name.startswith(pass_through):
            close = similar_flag(name, known)
            raise SlimeConfigError(f"unknown flag {name}" + (f" (did you mean {close}?)" if close else ""))


def _flag_before(tok: str, argv: list[str]) -> str | None:
    """The flag a stray value `tok` follows: where `tok` comes right after another value (argparse took
    that one), else its first place after a flag."""
    places = [i for i, t in enumerate(argv) if t == tok]
    stray = next((i for i in places if i > 0 and not argv[i - 1].startswith("-")), places[0] if places else None)
    if stray is None:
        return None
    return next((a.split("=", 1)[0] for a in reversed(argv[:stray]) if a.startswith("--")), None)


def collect_pass_through(extra: list[str], prefixes: tuple[str, ...],
                         argv: list[str] = ()) -> dict[str, dict[str, object]]:
    """`--sglang-foo-bar V` -> {"--sglang-": {"foo_bar": "V"}} (likewise `--vllm-*`); several values
    (`--sglang-cuda-graph-bs 1 2 4 8`) -> a list; no value -> True. Whether the server's flag takes a
    list is decided where the server's own parser is known (`slime.engines.passthrough`)."""
    out: dict[str, dict[str, object]] = {prefix: {} for prefix in prefixes}
    i = 0
    while i < len(extra):
        tok = extra[i]
        prefix = next((p for p in prefixes if tok.startswith(p)), None)
        if prefix is None:
            before = _flag_before(tok, list(argv))
            raise SlimeConfigError(f"{before}: unexpected extra value {tok!r}" if before else
                                   f"unexpected argument {tok!r} (not after any flag)")
        key, eq, value = tok[len(prefix):].partition("=")
        key = key.replace("-", "_")
        if eq:
            out[prefix][key] = value
            i += 1
            continue
        values = []
        while i + 1 + len(values) < len(extra) and not extra[i + 1 + len(values)].startswith("--"):
            values.append(extra[i + 1 + len(values)])
        out[prefix][key] = True if not values else values[0] if len(values) == 1 else values
        i += 1 + len(values)
    return out
