"""Where a rollout's samples come from: one data-source interface.

A data source hands out groups of fresh Samples and takes groups back:

    get_samples(num_groups) -> list[list[Sample]]   # groups of n_samples_per_prompt Samples
    add_samples(groups)                             # served again first (partial rollouts, custom code)
    state_dict() -> dict / load_state_dict(state)   # saved with every checkpoint
    __len__()                                       # optional: prompts in one epoch (--num-epoch)

`RolloutDataSource` is the built-in one: rows of `--prompt-data` (prompts, or chat conversations
for `--loss-type sft_loss`) in an order that is a pure function of (seed, epoch, offset)
(`PromptOrder`), plus a buffer of groups given back. A `--data-source-path` class implements the
same methods (`ReasoningGymDataSource` is one). `make_data_source(args, tokenizer)` picks the
run's source once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from typing import Any, Callable, Protocol

from slime.data.dataset import Prompt, load_prompts
from slime.data.sft import conversation_sample, load_conversations
from slime.types import Sample
from slime.utils.errors import DataError
from slime.utils.hooks import load_function


class DataSource(Protocol):
    """What the rollout manager asks of its data (see the module docstring)."""

    def get_samples(self, num_groups: int) -> list[list[Sample]]: ...

    def add_samples(self, groups: list[list[Sample]]) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class PromptOrder:
    """Items handed out batch by batch across epochs, with saved state.

    The order is a pure function of (seed, epoch, offset): with `shuffle`, epoch e uses the
    permutation drawn from `seed + e`, so a resumed order continues exactly where the saved one
    stopped."""

    def __init__(self, items: list, shuffle: bool = False, seed: int = 42):
        if not items:
            raise ValueError("a data source needs at least one prompt")
        self.items = items
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.offset = 0  # position within the current epoch's order
        self._order = self._epoch_order(0)
        self._fingerprint: str | None = None

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.items)))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    def __len__(self) -> int:
        return len(self.items)

    def take(self, n: int) -> list:
        """The next `n` items, crossing into the next epoch (reshuffled) when this one runs out."""
        out = []
        while len(out) < n:
            if self.offset == len(self._order):
                self.epoch += 1
                self.offset = 0
                self._order = self._epoch_order(self.epoch)
            k = min(n - len(out), len(self._order) - self.offset)
            out.extend(self.items[i] for i in self._order[self.offset : self.offset + k])
            self.offset += k
        return out

    def fingerprint(self) -> str:
        """A hash of the items as the data file has them (prompt, label, metadata; for chat data the
        messages), in file order: an edited file of the same size gives another fingerprint."""
        if self._fingerprint is not None:
            return self._fingerprint
        h = hashlib.sha256()
        for item in self.items:
            fields = dataclasses.asdict(item) if dataclasses.is_dataclass(item) else {"item": item}
            content = {k: v for k, v in fields.items() if k not in _NOT_CONTENT}
            h.update(json.dumps(content, sort_keys=True, default=str).encode())
            h.update(b"\n")
        self._fingerprint = h.hexdigest()[:16]
        return self._fingerprint

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed, "shuffle": self.shuffle,
                "num_prompts": len(self.items), "fingerprint": self.fingerprint()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the saved order; refuse (naming what changed) when this run's data or order
        differs from the saved run's, since the saved position would then point at other prompts."""
        changed = []
        if state["num_prompts"] != len(self.items):
            changed.append(f"the prompt data has {len(self.items)} prompts, the checkpoint's had "
                           f"{state['num_prompts']}")
        elif state.get("fingerprint") not in (None, self.fingerprint()):  # checkpoints before the fingerprint: None
            changed.append("the prompt data's content changed (same number of prompts, different prompts or labels)")
        if bool(state.get("shuffle", self.shuffle)) != self.shuffle:
            changed.append(f"--rollout-shuffle was {'on' if state['shuffle'] else 'off'}, "
                           f"now {'on' if self.shuffle else 'off'}")
        elif self.shuffle and state.get("seed", self.seed) != self.seed:
            changed.append(f"--rollout-seed was {state['seed']}, now {self.seed} (it orders the shuffled prompts)")
        if changed:
            raise DataError("cannot resume the data where the checkpoint stopped: " + "; ".join(changed)
                            + " (use the saved run's data and flags, or start a new run with another --save)")
        self.epoch, self.offset = state["epoch"], state["offset"]
        self._order = self._epoch_order(self.epoch)


