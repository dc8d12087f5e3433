"""The rollout side without real engines: a scripted stand-in for `slime.engines.fleet.EngineFleet`
(what `RolloutManager(args, fleet=...)` and `slime.rollout.api` custom code talk to), and an event
loop in a thread like the manager's."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from typing import Callable


class ScriptedFleet:
    """`generate(payload)` answers with the next scripted turn `(text, output ids, finish, matched)`,
    or with `script(payload)` when the script is a function. Log-probs are made up but distinct per
    call; every payload and control call is recorded; `max_new_tokens` is honoured."""

    def __init__(self, script: list | Callable[[dict], tuple], weight_version: str = "4"):
        self.script = script if callable(script) else list(script)
        self.weight_version = weight_version
        self.payloads: list[dict] = []
        self.calls: list[str] = []  # control calls: abort_all, pause, continue_generation
        self.urls = ["http://scripted"]
        self.router_url = "http://scripted"
        self.restart_events: list[dict] = []

    async def generate(self, payload: dict) -> dict:
        self.payloads.append(json.loads(json.dumps(payload)))
        turn = self.script(payload) if callable(self.script) else self.script.pop(0)
        text, out, finish, matched = turn
        n = payload["sampling_params"]["max_new_tokens"]
        if len(out) > n:  # the engine honours max_new_tokens
            out, finish, matched = out[:n], "length", None
        lps = [-0.1 * (k + 1) - 0.01 * len(self.payloads) for k in range(len(out))]
        return {"text": text, "output_ids": list(out), "meta_info": {
            "finish_reason": {"type": finish, "matched": matched}, "prompt_tokens": len(payload["input_ids"]),
            "completion_tokens": len(out), "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, out)],
            "weight_version": self.weight_version}}

    # the rest of the fleet's interface
    def start(self, give_weights) -> list[str]:
        return list(self.urls)

    async def abort_all(self) -> None:
        self.calls.append("abort_all")

    async def pause(self) -> None:
        self.calls.append("pause")

    async def continue_generation(self) -> None:
        self.calls.append("continue_generation")

    async def settle(self) -> None:
        pass

    def take_restart_count(self) -> None:
        return None

    def close(self) -> None:
        pass


@contextlib.contextmanager
def loop_thread():
    """An event loop running in a daemon thread (the rollout manager's shape); stopped on exit."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
