"""On-policy distillation (`--use-opd`, slime/opd_flags.py): the teacher's signal in the advantages.

For each response token t of a student's sample, the sampled-token estimate of the reverse KL
between student and teacher is `logp_student(y_t) - logp_teacher(y_t)` (both at the token the
student sampled, the student's being the log-probs of the policy that generated the rollout). It
is subtracted from the advantage computed by any estimator:

    A_t <- A_t - opd_kl_coef * (logp_student_t - logp_teacher_t)

so tokens the teacher finds likelier than the student are pushed up and the others down. With no
reward (every reward 0, e.g. `--rm-type zero`) only this term remains: pure distillation.
"""

from __future__ import annotations

from typing import Sequence

from torch import Tensor


def reverse_kl(student: Sequence[Tensor], teacher: Sequence[Tensor]) -> list[Tensor]:
    """Per-token `logp_student - logp_teacher` of every sample."""
    return [s.float() - t.float() for s, t in zip(student, teacher, strict=True)]


def distill_advantages(advantages: Sequence[Tensor], kl: Sequence[Tensor], coef: float) -> list[Tensor]:
    """The advantages with the teacher's per-token penalty `coef * kl` subtracted."""
    return [a - coef * k for a, k in zip(advantages, kl, strict=True)]
