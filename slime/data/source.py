"""DataSource: hands out prompts batch by batch across epochs, with saved state.

Order is a pure function of (seed, epoch, offset): with `shuffle`, epoch e uses the
permutation drawn from `seed + e`, so a resumed source continues exactly where the
saved one stopped.
"""

from __future__ import annotations

import random
from typing import Any

from slime.data.dataset import Prompt


class DataSource:
    def __init__(self, prompts: list[Prompt], shuffle: bool = False, seed: int = 42):
        if not prompts:
            raise ValueError("DataSource needs at least one prompt")
        self.prompts = prompts
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.offset = 0  # position within the current epoch's order
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    def __len__(self) -> int:
        return len(self.prompts)

    def next_prompts(self, n: int) -> list[Prompt]:
        """The next `n` prompts, crossing into the next epoch (reshuffled) when this one runs out."""
        out = []
        while len(out) < n:
            if self.offset == len(self._order):
                self.epoch += 1
                self.offset = 0
                self._order = self._epoch_order(self.epoch)
            take = min(n - len(out), len(self._order) - self.offset)
            out.extend(self.prompts[i] for i in self._order[self.offset : self.offset + take])
            self.offset += take
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed, "shuffle": self.shuffle,
                "num_prompts": len(self.prompts)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["num_prompts"] != len(self.prompts):
            raise ValueError(
                f"saved data state is for {state['num_prompts']} prompts but the prompt data has {len(self.prompts)}"
            )
        self.epoch, self.offset = state["epoch"], state["offset"]
        self._order = self._epoch_order(self.epoch)
