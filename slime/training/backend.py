"""The contract between `TrainActor` and a training backend (fsdp, megatron), and what both share.

`TrainActor` (slime/training/actor.py) is backend-blind: it builds micro-batches (`MicroBatch`),
computes the per-token loss of each one and calls the backend through `TrainBackend` only. A
backend is one train rank of a model plus its optimizer; it is built by the trainer's registry
(`slime.training.actor.BACKENDS`) as

    Backend(args, rank, world_size, master_addr, master_port, with_ref=..., value_head=...)

and joins (or creates) the default process group of the train ranks. Backends:
`slime.training.fsdp.backend.FSDPBackend`, `slime.training.megatron.backend.MegatronBackend`.

`StepTail` is the end of an optimizer step and the small helpers that both backends implement
the same way (grad clip bound, skip on a non-finite norm, learning rate, all-reduce of metrics).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from slime.training import lr_schedule

logger = logging.getLogger(__name__)


@dataclass
class MicroBatch:
    """Samples for one forward: prompt + response token ids and response lengths."""

    tokens: list[list[int]]
    response_lengths: list[int]
    # MoE routing replay: per sample the experts to force, Tensor[<= T_i - 1, L * K or L, K] (the
    # engine's with --use-rollout-routing-replay, the old-policy forward's with --use-routing-replay)
    routed_experts: list | None = None
    # vision-language models: per sample its image sources (None: no image), in its image slots' order
    images: list | None = None


# loss_fn(k, out Tensor[N_k], entropy Tensor[N_k] | None) -> scalar loss of micro-batch k (see train_step)
LossFn = Callable[[int, Tensor, "Tensor | None"], Tensor]


class TrainBackend(Protocol):
    """One train rank of a model and its optimizer. Every method marked collective must be called
    on every train rank in the same order (they run process-group collectives).

    Tensors of a micro-batch are its samples' response tokens concatenated in sample order:
    N = sum(mb.response_lengths); response token t of a sample is scored by the model's output at
    position t - 1 (log-probs at the rollout temperature; SFT at T = 1).

    Attributes read by the trainer: `device` (where loss tensors go), `lr` (the current learning
    rate) and, for the colocated offload (slime/training/offload.py), `model`, `optimizer`,
    `ref_model` and `teacher_model` (None without a reference model / OPD teacher).
    """

    device: torch.device
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    ref_model: torch.nn.Module | None
    teacher_model: torch.nn.Module | None

    @property
    def lr(self) -> float: ...

    def forward_logprobs(self, mb: MicroBatch, *, grad: bool = False, with_entropy: bool = False,
                         entropy_grad: bool = False, ref: bool = False,
                         teacher: bool = False) -> tuple[Tensor, Tensor | None]:
        """(log_probs Tensor[N], entropy Tensor[N] or None unless `with_entropy`) of the policy, or of
        a frozen model (never with gradient): the KL reference with `ref`, the on-policy distillation
        teacher with `teacher`. `grad`: keep the graph; `entropy_grad`: the entropy too. Collective
        under tensor parallelism."""

    def forward_values(self, mb: MicroBatch, *, grad: bool = False) -> Tensor:
        """Critic values Tensor[N] (a backend built with value_head=True)."""

    def train_step(self, micro_batches: list[MicroBatch], loss_fn: LossFn, *, entropy_grad: bool = False) -> float:
        """Forward and backward every micro-batch, reduce gradients, clip (`--clip-grad`), optimizer
        step (skipped on a non-finite norm), zero the gradients. `loss_fn(k, log_probs, entropy)`
        returns micro-batch k's scalar loss, already weighted for accumulation (the backend only sums
        gradients); a value-head backend calls `loss_fn(k, values, None)`. Returns the total
        gradient norm before clipping, identical on every rank. Collective."""

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """(Hugging Face name, full tensor) of every parameter, a tied head once. Collective: every
        rank iterates to the end."""

    def full_state(self, optimizer: bool = True) -> tuple[dict, dict | None]:
        """Full model (and optimizer) state dicts on rank 0, empty elsewhere. Collective."""

    def save(self, path: str | Path) -> None:
        """`path/hf` (Hugging Face weights, rank 0) and `path/train_state` (the backend's format). Collective."""

    def load(self, path: str | Path) -> None:
        """Restore model and optimizer from `path/train_state`. Collective."""

    def all_reduce_sum(self, tensor: Tensor) -> Tensor:
        """Sum over the train ranks (float64 on CPU, float32 on GPU), returned on the CPU. Collective."""

    def close(self) -> None:
        """Tear down what the backend created (its process groups)."""


class StepTail:
    """What every backend does the same way at the end of a step (mixed into FSDPBackend and
    MegatronBackend, which have `optimizer`, `lr_schedule`, `device`, `rank`, `world_size` and `args`)."""

    def _max_grad_norm(self) -> float:
        return self.args.clip_grad if self.args.clip_grad and self.args.clip_grad > 0 else math.inf

    def _step_if_finite(self, grad_norm: float) -> float:
        """Optimizer step (skipped, with a warning, on a non-finite norm), then zero the grads."""
        if math.isfinite(grad_norm):
            step = lr_schedule.apply(self.lr_schedule, self.optimizer.param_groups)  # this step's learning rate
            self.optimizer.step()
            lr_schedule.advance(self.optimizer.param_groups, step)
        else:
            logger.warning("rank %d: non-finite grad norm %s, skipping the optimizer step", self.rank, grad_norm)
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    @property
    def lr(self) -> float:
        """The learning rate of the last step taken (the schedule's first before any)."""
        return float(self.optimizer.param_groups[0]["lr"])

    def all_reduce_sum(self, tensor: Tensor) -> Tensor:
        t = tensor.detach().to(self.device, torch.float64 if self.device.type == "cpu" else torch.float32).clone()
        if self.world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.cpu()