_NOT_CONTENT = {"input_ids", "tokens", "loss_mask", "where"}  # derived from the content, or where it was read


def prompt_sample(p: Prompt) -> Sample:
    """A fresh Sample for prompt `p` (index and group index are set by the rollout)."""
    return Sample(prompt=p.prompt, label=p.label, metadata=dict(p.metadata), tokens=list(p.input_ids),
                  images=list(p.images) if p.images else None)


class RolloutDataSource:
    """The built-in data source: `items` (Prompts, or SFT Conversations with
    `to_sample=conversation_sample`) handed out as groups of `n_samples_per_prompt` Samples, plus a
    buffer of groups given back with `add_samples`, served first (first in, first out, or as
    `--buffer-filter-path` picks)."""

    def __init__(self, args, prompts: list | None = None, to_sample: Callable[[Any], Sample] = prompt_sample):
        self.args = args
        if prompts is None:
            from transformers import AutoTokenizer  # here: the driver imports this module

            tokenizer = AutoTokenizer.from_pretrained(args.hf_checkpoint)
            prompts = load_prompts(args.prompt_data, tokenizer, args.input_key, args.label_key, args.metadata_key,
                                   args.apply_chat_template, args.rollout_max_prompt_len, args.tool_key,
                                   args.apply_chat_template_kwargs, args.multimodal_keys)
        self.prompts = PromptOrder(prompts, shuffle=args.rollout_shuffle, seed=args.rollout_seed)
        self.to_sample = to_sample
        self.buffer: list[list[Sample]] = []
        self.buffer_filter = (load_function(args.buffer_filter_path, "--buffer-filter-path")
                              if args.buffer_filter_path else None)

    def __len__(self) -> int:
        return len(self.prompts)

    def get_samples(self, num_groups: int) -> list[list[Sample]]:
        groups = self._pop_buffer(num_groups)
        n = self.args.n_samples_per_prompt
        for p in self.prompts.take(num_groups - len(groups)):
            groups.append([self.to_sample(p) for _ in range(n)])
        return groups

    def _pop_buffer(self, num_groups: int) -> list[list[Sample]]:
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

    def add_samples(self, groups: list[list[Sample]]) -> None:
        for g in groups:
            if not isinstance(g, list) or not g:
                raise ValueError("add_samples takes a list of groups, each a non-empty list of Samples")
        self.buffer.extend(groups)

    def state_dict(self) -> dict[str, Any]:
        return {**self.prompts.state_dict(), "buffer": [[s.to_dict() for s in g] for g in self.buffer]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.prompts.load_state_dict(state)
        self.buffer = [[Sample.from_dict(s) for s in g] for g in state.get("buffer", [])]


def make_data_source(args, tokenizer) -> DataSource | None:
    """The run's data source: the chat data of `--loss-type sft_loss`, a `--data-source-path` class,
    the prompts of `--prompt-data`, or None when `--rollout-function-path` brings its own data."""
    if args.loss_type == "sft_loss":
        conversations = load_conversations(args.prompt_data, tokenizer, args.input_key, args.metadata_key)
        return RolloutDataSource(args, conversations, to_sample=conversation_sample)
    if args.data_source_path:
        return load_function(args.data_source_path, "--data-source-path")(args)
    if args.prompt_data is not None:
        return RolloutDataSource(args, load_prompts(
            args.prompt_data, tokenizer, args.input_key, args.label_key, args.metadata_key,
            args.apply_chat_template, args.rollout_max_prompt_len, args.tool_key, args.apply_chat_template_kwargs,
            args.multimodal_keys))
    return None
