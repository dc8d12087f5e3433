"""The trainer's own throughput metric (`perf/train_model_tflops`, slime/training/throughput.py):
model FLOPs of the rank's batch over the seconds of the train call, counting one forward per
extra pass (reference model, separate old-log-prob pass)."""

import pytest
import torch

from slime.training import throughput
from slime.training.throughput import model_flops, parameter_count
from tests.helpers.training import local_actor, make_args, synthetic_batch

COMMON = ["--rollout-batch-size", 3, "--n-samples-per-prompt", 2, "--micro-batch-size", 4]


class Clock:
    """perf_counter for throughput.py: 10.0 at the meter's start, 12.0 at its end (a 2 s call)."""

    def __init__(self):
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return 10.0 if self.calls == 1 else 12.0


def test_model_flops_convention():
    assert model_flops(100, 7) == 6 * 100 * 7
    assert model_flops(100, 7, extra_forwards=2) == 10 * 100 * 7


@pytest.mark.parametrize("flags,extra_forwards", [
    ([], 0),  # one step per rollout, no KL: the training forward gives the old log-probs
    (["--use-kl-loss", "--kl-loss-coef", "0.01"], 1),  # + the reference forward
    (["--use-kl-loss", "--kl-loss-coef", "0.01", "--num-steps-per-rollout", 2], 2),  # + an old-log-prob pass
])
def test_train_logs_model_tflops_of_its_batch(tiny_model_dir, tmp_path, monkeypatch, flags, extra_forwards):
    args = make_args(tiny_model_dir, tmp_path, *COMMON, *flags)
    actor = local_actor(args)
    try:
        batch = synthetic_batch(tiny_model_dir, 6, seed=3)
        clock = Clock()
        monkeypatch.setattr(throughput.time, "perf_counter", clock)
        m = actor.train(0, batch)
        monkeypatch.undo()
        n_params = parameter_count(actor.backend.model)
        assert n_params == sum(p.numel() for p in actor.backend.model.parameters()) > 0
        tokens = sum(len(t) for t in batch.tokens)
        expected = (6 + 2 * extra_forwards) * n_params * tokens / 2.0 / 1e12
        assert clock.calls == 2
        assert m["perf/train_model_tflops"] == pytest.approx(expected, rel=1e-12)
        assert ("memory/train_cuda_peak_mb" in m) == torch.cuda.is_available()  # CUDA only
    finally:
        actor.shutdown()
