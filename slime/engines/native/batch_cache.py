"""Row operations on the running batch's left-padded KV cache (`transformers.DynamicCache`)."""

from __future__ import annotations

import torch


def cache_layers(cache) -> list:
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise RuntimeError("this transformers version's DynamicCache has no .layers; need transformers >= 4.56")
    for layer in layers:
        if type(layer).__name__ != "DynamicLayer":
            raise RuntimeError(f"unsupported KV cache layer type {type(layer).__name__} for batching")
    return layers


def left_pad(x: torch.Tensor, T: int) -> torch.Tensor:
    s = x.shape[-2]
    if s == T:
        return x
    pad = x.new_zeros(x.shape[:-2] + (T - s, x.shape[-1]))
    return torch.cat([pad, x], dim=-2)


def left_pad_mask(m: torch.Tensor, T: int) -> torch.Tensor:
    s = m.shape[1]
    if s == T:
        return m
    return torch.cat([m.new_zeros((m.shape[0], T - s)), m], dim=1)
