"""The native engine's batch KV cache (`BatchKV`) and token sampler, without the scheduler.

The cache is driven through joins (shorter and longer prompts, repeated rows), leaves
(rows from the middle), column growth and compaction under a tight token budget; after
every step each row's logits must equal a full forward of that row's tokens alone.
"""

from __future__ import annotations

import random

import pytest
import torch

from slime.engines.native.kv_cache import GROW, BatchKV
from slime.engines.native.sampling import sample_next_tokens
from slime.engines.protocol import parse_sampling_params


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()


def _prefill(model, prompts):
    n, L = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros((n, L), dtype=torch.long)
    mask = torch.zeros((n, L), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, L - len(p):] = torch.tensor(p)
        mask[i, L - len(p):] = 1
    kv = BatchKV(n, L, torch.device("cpu"))
    kv.prefill_mask(mask)
    out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                past_key_values=kv.hf_cache(model.config.num_hidden_layers), use_cache=True, logits_to_keep=1)
    kv.advance(L)
    return kv, out.logits[:, -1]


def _decode(model, kv, tokens, limit):
    kv.reserve_column(limit)
    pos = kv.positions()
    kv.append_column()
    out = model(input_ids=torch.tensor(tokens).view(-1, 1), attention_mask=kv.attention_mask(1), position_ids=pos,
                past_key_values=kv.hf_cache(model.config.num_hidden_layers), use_cache=True)
    kv.advance(1)
    return out.logits[:, -1]


def _reference(model, seqs):
    return torch.stack([model(input_ids=torch.tensor([s])).logits[0, -1] for s in seqs])


