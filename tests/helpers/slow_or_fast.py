"""A custom generate function and reward that make partial rollouts abort for certain
(`--custom-generate-function-path tests/helpers/slow_or_fast.py:generate
--custom-rm-path tests/helpers/slow_or_fast.py:reward`).

Half the prompts (by a hash of the prompt) are fast and answer in 2 tokens; the other half are slow:
their first request asks for the whole response budget (`ignore_eos`), so they are still generating
when enough fast groups are done and the rollout aborts them. A sample that continues after its
abort (it has a partial response) answers in 2 more tokens, so the groups carried over finish in
the next rollout.

Two things would otherwise let a slow request finish first on a loaded machine:
- the abort only reaches requests the engine already holds; a slow request still on its way would
  arrive after it and run to completion. So a fast request is sent only once every slow request in
  flight is on an engine (running or waiting there);
- a fast group counts as done only once it is scored: the reward here imports nothing and returns
  at once (the share of digits in the response, a signal a random tiny model can climb)."""

from __future__ import annotations

import asyncio
import time
import zlib

from slime.rollout.api import context
from slime.rollout.generate import generate as generate_once

FAST_TOKENS = 2
_slow_in_flight = 0  # slow first requests sent (or about to be) and not answered yet, on this event loop


def is_slow(sample) -> bool:
    return bool(zlib.crc32(str(sample.prompt).encode()) % 2)


HOLD_TIMEOUT_S = 120.0


async def _engines_hold_every_slow_request(engines) -> None:
    deadline = time.monotonic() + HOLD_TIMEOUT_S
    while True:
        infos = await engines.pool.on_each(lambda e: e.server_info())
        held = sum(i["num_running_requests"] + i["num_waiting_requests"] for i in infos)
        if held >= _slow_in_flight:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"slow_or_fast: after {HOLD_TIMEOUT_S:.0f} s the engines hold {held} requests, "
                               f"fewer than the {_slow_in_flight} slow ones sent")
        await asyncio.sleep(0.02)


async def generate(args, sample, sampling_params):
    global _slow_in_flight
    engines = context().engines
    if sample.response_length or not is_slow(sample):  # fast, or continuing after an abort
        await _engines_hold_every_slow_request(engines)
        params = dict(sampling_params, ignore_eos=True,
                      max_new_tokens=max(1, min(sampling_params["max_new_tokens"], FAST_TOKENS)))
        return await generate_once(engines, sample, params)
    _slow_in_flight += 1
    try:
        return await generate_once(engines, sample, dict(sampling_params, ignore_eos=True))
    finally:
        _slow_in_flight -= 1


def reward(args, sample) -> float:
    text = sample.response or ""
    return sum(c.isdigit() for c in text) / max(1, len(text))
