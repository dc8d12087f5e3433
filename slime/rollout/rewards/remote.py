"""A remote reward service (`--rm-url`).

Request: `POST <rm-url>` with JSON `{"prompt", "response", "label", "metadata"}`.
Response: a JSON number, or an object; an object with a numeric `reward` entry gives that
number, any other object is a dict reward (pick its scalar with `--reward-key`).

Failure policy: a timeout (`--rm-timeout` per attempt; the whole call is bounded by all attempts
and waits together), a connection error or an HTTP 5xx is retried up to `--rm-max-retries` times
with exponential backoff (0.5 s, 1 s, 2 s, ...); an
HTTP 4xx is not retried. When every attempt fails the call raises, and the sample is marked
FAILED: counted in `rollout/reward_failures` and kept out of the loss, never scored 0.
"""

from __future__ import annotations

import asyncio

import aiohttp


class RemoteRewardError(RuntimeError):
    pass


class RemoteReward:
    def __init__(self, url: str, timeout: float, max_retries: int):
        self.url = url
        self.timeout = timeout
        self.max_retries = max_retries
        self._session: aiohttp.ClientSession | None = None

    @property
    def total_timeout(self) -> float:
        """Every attempt's timeout and the backoff between them: what the whole call may take."""
        return self.timeout * (self.max_retries + 1) + sum(_backoff(a) for a in range(1, self.max_retries + 1)) + 1.0

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout))
        return self._session

    async def __call__(self, args, sample):
        body = {"prompt": sample.prompt, "response": sample.response, "label": sample.label,
                "metadata": sample.metadata}
        last: Exception | None = None
        for attempt in range(self.max_retries + 1):
            if attempt:
                await asyncio.sleep(_backoff(attempt))
            try:
                async with self._client().post(self.url, json=body) as resp:
                    text = await resp.text()
                    if resp.status >= 500:
                        last = RemoteRewardError(f"{self.url}: HTTP {resp.status}: {text[:200]}")
                        continue
                    if resp.status >= 400:
                        raise RemoteRewardError(f"{self.url}: HTTP {resp.status}: {text[:200]}")
                    return _reward_of(self.url, await resp.json(content_type=None))
            except (asyncio.TimeoutError, aiohttp.ClientError) as e:
                last = RemoteRewardError(f"{self.url}: {type(e).__name__}: {e}")
        raise RemoteRewardError(f"{last} (after {self.max_retries + 1} attempts)")


def _backoff(attempt: int) -> float:
    return 0.5 * 2 ** (attempt - 1)


def _reward_of(url: str, value):
    if isinstance(value, bool) or not isinstance(value, (int, float, dict)):
        raise RemoteRewardError(f"{url}: expected a number or an object, got {value!r}"[:300])
    if isinstance(value, dict) and isinstance(value.get("reward"), (int, float)) and len(value) == 1:
        return value["reward"]
    return value
