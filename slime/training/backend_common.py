"""What every training backend (fsdp, megatron) does the same way at the end of a step."""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist
from torch import Tensor

logger = logging.getLogger(__name__)


class StepTail:
    """Mixed into a backend that has `optimizer`, `device`, `rank`, `world_size` and `args`."""

    def _max_grad_norm(self) -> float:
        return self.args.clip_grad if self.args.clip_grad and self.args.clip_grad > 0 else math.inf

    def _step_if_finite(self, grad_norm: float) -> float:
        """Optimizer step (skipped, with a warning, on a non-finite norm), then zero the grads."""
        if math.isfinite(grad_norm):
            self.optimizer.step()
        else:
            logger.warning("rank %d: non-finite grad norm %s, skipping the optimizer step", self.rank, grad_norm)
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def all_reduce_sum(self, tensor: Tensor) -> Tensor:
        t = tensor.detach().to(self.device, torch.float64 if self.device.type == "cpu" else torch.float32).clone()
        if self.world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.cpu()
