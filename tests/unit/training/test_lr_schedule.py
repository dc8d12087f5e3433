"""The learning-rate schedule (slime.training.lr_schedule): Megatron's rule for every style, the
defaults taken from the run's length, and one line for each bad flag."""

from __future__ import annotations

import math

import pytest

from slime.training.lr_schedule import LRSchedule, advance, apply
from slime.utils.errors import SlimeConfigError
from tests.helpers.args import make_args


def test_constant_is_the_peak_at_every_step_after_the_warm_up():
    s = LRSchedule(lr=1e-3, style="constant", warmup_iters=4, warmup_init=1e-4, decay_iters=10)
    assert [s.at(i) for i in range(6)] == pytest.approx([1e-4, 3.25e-4, 5.5e-4, 7.75e-4, 1e-3, 1e-3])
    assert s.at(1000) == 1e-3
    assert LRSchedule(lr=2e-5).at(0) == 2e-5  # the default: --lr from the first step on


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_decay_from_the_peak_to_min_lr(style):
    s = LRSchedule(lr=1.0, min_lr=0.1, style=style, warmup_iters=2, decay_iters=10)
    assert [s.at(i) for i in range(3)] == pytest.approx([0.0, 0.5, 1.0])  # warm-up from 0 (Megatron's first step)
    for step in range(2, 11):
        r = (step - 2) / 8
        c = 1 - r if style == "linear" else 0.5 * (math.cos(math.pi * r) + 1)
        assert s.at(step) == pytest.approx(0.1 + c * 0.9), step
    assert s.at(10) == pytest.approx(0.1) and s.at(11) == 0.1 and s.at(500) == 0.1
    lrs = [s.at(i) for i in range(2, 12)]
    assert lrs == sorted(lrs, reverse=True)  # never rises after the warm-up


def test_the_step_count_lives_in_the_optimizer_groups():
    s = LRSchedule(lr=1.0, style="linear", decay_iters=4)
    groups = [{"lr": 9.0}, {"lr": 9.0}]
    seen = []
    for _ in range(5):
        step = apply(s, groups)
        seen.append((step, groups[0]["lr"], groups[1]["lr"]))
        advance(groups, step)
    assert seen == [(0, 1.0, 1.0), (1, 0.75, 0.75), (2, 0.5, 0.5), (3, 0.25, 0.25), (4, 0.0, 0.0)]
    assert groups[0]["lr_step"] == 5  # saved and restored with the optimizer's state


def test_defaults_come_from_the_run(tiny_model_dir, tmp_path):
    # 6 rollouts x 2 optimizer steps: the decay spans the run's 12 steps; the warm-up is a fraction of it
    args = make_args(tiny_model_dir, tmp_path, "--num-rollout", 6, "--rollout-batch-size", 4, "--n-samples-per-prompt",
                     2, "--global-batch-size", 4, "--lr", 1e-3, "--lr-decay-style", "cosine", "--min-lr", 1e-5,
                     "--lr-warmup-fraction", 0.25)
    s = LRSchedule.from_args(args, args.lr)
    assert (s.decay_iters, s.warmup_iters, s.min_lr, s.style) == (12, 3, 1e-5, "cosine")
    args = make_args(tiny_model_dir, tmp_path, "--lr-decay-iters", 100, "--lr-warmup-iters", 7)
    assert (LRSchedule.from_args(args, 0.5).decay_iters, LRSchedule.from_args(args, 0.5).warmup_iters) == (100, 7)
    assert LRSchedule.from_args(make_args(tiny_model_dir, tmp_path), 1e-6) == LRSchedule(lr=1e-6, decay_iters=1)


@pytest.mark.parametrize("flags, message", [
    (["--lr-warmup-iters", 2, "--lr-warmup-fraction", 0.1], "give --lr-warmup-iters or --lr-warmup-fraction, not both"),
    (["--lr-warmup-fraction", 1.5], "--lr-warmup-fraction must be in [0, 1], got 1.5"),
    (["--min-lr", 1.0, "--lr", 0.1], "--min-lr 1.0 is above --lr 0.1"),
    (["--lr-decay-iters", 0], "--lr-decay-iters must be >= 1, got 0"),
    (["--lr-warmup-iters", 50, "--lr-decay-iters", 10], "--lr-warmup-iters 50 is longer than the 10 optimizer steps"),
    (["--lr-decay-style", "wsd"], "--lr-decay-style: invalid choice: 'wsd'"),
])
def test_bad_schedule_flags_are_one_line(tiny_model_dir, tmp_path, flags, message):
    with pytest.raises(SlimeConfigError) as e:
        make_args(tiny_model_dir, tmp_path, *flags)
    assert message in str(e.value)
