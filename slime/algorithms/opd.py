"""On-policy distillation (`--use-opd`, slime/opd_flags.py): the teacher's signal in the advantages.

For each response token t of a student's sample, the sampled-token estimate of the reverse KL
between student and teacher is `logp_student(y_t) - logp_teacher(y_t)` (both at the token the
student sampled, the student's being the log-probs of the policy that generated the rollout). It
is subtracted from the advantage computed by any estimator:

    A_t <- A_t - opd_kl_coef * (logp_student_t - logp_teacher_t)

so tokens the teacher finds likelier than the student are pushed up and the others down. With no
reward (every reward 0, e.g. `--rm-type none`) only this term remains: pure distillation.

The teacher's log-probs come from the trainer's teacher forward (`--opd-type fsdp|megatron`) or,
with a served teacher (`--opd-type sglang`), from the rollout batch (`served_teacher_log_probs`).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor


def reverse_kl(student: Sequence[Tensor], teacher: Sequence[Tensor]) -> list[Tensor]:
    """Per-token `logp_student - logp_teacher` of every sample."""
    return [s.float() - t.float() for s, t in zip(student, teacher, strict=True)]


def distill_advantages(advantages: Sequence[Tensor], kl: Sequence[Tensor], coef: float) -> list[Tensor]:
    """The advantages with the teacher's per-token penalty `coef * kl` subtracted."""
    return [a - coef * k for a, k in zip(advantages, kl, strict=True)]


def served_teacher_log_probs(teacher: Sequence[Sequence[float] | None] | None, student: Sequence[Tensor],
                             masks: Sequence[Tensor]) -> list[Tensor]:
    """`--opd-type sglang`: the served teacher's log-probs the batch carries (one list per sample,
    `RolloutBatch.teacher_log_probs`) as Tensor[L_i] each, L_i = len(student[i]). A sample without
    them (the teacher did not score it: it failed) must train on no token (`masks[i]` all 0); it gets
    the student's own log-probs, a reverse KL of 0."""
    if teacher is None or len(teacher) != len(student):
        raise ValueError(f"--opd-type sglang: the batch carries {'no' if teacher is None else len(teacher)} samples' "
                         f"teacher log-probs for {len(student)} samples")
    out = []
    for i, (t, s, m) in enumerate(zip(teacher, student, masks)):
        if t is None and not bool(m.any()):
            out.append(s.detach().float().clone())
        elif t is None or len(t) != len(s):
            raise ValueError(f"--opd-type sglang: sample {i} has {'no' if t is None else len(t)} teacher log-probs "
                             f"for {len(s)} response tokens")
        else:
            out.append(torch.as_tensor(t, dtype=torch.float32))
    return out
