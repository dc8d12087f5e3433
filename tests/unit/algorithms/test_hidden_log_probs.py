"""Log-probs and entropy straight from hidden states (slime.algorithms.losses.log_probs_from_hidden):
the values and gradients of the full logits, without a tensor of all rows x vocabulary."""

from __future__ import annotations

import pytest
import torch


class _LargestOutput(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the largest tensor any operation produced (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("with_entropy, entropy_grad", [(False, False), (True, False), (True, True)])
def test_log_probs_from_hidden_states_equal_the_full_logits_without_building_them(with_entropy, entropy_grad):
    from slime.algorithms.losses import compute_entropy, log_probs_from_hidden

    g = torch.Generator().manual_seed(3)
    n, h, v, chunk = 300, 16, 1000, 64
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    weight = (0.3 * torch.randn(v, h, generator=g)).requires_grad_()
    tokens = torch.randint(0, v, (n,), generator=g)
    up_lp, up_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)

    logits = torch.nn.functional.linear(hidden, weight) / 0.7  # the naive path: [n, v] at once
    ref_lp = torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0]
    ref_ent = compute_entropy(logits, 1.0)
    loss = (ref_lp * up_lp).sum() + ((ref_ent * up_ent).sum() if entropy_grad else 0)
    ref_grads = torch.autograd.grad(loss, (hidden, weight))

    with _LargestOutput() as seen:
        lp, ent = log_probs_from_hidden(hidden, weight, tokens, 0.7, chunk, with_entropy=with_entropy,
                                        entropy_grad=entropy_grad)
        loss = (lp * up_lp).sum() + ((ent * up_ent).sum() if entropy_grad else 0)
        grads = torch.autograd.grad(loss, (hidden, weight))
    assert seen.largest <= chunk * v < n * v  # no tensor of all rows x vocabulary, forward or backward
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
    assert (ent is None) == (not with_entropy)
    if with_entropy:
        torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)
        assert ent.requires_grad == entropy_grad
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_log_probs_from_hidden_states_in_one_chunk_are_the_logits_path_bit_for_bit():
    from slime.algorithms.losses import compute_log_probs, log_probs_from_hidden

    g = torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(40, 8, generator=g), torch.randn(50, 8, generator=g)
    tokens = torch.randint(0, 50, (40,), generator=g)
    lp, _ = log_probs_from_hidden(hidden, weight, tokens, 1.0, chunk_size=64)
    assert torch.equal(lp, compute_log_probs(torch.nn.functional.linear(hidden, weight), tokens, 1.0))
