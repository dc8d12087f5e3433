"""Attention over packed rows, one sample at a time.

The FSDP backend packs a micro-batch's samples into one row (position ids restart per sample).
With Hugging Face's `sdpa` attention a packed row gets one [tokens, tokens] block-diagonal mask
and every layer computes attention over the whole row: a micro-batch of 8 samples does 8x the
attention FLOPs it needs, through the masked kernel (on the quickstart's CPU step, attention was
a fifth of the step). `PACKED_SDPA` is an attention implementation registered with transformers
that runs SDPA causally on each sample's span of the row instead (no mask: the kernel skips the
masked half). The backend passes the samples' token counts with every packed forward
(`segment_kwargs`); a forward without them (one sequence, or padded rows with their 2-D
attention mask) is transformers' `sdpa`, unchanged.

The backend switches a model to it only where the switch is exact: `sdpa` was asked for and a
packed forward gives what separate forwards give (`FSDPBackend._packing_is_exact`).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

PACKED_SDPA = "slime_packed_sdpa"
SEGMENTS = "slime_segment_lengths"  # the keyword argument carrying the samples' token counts


def segment_kwargs(lengths: list[int]) -> dict:
    """The model-forward keyword argument that tells `PACKED_SDPA` where each sample's span ends."""
    return {SEGMENTS: tuple(int(n) for n in lengths)}


def packed_sdpa_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                        **kwargs) -> tuple[torch.Tensor, None]:
    """query [1, heads, T, d], key/value [1, kv_heads, T, d] of one packed row whose samples are
    `kwargs[SEGMENTS]` tokens long -> ([1, T, heads, d], None): each sample attends causally to
    itself only. Anything else goes to transformers' `sdpa` as is (so does a non-causal attention, e.g. a
    vision tower's inside a vision-language model's packed forward: its images attend within themselves)."""
    lengths = kwargs.pop(SEGMENTS, None)
    if lengths is None or query.shape[0] != 1 or len(lengths) < 2 or not getattr(module, "is_causal", True):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    kwargs.pop("is_causal", None)
    outs, start = [], 0
    for n in lengths:
        end = start + n
        out, _ = sdpa_attention_forward(module, query[:, :, start:end], key[:, :, start:end], value[:, :, start:end],
                                        None, dropout=dropout, scaling=scaling, is_causal=True, **kwargs)
        outs.append(out)
        start = end
    if start != query.shape[2]:
        raise ValueError(f"packed attention: segments of {start} tokens for a row of {query.shape[2]}")
    return torch.cat(outs, dim=1), None


AttentionInterface.register(PACKED_SDPA, packed_sdpa_forward)
# the same masks as sdpa: padded rows keep their 2-D attention mask (a packed row's mask goes unused)
AttentionMaskInterface.register(PACKED_SDPA, sdpa_mask)
