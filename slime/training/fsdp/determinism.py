"""`--deterministic-mode` on a train rank: deterministic algorithms only, and every generator seeded.

What makes two runs (or a resumed run and an uninterrupted one) give bitwise-identical
gradients, weights and metrics on the trainer's side:

- `torch.use_deterministic_algorithms(True)` (an error, not a warning, for an op that has no
  deterministic implementation): CUDA's `index_add_`, `scatter_add_`, `cumsum`, ... switch to
  their deterministic kernels; cuBLAS gets a fixed workspace (`CUBLAS_WORKSPACE_CONFIG`, read
  when cuBLAS starts, so it is set before the model's first matmul) and cuDNN no autotuning.
  On the CPU every kernel the trainer uses is already deterministic for a fixed thread count
  (slime gives each trainer the same count on every run).
- Python's, NumPy's and torch's generators seeded from `--seed` (the actor's checkpoints carry
  their states, so a resumed run continues the same streams).
- The collectives: gloo's and NCCL's all-reduce / reduce-scatter sum in an order fixed by the
  rank count and the tensor size (ring order), never by arrival time; FSDP2 reduces gradients
  in fp32 (`reduce_dtype`), so the same ranks give the same sums.

The engine side (batch-invariant numerics) is `slime.engines.native.batch_invariant` and the
per-kind server flags in `slime.engines.kinds`. Docs: docs/reproducibility.md.
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch

CUBLAS_WORKSPACE = ":4096:8"  # the setting cuBLAS documents for reproducible results


def configure(args) -> None:
    """Switch this process to deterministic algorithms and seed its generators (a no-op without
    --deterministic-mode). Call before the model's first forward."""
    if not args.deterministic_mode:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True, warn_only=False)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    random.seed(args.seed)
    np.random.seed(args.seed % 2**32)
    torch.manual_seed(args.seed)  # every device's default generator
