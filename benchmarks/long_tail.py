"""A long-tail response-length workload for async benchmarks and tests.

`--custom-generate-function-path benchmarks/long_tail.py:generate` makes every sample generate a
fixed number of tokens (`ignore_eos`) drawn from a heavy-tailed distribution: most responses are
short, a few are up to `--rollout-max-response-len`, the shape of reasoning-model rollouts where
the slowest group decides when a synchronous rollout ends. The length depends only on the
sample's prompt and index within its group, so sync and async runs see the same workload.
"""

from __future__ import annotations

import hashlib

from slime.rollout.generate import generate as generate_once


def tail_length(key: str, max_len: int, shortest: int = 4, alpha: float = 1.2) -> int:
    """A Pareto(alpha) draw scaled to [shortest, max_len], deterministic in `key`."""
    u = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") / 2**64
    return min(max_len, int(shortest / (1.0 - u) ** (1.0 / alpha)))


async def generate(args, sample, sampling_params):
    from slime.rollout.api import context

    budget = sampling_params["max_new_tokens"]  # what is left of it when a partial sample resumes
    want = tail_length(f"{sample.prompt}/{sample.index % args.n_samples_per_prompt}", args.rollout_max_response_len)
    params = dict(sampling_params, ignore_eos=True, max_new_tokens=max(1, min(budget, want - sample.response_length)))
    return await generate_once(context().engines, sample, params)