@pytest.mark.parametrize("limit", [10_000, 260])
def test_joins_leaves_growth_and_compaction_match_full_forwards(model, limit):
    rng = random.Random(0)
    vocab = model.config.vocab_size
    seqs: list[list[int]] = []  # each row's tokens so far (prompt + generated)
    kv = None
    peak = 0
    reallocations = 0  # decode steps after which layer 0's key buffer is a new tensor
    last_buffer = None
    with torch.inference_mode():
        for step in range(70):
            if step in (0, 9, 25, 40):  # joins: a short prompt, a long one (shifts the batch), a repeated one
                lens = {0: [5, 9], 9: [3], 25: [30, 4], 40: [6]}[step]
                prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in lens]
                index = list(range(len(prompts))) + ([0] if step in (0, 25) else [])  # a prompt sampled twice
                new, logits = _prefill(model, prompts)
                if kv is None:
                    kv = new.take(index)
                else:
                    kv.add_rows(new, index, limit)
                torch.testing.assert_close(logits, _reference(model, prompts), atol=2e-5, rtol=0)
                seqs += [list(prompts[i]) for i in index]
            if step in (14, 30, 33, 50):  # leaves: rows from the middle and the ends; at 33 the longest
                drop = set(rng.sample(range(len(seqs)), k=max(1, len(seqs) // 3)))
                if step == 33:  # all but the shortest: what is left is mostly left padding, trimmed
                    drop = {i for i, s in enumerate(seqs) if len(s) > min(map(len, seqs))}
                keep = [i for i in range(len(seqs)) if i not in drop]
                order = kv.remove_rows(keep)
                assert sorted(order) == keep
                seqs = [seqs[i] for i in order]
            tokens = [rng.randrange(3, vocab) for _ in seqs]
            for s, t in zip(seqs, tokens):
                s.append(t)
            logits = _decode(model, kv, tokens, limit)
            assert kv.rows == len(seqs)
            peak = max(peak, kv.allocated_tokens)
            reallocations += kv.keys[0] is not last_buffer
            last_buffer = kv.keys[0]
            torch.testing.assert_close(logits, _reference(model, seqs), atol=2e-5, rtol=0)
    if limit < 10_000:  # the budget binds: compaction kept the allocation within it
        assert peak <= limit
    else:  # columns grew GROW at a time: far fewer reallocations than the 70 decode steps
        assert reallocations <= 70 // GROW + 4 + 4 + 1, reallocations  # growth, joins, trims, the first


def test_growth_past_the_budget_compacts_to_the_rows_in_use(model):
    """Rows leave; when the next column would not fit the budget with the old row slots,
    the cache is reallocated to exactly the rows in use and keeps growing within it."""
    rng = random.Random(1)
    vocab = model.config.vocab_size
    seqs = [[rng.randrange(3, vocab) for _ in range(10)] for _ in range(4)]
    limit = 4 * 12
    with torch.inference_mode():
        kv, _ = _prefill(model, seqs)
        for step in range(14):
            if step == 1:
                order = kv.remove_rows([0, 3])
                seqs = [seqs[i] for i in order]
            tokens = [rng.randrange(3, vocab) for _ in seqs]
            for s, t in zip(seqs, tokens):
                s.append(t)
            logits = _decode(model, kv, tokens, limit)
            assert kv.allocated_tokens <= limit
            torch.testing.assert_close(logits, _reference(model, seqs), atol=2e-5, rtol=0)
    assert kv.row_capacity == 2 and kv.length == 24


def _draw(logits, sp, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = [parse_sampling_params(sp)] * n
    tokens, lps = sample_next_tokens(logits.expand(n, -1).clone(), params, [None] * n, gen)
    return tokens, lps


def test_sampler_follows_the_distribution_and_truncations():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.07, 0.03]]))
    n = 40_000
    tokens, lps = _draw(logits, {"temperature": 1.0}, n)
    freq = torch.bincount(tokens, minlength=5).double() / n
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03], dtype=torch.float64), atol=0.01, rtol=0)
    torch.testing.assert_close(lps, torch.log(torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03]))[tokens])
    tokens, _ = _draw(logits, {"temperature": 1.0, "top_k": 2}, n)
    freq = torch.bincount(tokens, minlength=5).double() / n
    assert freq[2:].sum() == 0 and abs(freq[0] - 2 / 3) < 0.01
    tokens, _ = _draw(logits, {"temperature": 1.0, "top_p": 0.8}, n)  # 0.5 + 0.25 < 0.8: three tokens kept
    freq = torch.bincount(tokens, minlength=5).double() / n
    assert freq[3:].sum() == 0 and abs(freq[2] - 0.15 / 0.9) < 0.01
    tokens, _ = _draw(logits, {"temperature": 0.0}, 4)
    assert tokens.tolist() == [0] * 4


def test_seeded_rows_do_not_depend_on_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(6, 1000)
    params = [parse_sampling_params({"temperature": 0.7, "seed": 11})] + [parse_sampling_params({"temperature": 1.0})] * 5

    def first_row(engine_seed, batch):
        gens = [torch.Generator().manual_seed(11)] + [None] * (batch - 1)
        return sample_next_tokens(logits[:batch].clone(), params[:batch], gens,
                                  torch.Generator().manual_seed(engine_seed))[0][0].item()

    assert len({first_row(s, b) for s in (0, 1, 2) for b in (1, 3, 6)}) == 1


def test_sampler_over_several_blocks_with_zero_weights():
    """A vocabulary of 1300 (three blocks, the last one partial) with the mass on five
    entries in different blocks and everything else impossible."""
    V, n = 1300, 40_000
    logits = torch.full((1, V), float("-inf"))
    support = {3: 0.1, 511: 0.2, 512: 0.3, 1100: 0.15, 1299: 0.25}
    for i, p in support.items():
        logits[0, i] = torch.log(torch.tensor(p))
    tokens, lps = _draw(logits, {"temperature": 1.0}, n, seed=3)
    freq = torch.bincount(tokens, minlength=V).double() / n
    assert set(torch.nonzero(freq).view(-1).tolist()) == set(support)
    for i, p in support.items():
        assert abs(freq[i].item() - p) < 0.01, (i, freq[i].item(), p)
    assert torch.isfinite(lps).all()
