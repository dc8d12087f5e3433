"""Batch-invariant numerics for the native engine (`--enable-deterministic-inference`, what slime's
`--deterministic-mode` turns on).

A batched forward is not batch-invariant: the rows of one matrix multiply go through a
different kernel (or a different blocking of the reduction) when the batch has 1, 2 or 32
rows, and a left-padded row attends over more (masked) columns than it has. The results agree
to ~1e-7, not bit for bit, so a sequence's log-probs depend on which requests happen to share
its steps -- on request arrival order and timing.

In deterministic mode every sequence is its own forward, at every step:

- prefill: one forward per distinct prompt, `[1, prompt_len]`, no padding;
- decode: one forward per running row, `[1, 1]` over that row's own KV cache (`RowKVs`: one
  unpadded single-row `BatchKV` per row, grown by its own length only);
- sampling: one row at a time (`sample_next_tokens` on `[1, V]`), every sampled request from
  its own generator (its seed, else one derived from the engine seed and its rid), never the
  engine's shared one.

So every tensor shape, kernel choice and reduction order a sequence meets is a function of that
sequence alone (and of the engine's fixed thread count and device): the same prompt, seed and
weights give bitwise-identical tokens and log-probs alone or next to any other requests. The
price is the batching itself: B forwards per step instead of one (docs/reproducibility.md).
"""

from __future__ import annotations

import torch

from slime.engines.native.kv_cache import BatchKV
from slime.engines.native.sampling import sample_next_tokens


class RowKVs:
    """The running batch's KV cache in deterministic mode: one unpadded single-row `BatchKV` per
    row, in row order. Offers what the scheduler uses of `BatchKV` (`allocated_tokens`, `take`,
    `add_rows`, `remove_rows`)."""

    def __init__(self, kvs: list[BatchKV]):
        self.kvs = kvs

    @property
    def allocated_tokens(self) -> int:
        return sum(kv.allocated_tokens for kv in self.kvs)

    def take(self, index: list[int]) -> RowKVs:
        """Rows `index` (an index may repeat: the n samples of one prompt share its prefill; each
        repeat gets its own copy, as every row's cache is written in place)."""
        seen: set[int] = set()
        out = []
        for i in index:
            out.append(self.kvs[i] if i not in seen else _copy(self.kvs[i]))
            seen.add(i)
        return RowKVs(out)

    def add_rows(self, new: RowKVs, index: list[int], limit: int) -> None:
        self.kvs.extend(new.take(index).kvs)

    def remove_rows(self, keep: list[int]) -> list[int]:
        """Keep the rows `keep` in their order; returns the old index of each new row."""
        self.kvs = [self.kvs[i] for i in keep]
        return list(keep)


def prefill_rows(engine, prompts: list[list[int]], loras: list[str | None]) -> tuple[RowKVs, torch.Tensor]:
    """One `[1, len(prompt)]` forward per prompt. Returns (their caches, last-position logits
    [n, V] float)."""
    kvs, logits = [], []
    for p, lora in zip(prompts, loras):
        ids = torch.tensor([p], dtype=torch.long, device=engine.device)
        mask = torch.ones_like(ids)
        kv = BatchKV(1, len(p), engine.device)
        kv.prefill_mask(mask)
        with engine._lora_rows([lora]):
            out = engine.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=torch.arange(len(p), device=engine.device)[None],
                past_key_values=kv.hf_cache(engine.num_layers),
                use_cache=True,
                logits_to_keep=1,
            )
        kv.advance(len(p))
        kvs.append(kv)
        logits.append(out.logits[:, -1, :].float())
    return RowKVs(kvs), torch.cat(logits, 0)


def decode_rows(engine, kv: RowKVs, last_tokens: torch.Tensor, reqs) -> torch.Tensor:
    """One `[1, 1]` forward per running row over its own cache. Returns logits [B, V] float."""
    logits = []
    for row, tok, r in zip(kv.kvs, last_tokens.view(-1, 1), reqs):
        # a row never needs more columns than its final length: grow within it (its own history
        # alone decides its buffer sizes)
        row.reserve_column(max(engine.final_length(len(r.input_ids), r.params), row.length + 1))
        pos = row.positions()
        row.append_column()
        with engine._lora_rows([r.lora_name]):
            out = engine.model(
                input_ids=tok.view(1, 1),
                attention_mask=row.attention_mask(1),
                position_ids=pos,
                past_key_values=row.hf_cache(engine.num_layers),
                use_cache=True,
            )
        row.advance(1)
        logits.append(out.logits[:, -1, :].float())
    return torch.cat(logits, 0)


def sample_rows(logits: torch.Tensor, reqs, engine_generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_next_tokens` one row at a time (a reduction over one row's vocabulary may be split
    differently when it is the only row). Returns (tokens [B], log-probs [B])."""
    toks, lps = [], []
    for i, r in enumerate(reqs):
        t, lp = sample_next_tokens(logits[i : i + 1], [r.params], [r.generator], engine_generator)
        toks.append(t)
        lps.append(lp)
    return torch.cat(toks), torch.cat(lps)


def _copy(kv: BatchKV) -> BatchKV:
    out = BatchKV(kv.rows, kv.column_capacity, kv.device)
    out.length = kv.length
    out.row_capacity = kv.row_capacity
    out.mask = kv.mask.clone()
    out.keys = [b.clone() for b in kv.keys]
    out.values = [b.clone() for b in kv.values]
    return out
