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


class RolloutDataSource:
    """The built-in rollout data source: prompts from `--prompt-data`, handed out as groups of
    `n_samples_per_prompt` Samples, plus a buffer of groups given back with `add_samples`
    (custom code, or aborted groups of a partial rollout) that is served first.

    A `--data-source-path` class replaces it and implements the same four methods:
    `get_samples(num_groups) -> list[list[Sample]]`, `add_samples(groups)`, `state_dict()`,
    `load_state_dict(state)` (and `__len__` = number of prompts, when it has one, for --num-epoch).
    """

    def __init__(self, args, prompts: list[Prompt] | None = None):
        from transformers import AutoTokenizer

        from slime.data.dataset import load_prompts

        self.args = args
        if prompts is None:
            tokenizer = AutoTokenizer.from_pretrained(args.hf_checkpoint)
            prompts = load_prompts(args.prompt_data, tokenizer, args.input_key, args.label_key, args.metadata_key,
                                   args.apply_chat_template, args.rollout_max_prompt_len, args.tool_key)
        self.prompts = DataSource(prompts, shuffle=args.rollout_shuffle, seed=args.rollout_seed)
        self.buffer: list[list] = []
        self.buffer_filter = None
        if args.buffer_filter_path:
            from slime.utils.hooks import load_function

            self.buffer_filter = load_function(args.buffer_filter_path, "--buffer-filter-path")

    def __len__(self) -> int:
        return len(self.prompts)

    def get_samples(self, num_groups: int) -> list[list]:
        groups = self._pop_buffer(num_groups)
        n = self.args.n_samples_per_prompt
        for p in self.prompts.next_prompts(num_groups - len(groups)):
            groups.append([prompt_sample(p) for _ in range(n)])
        return groups

    def _pop_buffer(self, num_groups: int) -> list[list]:
        if not self.buffer:
            return []
        if self.buffer_filter is None:  # first in, first out
            taken, self.buffer = self.buffer[:num_groups], self.buffer[num_groups:]
            return taken
        taken = list(self.buffer_filter(self.args, self.buffer, num_groups))
        if len(taken) > num_groups:
            raise ValueError(f"--buffer-filter-path returned {len(taken)} groups, more than the {num_groups} asked for")
        ids = {id(g) for g in taken}
        self.buffer = [g for g in self.buffer if id(g) not in ids]
        return taken

    def add_samples(self, groups: list[list]) -> None:
        for g in groups:
            if not isinstance(g, list) or not g:
                raise ValueError("add_samples takes a list of groups, each a non-empty list of Samples")
        self.buffer.extend(groups)

    def state_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return {**self.prompts.state_dict(), "buffer": [[asdict(s) for s in g] for g in self.buffer]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from slime.types import Sample, SampleStatus

        self.prompts.load_state_dict(state)
        self.buffer = [[Sample(**{**s, "status": SampleStatus(s["status"])}) for s in g]
                       for g in state.get("buffer", [])]


def prompt_sample(p: Prompt):
    """A fresh Sample for prompt `p` (index and group index are set by the rollout manager)."""
    from slime.types import Sample

    return Sample(prompt=p.prompt, label=p.label, metadata=dict(p.metadata), tokens=list(p.input_ids))
