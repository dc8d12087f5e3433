"""`--deterministic-mode` on the trainer side (slime.training.fsdp.determinism): deterministic
algorithms are on, and the same seed gives bitwise-identical metrics and weights, also for a run
resumed from a checkpoint against an uninterrupted one."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.training import COMMON, deterministic, local_actor, make_args, synthetic_batch


@pytest.fixture
def restore_algorithms():
    """`use_deterministic_algorithms` is process-wide: give the next tests what they had."""
    before = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(before)


def _weights(actor):
    return {k: v.detach().clone() for k, v in actor.backend.named_weights()}


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_deterministic_trainer_same_seed_and_resume_bitwise(tiny_model_dir, tmp_path, restore_algorithms):
    args = make_args(tiny_model_dir, tmp_path, *COMMON, "--micro-batch-size", 2, "--deterministic-mode")
    batches = [synthetic_batch(tiny_model_dir, 8, seed=s) for s in (3, 5)]
    ckpt = tmp_path / "ckpt"

    a = local_actor(args)  # uninterrupted: two rollouts, a checkpoint after the first
    try:
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
        m0 = a.train(0, batches[0])
        a.save(str(ckpt))
        m1 = a.train(1, batches[1])
        final = _weights(a)
    finally:
        a.shutdown()

    b = local_actor(args)  # the same seed again
    try:
        assert deterministic(b.train(0, batches[0])) == deterministic(m0)
    finally:
        b.shutdown()

    c = local_actor(args)  # resumed from the checkpoint
    try:
        c.load(str(ckpt))
        assert deterministic(c.train(1, batches[1])) == deterministic(m1)
        _same(_weights(c), final)
    finally:
        c.shutdown()
    assert any("logprob" in k for k in m1)  # the engine/trainer log-prob difference is among them
