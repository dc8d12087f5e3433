"""The learning rate of every optimizer step (Megatron's flags and rule, as slime uses them).

    --lr-decay-style constant | linear | cosine     (default constant: --lr at every step)
    --lr-warmup-iters K | --lr-warmup-fraction F    (linear warm-up from --lr-warmup-init, default 0)
    --lr-decay-iters D                              (default: every optimizer step of the run)
    --min-lr M                                      (where the decay ends, default 0)

Step `s` (0-based: the number of optimizer steps already taken) trains at
- `init + (lr - init) * s / K` while `s <= K` (warm-up; the first step uses `init`, as Megatron's);
- `lr` with the constant style;
- `min_lr` once `s > D`;
- else `min_lr + c * (lr - min_lr)` with `r = (s - K) / (D - K)` and `c = 1 - r` (linear) or
  `c = (1 + cos(pi * r)) / 2` (cosine).

The count of steps taken is kept in the optimizer's parameter groups (`lr_step`), so it is saved
and restored with the optimizer state and a resumed run continues the schedule where it stopped.
A step skipped on a non-finite gradient norm does not count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

STEP_KEY = "lr_step"


@dataclass(frozen=True)
class LRSchedule:
    lr: float
    min_lr: float = 0.0
    style: str = "constant"
    warmup_iters: int = 0
    warmup_init: float = 0.0
    decay_iters: int = 1

    @classmethod
    def from_args(cls, args, lr: float) -> "LRSchedule":
        """The run's schedule peaking at `lr` (--lr, or --critic-lr for the PPO critic)."""
        decay = args.lr_decay_iters or args.num_rollout * args.num_steps_per_rollout
        warmup = args.lr_warmup_iters if args.lr_warmup_fraction is None else int(args.lr_warmup_fraction * decay)
        return cls(lr=lr, min_lr=min(args.min_lr, lr), style=args.lr_decay_style, warmup_iters=warmup,
                   warmup_init=args.lr_warmup_init, decay_iters=decay)

    def at(self, step: int) -> float:
        """The learning rate of step `step` (0-based)."""
        if self.warmup_iters > 0 and step <= self.warmup_iters:
            return self.warmup_init + (self.lr - self.warmup_init) * step / self.warmup_iters
        if self.style == "constant":
            return self.lr
        if step > self.decay_iters:
            return self.min_lr
        span = self.decay_iters - self.warmup_iters
        ratio = (step - self.warmup_iters) / span if span > 0 else 1.0
        coeff = 1.0 - ratio if self.style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.lr - self.min_lr)


def start(schedule: LRSchedule, param_groups: list[dict]) -> None:
    """A new optimizer's groups: no step taken, the first step's learning rate (the step count is
    in the groups from the start, so a checkpoint loaded into them brings its own count back)."""
    for group in param_groups:
        group["lr"] = schedule.at(0)
        group[STEP_KEY] = 0


def apply(schedule: LRSchedule, param_groups: list[dict]) -> int:
    """Set every group's learning rate for the next step; returns that step's index."""
    step = int(param_groups[0].get(STEP_KEY, 0))
    lr = schedule.at(step)
    for group in param_groups:
        group["lr"] = lr
    return step


def advance(param_groups: list[dict], step: int) -> None:
    """Record that step `step` was taken (after `optimizer.step()`)."""
    for group in param_groups:
        group[STEP_KEY] = step + 1
