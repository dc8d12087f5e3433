"""On-policy distillation with a served teacher (`--use-opd --opd-type sglang`, slime/opd_flags.py):
the teacher's log-probs of every finished sample's response tokens.

The teacher is a frozen model served beside the policy (`--sglang-config`), reached by name
(`context().model(--opd-teacher-model)`). For a sample of L tokens whose last R are the response
(prompt length P = L - R), one SGLang-native scoring call, nothing generated:

    {"input_ids": tokens, "return_logprob": true, "logprob_start_len": P - 1,
     "sampling_params": {"max_new_tokens": 0, "temperature": 1.0}}

answers `meta_info.input_token_logprobs` for positions P-1 .. L-1: a null first entry (a position
is scored from the tokens before it, SGLang's shape; docs/engines/generate.md), then the teacher's
`log_softmax(logits)` of each response token at temperature 1 (SGLang's prompt log-probs, whatever
the request's temperature). Those R values become `sample.teacher_log_probs`, aligned with
`rollout_log_probs` and `loss_mask` (tool tokens too; their loss mask keeps them out of the loss).

A call that raises, times out (`--rm-timeout`), is aborted or answers another number of entries or
other tokens marks the sample FAILED as a failing reward does (`reward` None: counted in
`rollout/reward_failures`, loss mask 0), logged once per sample. Samples already FAILED or ABORTED
are not sent. `slime.rollout.group_generation` calls `score_teacher` right after the reward.
"""

from __future__ import annotations

import asyncio
import logging
import math

from slime.rollout.api import context
from slime.types import Sample, SampleStatus

logger = logging.getLogger(__name__)


def scoring_payload(sample: Sample) -> dict:
    """The teacher's `/generate` payload for `sample` (module docstring)."""
    return {"input_ids": [int(t) for t in sample.tokens], "return_logprob": True,
            "logprob_start_len": sample.prompt_length - 1,
            "sampling_params": {"max_new_tokens": 0, "temperature": 1.0}}


def response_log_probs(sample: Sample, out: dict) -> list[float]:
    """The response tokens' log-probs in the teacher's answer `out` to `scoring_payload(sample)`;
    raises when the answer does not hold exactly one finite log-prob per response token."""
    meta = out.get("meta_info") or {}
    finish = meta.get("finish_reason") or {}
    if isinstance(finish, dict) and finish.get("type") == "abort":
        raise RuntimeError(f"the teacher's call was aborted ({finish.get('message', '')})")
    entries = meta.get("input_token_logprobs")
    r = sample.response_length
    if not isinstance(entries, list) or len(entries) != r + 1:
        raise RuntimeError(f"the teacher returned {len(entries) if isinstance(entries, list) else 'no'} "
                           f"input_token_logprobs for {r} response tokens (expected {r + 1}, the first null)")
    entries = entries[1:]
    tokens = [int(e[1]) for e in entries]
    if tokens != sample.response_tokens:
        raise RuntimeError("the teacher scored other tokens than the sample's response")
    lps = [float(e[0]) for e in entries]
    if not all(math.isfinite(x) for x in lps):
        raise RuntimeError("the teacher returned a log-prob that is not finite")
    return lps


async def teacher_log_probs(pool, sample: Sample, timeout: float) -> list[float]:
    """The teacher's log-prob of each of `sample`'s response tokens (one call to `pool`, at most
    `timeout` seconds)."""
    if sample.response_length == 0:
        return []
    if sample.prompt_length < 1:
        raise ValueError("a sample without prompt tokens cannot be scored by the teacher")
    out = await asyncio.wait_for(pool.generate(scoring_payload(sample)), timeout=timeout)
    return response_log_probs(sample, out)


async def score_teacher(args, sample: Sample, pool=None) -> Sample:
    """Set `sample.teacher_log_probs` from the served teacher (`pool`, default the run's
    `--opd-teacher-model`); a failure marks the sample FAILED (module docstring). FAILED and
    ABORTED samples are returned as they are."""
    if sample.status in (SampleStatus.FAILED, SampleStatus.ABORTED):
        return sample
    try:
        pool = pool if pool is not None else context().model(args.opd_teacher_model)
        sample.teacher_log_probs = await teacher_log_probs(pool, sample, args.rm_timeout)
    except Exception as e:  # counted in rollout/reward_failures and excluded from the loss
        logger.warning("teacher (--opd-teacher-model %s) failed for sample %d (label %r): %r",
                       args.opd_teacher_model, sample.index, sample.label, e)
        sample.teacher_log_probs = None
        sample.reward = None
        sample.status = SampleStatus.FAILED
    return sample
