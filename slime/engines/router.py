"""Route generation requests over several engines.

`EnginePool` sends each request to the engine with the fewest requests in flight
(ties go to the lowest rank), so n engines share a rollout evenly.
"""

from __future__ import annotations

from slime.engines.client import EngineClient


class EnginePool:
    def __init__(self, urls: list[str], timeout: float):
        if not urls:
            raise ValueError("EnginePool needs at least one engine URL")
        self.urls = list(urls)
        self.clients = [EngineClient(u, timeout=timeout) for u in self.urls]
        self.in_flight = [0] * len(self.clients)

    async def generate(self, payload: dict) -> dict:
        i = min(range(len(self.clients)), key=lambda k: self.in_flight[k])
        self.in_flight[i] += 1
        try:
            return await self.clients[i].generate(payload)
        finally:
            self.in_flight[i] -= 1

    async def post_all(self, path: str, json: dict | None = None) -> list[dict]:
        return [await c.post(path, json) for c in self.clients]

    async def close(self) -> None:
        for c in self.clients:
            await c.close()
