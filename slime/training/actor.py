"""TrainActor: one data-parallel rank; backend-agnostic RL step over micro-batches.

Per rollout (`train`):
  1. reference log-probs (frozen initial weights) when the KL loss is on;
  2. old log-probs: with one step per rollout, the detached log-probs of the training
     forward itself (ratio exactly 1); otherwise a no-grad pass before any update;
  3. advantages via `ADVANTAGE_ESTIMATORS[args.advantage_estimator]`;
  4. per optimizer step: micro-batches of `args.micro_batch_size` samples, per-token
     loss = PPO-clip + kl_coef * KL - entropy_coef * entropy, aggregated as a token
     mean over the *global* step (all ranks), times dp_size to undo FSDP's gradient
     averaging; grad clip; AdamW step.
Metrics are token-weighted within a step (all ranks), averaged over steps, and
identical on every rank.

The class is plain Python; `slime.ray.actor_group.TrainGroup` runs it as Ray actors.
It can also be used in-process (world size 1) in tests.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import Tensor

from slime.algorithms.advantages import ADVANTAGE_ESTIMATORS
from slime.algorithms.losses import POLICY_LOSSES, kl_penalty, masked_sum
from slime.arguments import num_cpu_threads
from slime.types import RolloutBatch
from slime.utils.errors import SlimeConfigError

METRIC_KEYS = ("loss", "pg_loss", "kl_loss", "entropy_loss", "pg_clipfrac", "ppo_kl")


@dataclass
class MicroBatch:
    """Samples for one forward: prompt + response token ids and response lengths."""

    tokens: list[list[int]]
    response_lengths: list[int]


def _make_backend(args, rank, world_size, master_addr, master_port, with_ref):
    if args.train_backend == "fsdp":
        from slime.training.fsdp.backend import FSDPBackend

        return FSDPBackend(args, rank, world_size, master_addr, master_port, with_ref=with_ref)
    raise SlimeConfigError(f"--train-backend {args.train_backend!r} is not available")


class TrainActor:
    def __init__(self, args, rank: int = 0, world_size: int | None = None, role: str = "actor",
                 master_addr: str = "127.0.0.1", master_port: int | None = None):
        if role != "actor":
            raise SlimeConfigError(f"train role {role!r} is not supported yet (only 'actor')")
        self.args = args
        self.rank = rank
        self.world_size = args.dp_size if world_size is None else world_size
        self.role = role
        self.master_addr = master_addr
        self.master_port = master_port
        self.backend = None
        threads = num_cpu_threads(self.world_size)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)

    # ------------------------------------------------------------ lifecycle

    def init(self) -> None:
        torch.manual_seed(self.args.seed)
        self.use_kl = bool(self.args.use_kl_loss and self.args.kl_loss_coef > 0)
        self.backend = _make_backend(self.args, self.rank, self.world_size, self.master_addr,
                                     self.master_port, with_ref=self.use_kl)

    def ready(self) -> bool:
        return self.backend is not None

    def shutdown(self) -> None:
        if self.backend is not None:
            self.backend.close()
            self.backend = None

    # ------------------------------------------------------------ training

    def _micro_batches(self, batch: RolloutBatch, indices: list[int]) -> list[list[int]]:
        m = self.args.micro_batch_size
        return [indices[i : i + m] for i in range(0, len(indices), m)]

    def _mb(self, batch: RolloutBatch, idx: list[int]) -> MicroBatch:
        return MicroBatch([batch.tokens[i] for i in idx], [batch.response_lengths[i] for i in idx])

    def _no_grad_log_probs(self, batch: RolloutBatch, ref: bool) -> list[Tensor]:
        out: list[Tensor] = []
        for idx in self._micro_batches(batch, list(range(len(batch)))):
            lp, _ = self.backend.forward_logprobs(self._mb(batch, idx), grad=False, ref=ref)
            out.extend(lp.detach().cpu().split([batch.response_lengths[i] for i in idx]))
        return out

    def _check(self, batch: RolloutBatch) -> None:
        args = self.args
        per_rank = args.global_batch_size // self.world_size
        expected = per_rank * args.num_steps_per_rollout
        if len(batch) != expected:
            raise ValueError(
                f"rank {self.rank} got {len(batch)} samples, expected {expected} "
                f"(num_steps_per_rollout {args.num_steps_per_rollout} x global_batch_size "
                f"{args.global_batch_size} / dp_size {self.world_size})"
            )
        for i in range(len(batch)):
            r = batch.response_lengths[i]
            if len(batch.loss_masks[i]) != r:
                raise ValueError(f"sample {i}: loss mask has {len(batch.loss_masks[i])} entries, response {r} tokens")

    def train(self, rollout_id: int, batch: RolloutBatch) -> dict[str, float]:
        args, be = self.args, self.backend
        if be is None:
            raise RuntimeError("TrainActor.init() was not called")
        self._check(batch)
        n = len(batch)
        lengths = batch.response_lengths
        masks = [torch.as_tensor(m, dtype=torch.float32) for m in batch.loss_masks]
        advantages = ADVANTAGE_ESTIMATORS[args.advantage_estimator](
            torch.as_tensor(batch.rewards, dtype=torch.float32), lengths, loss_masks=masks
        )
        has_rollout_lp = [
            batch.rollout_log_probs is not None and i < len(batch.rollout_log_probs)
            and batch.rollout_log_probs[i] is not None and len(batch.rollout_log_probs[i]) == lengths[i]
            for i in range(n)
        ]
        ref_lps = self._no_grad_log_probs(batch, ref=True) if self.use_kl else None
        one_step = args.num_steps_per_rollout == 1
        old_lps: list[Tensor | None] = [None] * n if one_step else self._no_grad_log_probs(batch, ref=False)
        policy_loss = POLICY_LOSSES["ppo"]
        dev = be.device

        per_step = n // args.num_steps_per_rollout
        step_metrics: list[Tensor] = []
        grad_norms: list[float] = []
        for s in range(args.num_steps_per_rollout):
            step_idx = list(range(s * per_step, (s + 1) * per_step))
            mbs = self._micro_batches(batch, step_idx)
            local_tokens = sum(float(masks[i].sum()) for i in step_idx)
            global_tokens = float(be.all_reduce_sum(torch.tensor([local_tokens]))[0])
            denom = max(global_tokens, 1.0)
            sums = torch.zeros(len(METRIC_KEYS), dtype=torch.float64)

            def loss_fn(k: int, lp: Tensor, ent: Tensor) -> Tensor:
                idx = mbs[k]
                mask = torch.cat([masks[i] for i in idx]).to(dev)
                adv = torch.cat([advantages[i] for i in idx]).to(dev)
                if one_step:
                    old = lp.detach()
                    for i, part in zip(idx, old.cpu().split([lengths[i] for i in idx])):
                        old_lps[i] = part
                else:
                    old = torch.cat([old_lps[i] for i in idx]).to(dev)
                pg, clipfrac = policy_loss(lp, old, adv, args.eps_clip, args.eps_clip_high)
                tok_loss = pg
                kl = torch.zeros_like(pg)
                if self.use_kl:
                    ref = torch.cat([ref_lps[i] for i in idx]).to(dev)
                    kl = kl_penalty(lp, ref, args.kl_loss_type)
                    tok_loss = tok_loss + args.kl_loss_coef * kl
                if args.entropy_coef:
                    tok_loss = tok_loss - args.entropy_coef * ent
                with torch.no_grad():
                    vals = (tok_loss, pg, kl, ent, clipfrac, old - lp)
                    sums.add_(torch.stack([masked_sum(v.detach().double(), mask) for v in vals]).cpu())
                return masked_sum(tok_loss, mask) / denom * self.world_size

            grad_norms.append(be.train_step([self._mb(batch, idx) for idx in mbs], loss_fn,
                                            entropy_grad=bool(args.entropy_coef)))
            step_metrics.append(be.all_reduce_sum(sums) / denom)

        # |train log-prob before the update - rollout log-prob| over loss-mask tokens
        diff = torch.zeros(2, dtype=torch.float64)
        for i in range(n):
            if has_rollout_lp[i] and lengths[i] > 0:
                rl = torch.as_tensor(batch.rollout_log_probs[i], dtype=torch.float32)
                diff[0] += float(masked_sum((old_lps[i].float() - rl).abs(), masks[i]))
                diff[1] += float(masks[i].sum())
        diff = be.all_reduce_sum(diff)

        mean = torch.stack(step_metrics).mean(0)
        metrics = {f"train/{k}": float(mean[j]) for j, k in enumerate(METRIC_KEYS)}
        metrics["train/grad_norm"] = float(sum(grad_norms) / len(grad_norms))
        metrics["train/lr"] = be.lr
        if diff[1] > 0:
            metrics["train/train_rollout_logprob_abs_diff"] = float(diff[0] / diff[1])
        return metrics

    # ------------------------------------------------------------ weights and checkpoints

    def update_weights(self, engine_urls: list[str], weight_version: int) -> dict:
        from slime.training.weight_sync import sync_weights

        return sync_weights(
            self.backend.named_weights(),
            engine_urls,
            weight_version,
            self.args.update_weight_buffer_size,
            send=self.rank == 0,
        )

    def save(self, path: str) -> None:
        self.backend.save(path)

    def load(self, path: str) -> None:
        self.backend.load(path)

    def full_state(self, optimizer: bool = True) -> tuple[dict, dict | None]:
        """Full model (and optimizer) state dicts on rank 0 (empty elsewhere). Collective; for tests/tools."""
        return self.backend.full_state(optimizer)
