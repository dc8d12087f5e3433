"""`--bf16` on the megatron backend: bf16 parameters for every forward and backward, fp32 main
copies for everything else (megatron's own mixed precision: bf16 params, fp32 main params and
gradients; here without its DistributedOptimizer, which needs CUDA buffers: shims.py).

Each parameter of the trained model holds two tensors:
- its bf16 values, in `p.data` while the model computes (forward, backward, the push to the
  engines, which serve the same bf16 values the trainer computes with);
- its fp32 main copy, filled from the checkpoint's fp32 values before the cast (so nothing is
  rounded twice) and updated by the optimizer.

Gradients reach the parameters in bf16 (one micro-batch's backward) and are added at once into an
fp32 main gradient (a post-accumulate-grad hook), so they accumulate over micro-batches and are
reduced over the data-parallel group in fp32.

`main()` puts the fp32 main copies (and gradients) into the parameters themselves (`p.data` and
`p.grad` swapped): inside it the gradient reduction, clipping, the optimizer step, checkpoints
(save and load) and HF exports run exactly as in an fp32 run, on the same parameter objects, so
the optimizer's state is fp32 and keyed as in an fp32 run, and a checkpoint saved with `--bf16`
holds fp32 weights that any run (fp32 or bf16, any layout) loads. On leaving, the bf16 values are
refreshed from the main copies (round to nearest) and the main gradients are dropped: `main()`
follows the optimizer step (which zeroes the gradients) or needs none.

Memory per parameter: 2 bytes (bf16) + 4 (fp32 main) + 4 (fp32 gradient, during a step) + 8
(AdamW), megatron's figure; an fp32 run holds 4 + 4 + 8.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

import torch
from torch import Tensor


class MainParams:
    """fp32 main copies of `modules`' parameters, whose own values become `dtype` (see the module
    docstring). Build it after the checkpoint's weights are in (fp32)."""

    def __init__(self, modules: Iterable[torch.nn.Module], dtype: torch.dtype = torch.bfloat16):
        seen: set[int] = set()
        self.params: list[Tensor] = []
        for module in modules:
            for p in module.parameters():
                if id(p) not in seen:  # a tied weight once
                    seen.add(id(p))
                    self.params.append(p)
        self._main: list[Tensor] = []
        self._low: list[Tensor] = []
        self._grads: dict[int, Tensor] = {}  # id(p) -> fp32 main gradient
        self._inside = False
        for p in self.params:
            self._main.append(p.data.to(torch.float32, copy=True))
            p.data = p.data.to(dtype)
            self._low.append(p.data)
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._accumulate)

    def _accumulate(self, p: Tensor) -> None:
        """After a backward: the parameter's bf16 gradient into its fp32 main gradient."""
        if self._inside or p.grad is None:  # inside main(): the gradient already is the main one
            return
        g = self._grads.get(id(p))
        if g is None:
            self._grads[id(p)] = p.grad.float()
        else:
            g.add_(p.grad)
        p.grad = None

    def tensors(self) -> list[Tensor]:
        """The fp32 main copies and the main gradients accumulated so far (what colocated training
        offloads besides the parameters themselves, slime.training.offload)."""
        return self._main + list(self._grads.values())

    @contextlib.contextmanager
    def main(self) -> Iterator[None]:
        """The parameters hold their fp32 main copies, and their gradients the fp32 main gradients."""
        if self._inside:
            yield
            return
        self._inside = True
        for p, main in zip(self.params, self._main):
            p.grad = None
            p.data = main
            p.grad = self._grads.get(id(p))
        try:
            yield
        finally:
            with torch.no_grad():
                for p, low in zip(self.params, self._low):
                    p.grad = None
                    low.copy_(p.data)  # the optimizer and loads update the main copy in place
                    p.data = low
            self._grads.clear()
            self._inside = False
