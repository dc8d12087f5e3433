"""How fast one train rank turns a rollout into model arithmetic, logged with every train step.

- `perf/train_model_tflops`: the rank's model FLOPs of the call over its seconds, in TFLOP/s. Model
  FLOPs follow the usual convention (as in MFU): 6 x parameters x tokens for the training forward
  and backward, plus 2 x parameters x tokens for each extra forward over the same tokens (the
  reference model, a separate old-log-prob pass); activation recompute is not counted (it is work
  the hardware does, not work the model needs), nor is attention's quadratic term. Tokens are every
  token (prompt and response) of the rank's samples. Divide by the device's dense matmul rate for
  MFU (`benchmarks/train_mfu.py` measures both in one process).
- `memory/train_cuda_peak_mb` (CUDA only): the most device memory torch's allocator held during
  the call (`torch.cuda.max_memory_allocated`, counted from the call's start).
"""

from __future__ import annotations

import time

import torch


class StepMeter:
    """Measures one train call: create it at the call's start, `metrics(...)` at its end."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        self.device = device
        self.start = time.perf_counter()

    def metrics(self, n_params: int, tokens: int, extra_forwards: int) -> dict[str, float]:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        seconds = max(time.perf_counter() - self.start, 1e-9)
        out = {"perf/train_model_tflops": model_flops(n_params, tokens, extra_forwards) / seconds / 1e12}
        if self.cuda:
            out["memory/train_cuda_peak_mb"] = torch.cuda.max_memory_allocated(self.device) / 2**20
        return out


def model_flops(n_params: int, tokens: int, extra_forwards: int = 0) -> int:
    """Forward + backward over `tokens` tokens, plus `extra_forwards` forward-only passes."""
    return (6 + 2 * extra_forwards) * n_params * tokens


def parameter_count(model: torch.nn.Module) -> int:
    """Elements of every parameter (a sharded DTensor counts its whole shape, not the local shard)."""
    return sum(p.numel() for p in model.parameters())
