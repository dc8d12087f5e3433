"""What the native engine's server admits, and the threads its slow work runs on (docs/security.md).

Caps (`ServerLimits`, set by the command line's flags; `Admission` resolves them for one engine):

- a body cap per route, checked against Content-Length before a byte is read and while reading
  (413, `slime.engines.serving.body_limits`): the generation routes take `--max-request-bytes`
  (default: derived from the prompt caps, at most 256 MiB), `/update_weights_from_tensor` the
  model's parameters at 8 bytes an element plus headers, every other route 1 MiB plus the
  parameters' names;
- `--max-prompts-per-request` prompts in one request and `--max-prompt-tokens` tokens in a prompt
  (400 naming the field; token-id prompts are measured before their items are checked);
- `--max-queued-requests`: the generations a request adds (n x prompts) plus those running and
  waiting must fit, else 429;
- a request may carry a chat template only when the server runs with `--trust-request-templates`.

Threads: parsing, validation, tokenization and chat templates run on a small pool of their own
(`Admission.prepare`), never on the event loop, so `/health` answers meanwhile; weight-group
rendezvous and receives each run on a daemon thread of their own (`GroupThreads`), at most
`MAX_GROUP_THREADS` at once and each bounded by `--weight-group-timeout`, so peers that never come
cannot hold the threads that the pause, weight and memory routes run on.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web

from slime.engines.control import Route
from slime.engines.protocol import ProtocolError, check_prompt_length
from slime.engines.serving import BodyCap

if TYPE_CHECKING:  # the engine module imports torch; the command line reads ServerLimits without it
    from slime.engines.native.engine import NativeEngine

BYTES_PER_PROMPT_TOKEN = 16  # JSON bytes a prompt token may take: a token id and its comma, or escaped text
REQUEST_OVERHEAD_BYTES = 1 << 20  # sampling parameters, rids, stop strings, ... of a generation request
DERIVED_REQUEST_BYTES_MOST = 256 << 20  # the derived generation body cap never exceeds this
CONTROL_BODY_BYTES = 1 << 20
PREPARE_THREADS = 2
MAX_GROUP_THREADS = 8
GENERATION_ROUTES = (Route.GENERATE, Route.OPENAI_COMPLETIONS, Route.OPENAI_CHAT_COMPLETIONS)


@dataclass(frozen=True)
class ServerLimits:
    """The server's caps (the flags of `python -m slime.engines.native`; None: derived)."""

    max_request_bytes: int | None = None
    max_prompts_per_request: int = 256
    max_prompt_tokens: int | None = None
    max_queued_requests: int = 4096
    trust_request_templates: bool = False
    weight_group_timeout: float = 600.0

    def __post_init__(self):
        for name in ("max_request_bytes", "max_prompts_per_request", "max_prompt_tokens", "max_queued_requests",
                     "weight_group_timeout"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"{name} must be > 0, got {v!r}")


class GroupThreads:
    """Weight-group work (a rendezvous, a receive) each on a daemon thread of its own: a peer that
    never comes holds that thread until the group's timeout, never one another route needs, and a
    server that stops does not wait for it. At most `most` at once (429 beyond); a `key` (the group
    a rendezvous joins) runs once at a time."""

    def __init__(self, most: int = MAX_GROUP_THREADS):
        self.most = most
        self._lock = threading.Lock()
        self._count = 0
        self._keys: set[str] = set()

    def pending(self) -> int:
        with self._lock:
            return self._count

    def run(self, what: str, fn: Callable[[], Any], key: str | None = None) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        with self._lock:
            if key is not None and key in self._keys:
                raise ProtocolError("group_name", f"a rendezvous of group {key!r} is already in progress")
            if self._count >= self.most:
                raise ProtocolError("", f"{what}: {self._count} weight-group operations are already waiting for "
                                        f"their peers (at most {self.most}); retry when one completes or times out",
                                    status=429)
            self._count += 1
            if key is not None:
                self._keys.add(key)
        fut: asyncio.Future = loop.create_future()

        def settle(res, err):
            if fut.done():
                return
            if err is None:
                fut.set_result(res)
            else:
                fut.set_exception(err)

        def target():
            res = err = None
            try:
                res = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the waiting handler
                err = e
            finally:
                with self._lock:
                    self._count -= 1
                    self._keys.discard(key)
            try:
                loop.call_soon_threadsafe(settle, res, err)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass

        threading.Thread(target=target, name=f"native-group{what.replace('/', '-')}", daemon=True).start()
        return fut


