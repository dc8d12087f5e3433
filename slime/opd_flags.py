"""On-policy distillation flags (`--use-opd` and friends, slime's names) and their start-up checks
(docs/algorithms.md, "On-policy distillation").

The student's own rollouts are scored by a teacher; each response token's reverse KL estimate
`logp_student - logp_teacher` enters the advantages as a penalty (slime's rule):
`A_t <- A_t - opd_kl_coef * (logp_student_t - logp_teacher_t)`, with any advantage estimator.

- `--opd-type <train backend>` (`fsdp` or `megatron`, the run's `--train-backend`): the teacher
  (`--opd-teacher-load`, a Hugging Face model directory with the student's tokenizer) is loaded in
  the trainer like the KL reference model: sharded like the policy, on a GPU kept in host memory
  and brought to the device only for its forward.
- `--opd-type sglang` (a teacher served by its own engines) is refused: it needs extra served
  models (`--sglang-config`), which this build does not have.

`validate_opd(args)` runs at parse time and gives one line for each bad combination; the teacher
directory itself (exists, same tokenizer as `--hf-checkpoint`) is checked by
`slime.argument_checks.check_frozen_model`.
"""

from __future__ import annotations

from slime.utils.errors import SlimeConfigError

TRAINER_OPD_TYPES = ("fsdp", "megatron")
OPD_TYPES = ("sglang", *TRAINER_OPD_TYPES)


def add_opd_flags(p) -> None:
    g = p.add_argument_group("on-policy distillation (docs/algorithms.md)")
    g.add_argument("--use-opd", action="store_true",
                   help="on-policy distillation: a teacher scores the student's sampled tokens and the "
                        "per-token reverse KL is subtracted from the advantages")
    g.add_argument("--opd-type", choices=OPD_TYPES, default=None,
                   help="where the teacher runs: the train backend's name (fsdp, megatron: loaded in the "
                        "trainer from --opd-teacher-load) or sglang (a served teacher; not built)")
    g.add_argument("--opd-kl-coef", type=float, default=1.0,
                   help="weight of the per-token reverse KL (student - teacher log-prob) in the advantages")
    g.add_argument("--opd-teacher-load", default=None,
                   help="Hugging Face model directory of the teacher (--opd-type fsdp|megatron); it must use "
                        "the student's tokenizer")


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise SlimeConfigError(message)


def validate_opd(args) -> None:
    """The OPD flags (see the module docstring); sets `args.opd_in_trainer` (the trainer loads and
    runs the teacher)."""
    args.opd_in_trainer = False
    if not args.use_opd:
        given = [f for f, v in (("--opd-type", args.opd_type), ("--opd-teacher-load", args.opd_teacher_load))
                 if v is not None]
        given += ["--opd-kl-coef"] if args.opd_kl_coef != 1.0 else []
        _require(not given, f"{given[0]} is an on-policy distillation flag: add --use-opd" if given else "")
        return
    _require(args.opd_type is not None,
             f"--use-opd needs --opd-type: {args.train_backend} (the teacher in the trainer, from "
             "--opd-teacher-load) or sglang (a served teacher)")
    _require(args.opd_type != "sglang",
             "--opd-type sglang: a served teacher needs extra served models (--sglang-config), which this build "
             f"does not have; load the teacher in the trainer with --opd-type {args.train_backend} "
             "--opd-teacher-load DIR")
    _require(args.opd_type == args.train_backend,
             f"--opd-type {args.opd_type} loads the teacher in the {args.opd_type} trainer, but this run trains "
             f"with --train-backend {args.train_backend}; use --opd-type {args.train_backend}")
    _require(args.opd_teacher_load is not None,
             f"--opd-type {args.opd_type} needs --opd-teacher-load DIR (the teacher's Hugging Face model directory)")
    _require(args.opd_kl_coef > 0, f"--opd-kl-coef must be > 0 (the weight of the teacher's signal), got "
                                   f"{args.opd_kl_coef}")
    _require(args.loss_type != "sft_loss", "--use-opd with --loss-type sft_loss: distillation trains the policy "
                                           "loss on the student's rollouts; leave one of them out")
    args.opd_in_trainer = True
