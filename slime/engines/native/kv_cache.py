"""The running batch's KV cache: preallocated, left padded, written in place.

One key and one value buffer per layer, `[row_capacity, kv_heads, column_capacity, head_dim]`,
and a `[row_capacity, column_capacity]` bool mask of real (non-padding) tokens. Rows
`[:rows]` and columns `[:length]` are in use; every row's tokens end at column `length`
(left padding), so one decode step writes one new column for all rows.

The model runs unchanged: `hf_cache()` hands the Hugging Face forward a
`transformers.DynamicCache` whose layers write the new keys/values into these buffers
and return views of them, instead of concatenating a new tensor every step. So a
decode step copies one column of keys/values per layer, not the whole cache.

Growth and compaction, all within the token budget (`limit`, rows x columns allocated):

- a decode step needs one free column: the columns grow `GROW` at a time;
- rows that finish are removed by moving the last rows into their slots (only moved
  rows are copied); all-padding columns on the left are trimmed when they are more
  than a quarter of the length;
- new rows go into free row slots when their prompts fit left of `length`; otherwise
  the buffers are reallocated to exactly the rows needed.
"""

from __future__ import annotations

import psutil
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

GROW = 32  # columns added at a time


class BatchKV:
    def __init__(self, rows: int, columns: int, device: torch.device):
        self.rows = rows  # rows in use
        self.length = 0  # columns in use
        self.row_capacity = rows
        self.column_capacity = columns
        self.device = device
        self.mask = torch.zeros((rows, columns), dtype=torch.bool, device=device)
        self.keys: list[torch.Tensor] = []  # per layer; allocated by the first forward (prefill)
        self.values: list[torch.Tensor] = []

    # ------------------------------------------------------------------ sizes
    @property
    def allocated_tokens(self) -> int:
        """rows x columns held in memory (what the --max-total-tokens budget bounds)."""
        return self.row_capacity * self.column_capacity

    def positions(self) -> torch.Tensor:
        """[rows, 1] position of each row's next token (its count of real tokens)."""
        return self.mask[: self.rows, : self.length].sum(-1, keepdim=True)

    def attention_mask(self, new_columns: int) -> torch.Tensor:
        """[rows, length + new_columns] mask for a forward that appends `new_columns` tokens."""
        return self.mask[: self.rows, : self.length + new_columns]

    # ------------------------------------------------------------------ forward
    def hf_cache(self, num_layers: int):
        """A `transformers.DynamicCache` over these buffers for one forward."""
        cache = DynamicCache()
        cache.layers = [_buffer_layer(self, i) for i in range(num_layers)]
        return cache

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store `k`, `v` [rows, heads, q, dim] at columns [length, length + q); return the layer's
        keys/values for columns [:length + q]."""
        q = k.shape[-2]
        end = self.length + q
        if layer == len(self.keys):  # first forward: allocate this layer's buffers
            shape = (self.row_capacity, k.shape[1], self.column_capacity, k.shape[-1])
            self.keys.append(torch.zeros(shape, dtype=k.dtype, device=k.device))
            self.values.append(torch.zeros(shape, dtype=v.dtype, device=v.device))
        if end > self.column_capacity:
            raise RuntimeError(f"KV cache has {self.column_capacity} columns, a forward needs {end}; reserve first")
        kb, vb = self.keys[layer], self.values[layer]
        kb[: self.rows, :, self.length:end].copy_(k)
        vb[: self.rows, :, self.length:end].copy_(v)
        return kb[: self.rows, :, :end], vb[: self.rows, :, :end]

    def prefill_mask(self, mask: torch.Tensor) -> None:
        """Set the mask of a fresh prefill batch ([rows, L] of real tokens) before its forward."""
        self.mask[: self.rows, : mask.shape[1]] = mask.bool()

    def append_column(self) -> None:
        """Mark the next column real for every row (a decode step's new token), before the forward."""
        self.mask[: self.rows, self.length] = True

    def advance(self, n: int) -> None:
        """After a forward that wrote `n` columns."""
        self.length += n

    # ------------------------------------------------------------------ capacity
    def reserve_column(self, limit: int) -> None:
        """Make room for one more column without exceeding `limit` allocated tokens when possible
        (it is always possible when the scheduler admitted rows within the budget)."""
        if self.length < self.column_capacity:
            return
        want = min(self.length + GROW, limit // self.row_capacity)
        if want >= self.length + 1:
            self._realloc(self.row_capacity, want, 0)
            return
        # compact: exactly the rows in use, no left padding column
        start = self._first_real_column()
        need = self.length - start + 1
        self._realloc(self.rows, max(need, min(need - 1 + GROW, limit // max(1, self.rows))), start)

    def _first_real_column(self) -> int:
        used = self.mask[: self.rows, : self.length].any(0)
        nz = used.nonzero()
        return int(nz[0].item()) if len(nz) else self.length

    def _realloc(self, row_capacity: int, column_capacity: int, start: int, length: int | None = None) -> None:
        """New buffers; the rows in use keep their columns [start:length) and end at column
        `length` of the new buffers (default: they start at the left edge)."""
        n, keep = self.rows, self.length - start
        length = keep if length is None else length
        pad = length - keep
        assert row_capacity >= n and column_capacity >= length and pad >= 0
        mask = torch.zeros((row_capacity, column_capacity), dtype=torch.bool, device=self.device)
        mask[:n, pad:length] = self.mask[:n, start : self.length]
        for bufs in (self.keys, self.values):
            for i, old in enumerate(bufs):
                new = old.new_zeros((row_capacity, old.shape[1], column_capacity, old.shape[3]))
                new[:n, :, pad:length] = old[:n, :, start : self.length]
                bufs[i] = new
        self.mask = mask
        self.row_capacity, self.column_capacity, self.length = row_capacity, column_capacity, length

    # ------------------------------------------------------------------ rows
    def remove_rows(self, keep: list[int]) -> list[int]:
        """Keep the rows `keep` (increasing), drop the others. Rows from the end move into the
        freed slots, so only they are copied. Returns the old row index of each new row."""
        n = len(keep)
        kept = set(keep)
        holes = [i for i in range(n) if i not in kept]
        movers = [i for i in keep if i >= n]
        order = list(range(n))
        if holes:
            dst = torch.tensor(holes, device=self.device)
            src = torch.tensor(movers, device=self.device)
            for bufs in (self.keys, self.values):
                for b in bufs:
                    b[dst] = b[src]
            self.mask[dst] = self.mask[src]
            for h, m in zip(holes, movers):
                order[h] = m
        self.mask[n : self.rows] = False
        self.rows = n
        start = self._first_real_column() if n else self.length
        if n == 0:
            self.length = 0
        elif start > self.length // 4:
            self._realloc(self.row_capacity, self.column_capacity, start)
        return order

    def add_rows(self, new: "BatchKV", index: list[int], limit: int) -> None:
        """Append rows `new[index]` (a prefilled batch; an index may repeat: the n samples of one
        prompt share its prefill) after the rows in use."""
        n, L = len(index), new.length
        if self.rows + n > self.row_capacity or L > self.length:
            start = self._first_real_column()
            length = max(self.length - start, L)
            rows = self.rows + n
            self._realloc(rows, max(length + 1, min(length + GROW, limit // rows)), start, length)
        idx = torch.tensor(index, device=self.device)
        r0, r1 = self.rows, self.rows + n
        c0 = self.length - L
        for mine, theirs in ((self.keys, new.keys), (self.values, new.values)):
            for b, t in zip(mine, theirs):
                b[r0:r1, :, :c0] = 0
                b[r0:r1, :, c0 : self.length] = t.index_select(0, idx)[:, :, :L]
        self.mask[r0:r1] = False
        self.mask[r0:r1, c0 : self.length] = new.mask.index_select(0, idx)[:, :L]
        self.rows = r1

    def take(self, index: list[int]) -> "BatchKV":
        """A new batch of rows `index` of this one (a prefilled batch; an index may repeat)."""
        if index == list(range(self.rows)) and self.rows == self.row_capacity:
            return self
        idx = torch.tensor(index, device=self.device)
        out = BatchKV(len(index), self.column_capacity, self.device)
        out.length = self.length
        out.mask = self.mask.index_select(0, idx)
        out.keys = [b.index_select(0, idx) for b in self.keys]
        out.values = [b.index_select(0, idx) for b in self.values]
        return out


# ---------------------------------------------------------------- the budget
def peak_kv_tokens(rows: list[tuple[int, int]]) -> int:
    """The largest `rows x padded length` a left-padded batch reaches if no row stops early.

    rows: (current length, final length) per row. All rows grow by one token per step and
    leave at their final length; the padded length is the longest running row. The peak is
    reached just before some row leaves, so it is checked at each row's last step.
    """
    if not rows:
        return 0
    order = sorted(rows, key=lambda r: r[1] - r[0], reverse=True)
    best = count = longest = 0
    for cur, final in order:
        count += 1
        longest = max(longest, cur)
        best = max(best, count * (longest + max(final - cur, 0)))
    return best


def kv_bytes_per_token(cfg, dtype: torch.dtype) -> int:
    cfg = cfg.get_text_config(decoder=True)  # a vision-language model's KV is its text model's
    layers = int(getattr(cfg, "num_hidden_layers", 1) or 1)
    heads = int(getattr(cfg, "num_attention_heads", 1) or 1)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = getattr(cfg, "head_dim", None) or int(cfg.hidden_size) // heads
    return 2 * layers * kv_heads * int(head_dim) * torch.empty((), dtype=dtype).element_size()


def default_max_total_tokens(bytes_per_token: int, cap: int, device: torch.device) -> int:
    """SGLang-style default: the KV tokens that fit in 30% of the free memory (at most `cap`)."""
    try:
        if device.type == "cuda":
            free = torch.cuda.mem_get_info(device)[0]
        else:
            free = psutil.virtual_memory().available
    except Exception:  # noqa: BLE001
        free = 4 << 30
    return int(max(2048, min(cap, int(0.3 * free) // max(1, bytes_per_token))))


_layer_class = None


def _buffer_layer(kv: BatchKV, index: int):
    """One layer of `BatchKV.hf_cache()`: a `transformers` DynamicLayer that reads and writes
    the buffers (its own `keys`/`values` tensors stay empty)."""
    global _layer_class
    if _layer_class is None:
        class BufferLayer(DynamicLayer):
            def __init__(self, kv: BatchKV, index: int):
                super().__init__()
                self.kv, self.index = kv, index

            def update(self, key_states, value_states, *args, **kwargs):
                self.is_initialized = True
                return self.kv._write(self.index, key_states, value_states)

            def get_seq_length(self, *args) -> int:
                return self.kv.length

            def get_mask_sizes(self, query_length, *args) -> tuple[int, int]:
                if not isinstance(query_length, int):  # transformers < 5 passes cache_position
                    query_length = query_length.shape[0]
                return self.kv.length + query_length, 0

        _layer_class = BufferLayer
    return _layer_class(kv, index)
