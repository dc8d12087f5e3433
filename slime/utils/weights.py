"""Bitwise fingerprints of weights, to check that an engine serves exactly the trainer's weights."""

from __future__ import annotations

import hashlib

import torch


def tensor_digest(tensor: torch.Tensor) -> str:
    """sha256 over dtype, shape and the raw bytes of the tensor (on CPU, contiguous)."""
    t = tensor.detach().to("cpu", copy=True).contiguous()  # a copy: .numpy() pins the storage's size
    h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def compare_digests(expected: dict[str, str], actual: dict[str, str]) -> list[str]:
    """Names whose digests differ or that only one side has (empty when equal)."""
    return sorted(n for n in expected.keys() | actual.keys() if expected.get(n) != actual.get(n))
