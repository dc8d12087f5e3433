"""slime.training.fsdp.packed_attention: per-sample attention over a packed row equals attention
through the row's block-diagonal causal mask (values and gradients), with grouped KV heads; a
forward without segment lengths is transformers' sdpa."""

import types

import torch

from slime.training.fsdp.packed_attention import SEGMENTS, packed_sdpa_forward, segment_kwargs


def _qkv(lengths, heads=6, kv_heads=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q = torch.randn(1, heads, t, d, generator=g, requires_grad=True)
    k = torch.randn(1, kv_heads, t, d, generator=g, requires_grad=True)
    v = torch.randn(1, kv_heads, t, d, generator=g, requires_grad=True)
    module = types.SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True, training=False)
    return module, q, k, v


def _block_causal_mask(lengths):
    t = sum(lengths)
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    return (causal & (seg[:, None] == seg[None, :]))[None, None]


def _masked_reference(q, k, v, lengths, groups, scaling):
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=_block_causal_mask(lengths),
                                                           scale=scaling)
    return out.transpose(1, 2)  # [1, T, heads, d], as transformers' attention functions return it


def test_per_sample_attention_equals_the_block_diagonal_mask():
    lengths = [5, 1, 9, 3]
    module, q, k, v = _qkv(lengths)
    out, weights = packed_sdpa_forward(module, q, k, v, None, scaling=0.25, **segment_kwargs(lengths))
    ref = _masked_reference(q, k, v, lengths, module.num_key_value_groups, 0.25)
    assert weights is None and out.shape == (1, sum(lengths), 6, 16)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_without_segments_it_is_plain_causal_sdpa():
    module, q, k, v = _qkv([7])
    out, _ = packed_sdpa_forward(module, q, k, v, None, scaling=0.25)
    torch.testing.assert_close(out, _masked_reference(q, k, v, [7], module.num_key_value_groups, 0.25),
                               atol=1e-6, rtol=1e-5)


def test_segments_that_do_not_cover_the_row_are_an_error():
    module, q, k, v = _qkv([4, 4])
    try:
        packed_sdpa_forward(module, q, k, v, None, **{SEGMENTS: (4, 3)})
    except ValueError as e:
        assert "segments of 7 tokens for a row of 8" in str(e)
    else:
        raise AssertionError("no error")