class Admission:
    """`ServerLimits` resolved for one engine, the checks that use them, and the server's threads."""

    def __init__(self, engine: NativeEngine, limits: ServerLimits | None = None):
        limits = limits or ServerLimits()
        self.limits = limits
        ctx = engine.max_context_length
        self.max_prompts = limits.max_prompts_per_request
        self.max_prompt_tokens = max(1, min(limits.max_prompt_tokens or ctx - 1, ctx - 1))
        self.max_queued = limits.max_queued_requests
        self.trust_templates = limits.trust_request_templates
        self.group_timeout = float(limits.weight_group_timeout)
        if limits.max_request_bytes is not None:
            gen: BodyCap = (limits.max_request_bytes, "--max-request-bytes")
        else:
            derived = self.max_prompts * self.max_prompt_tokens * BYTES_PER_PROMPT_TOKEN + REQUEST_OVERHEAD_BYTES
            why = (f"--max-request-bytes; by default --max-prompts-per-request x --max-prompt-tokens x "
                   f"{BYTES_PER_PROMPT_TOKEN} bytes + 1 MiB")
            gen = (min(derived, DERIVED_REQUEST_BYTES_MOST), why)
        self.caps: dict[str, BodyCap] = {r.path: gen for r in GENERATION_ROUTES}
        self.caps[Route.UPDATE_WEIGHTS_FROM_TENSOR.path] = (
            engine.weight_body_bytes(), "the model's parameters at 8 bytes an element, plus headers")
        self.default_cap: BodyCap = (CONTROL_BODY_BYTES + engine.parameter_names_bytes(), "the cap of control routes")
        self.prepare_pool = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="native-prepare")
        self.groups = GroupThreads()

    @property
    def largest_body(self) -> int:
        return max(max(c for c, _ in self.caps.values()), self.default_cap[0])

    async def prepare(self, fn: Callable, *args):
        """Run `fn(*args)` (parsing, validation, tokenization, templates) off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.prepare_pool, fn, *args)

    def check_prompt_tokens(self, num_tokens: int, name: str) -> None:
        check_prompt_length(num_tokens, self.max_prompt_tokens, name)

    def check_queue(self, engine: NativeEngine, count: int, field: str) -> None:
        """429 unless `count` more generations fit the engine's queue (--max-queued-requests)."""
        cap = self.max_queued
        if count > cap:
            raise ProtocolError(field, f"asks for {count} generations (n x prompts), more than the engine's queue "
                                       f"holds (--max-queued-requests {cap}); split the request", status=429)
        st = engine.stats()
        queued = st["num_running_requests"] + st["num_waiting_requests"]
        if queued + count > cap:
            raise ProtocolError(field, f"{count} more generations (n x prompts) do not fit the engine's queue: "
                                       f"{queued} of {cap} are taken (--max-queued-requests); retry later", status=429)

    def check_template(self, field: str) -> None:
        """A request field that carries a chat template is refused unless the server trusts them."""
        if not self.trust_templates:
            raise ProtocolError(field, "a request may not carry a chat template (the server renders the model's "
                                       "own); start the server with --trust-request-templates to allow it")

    def close(self) -> None:
        self.prepare_pool.shutdown(wait=False, cancel_futures=True)


ADMISSION_KEY = web.AppKey("admission", Admission)
