"""On-policy distillation flags (`--use-opd` and friends, slime's names) and their start-up checks
(docs/algorithms.md, "On-policy distillation").

The student's own rollouts are scored by a teacher; each response token's reverse KL estimate
`logp_student - logp_teacher` enters the advantages as a penalty (slime's rule):
`A_t <- A_t - opd_kl_coef * (logp_student_t - logp_teacher_t)`, with any advantage estimator.

- `--opd-type <train backend>` (`fsdp` or `megatron`, the run's `--train-backend`): the teacher
  (`--opd-teacher-load`, a Hugging Face model directory with the student's tokenizer) is loaded in
  the trainer like the KL reference model: sharded like the policy, on a GPU kept in host memory
  and brought to the device only for its forward (`args.opd_in_trainer`).
- `--opd-type sglang`: the teacher is a frozen model served beside the policy (`--sglang-config`),
  named by `--opd-teacher-model` (default `teacher`); the rollout asks it for the log-probs of every
  finished sample's response tokens (`slime.rollout.teacher`) and the batch carries them to the
  trainer (`args.opd_served`). Its log-probs are at temperature 1 (SGLang's prompt log-probs).

`validate_opd(args)` runs at parse time, after `--sglang-config` set `args.served_models`, and gives
one line for each bad combination; the teacher's directory itself (exists, same tokenizer as
`--hf-checkpoint`) is checked by `slime.argument_checks.check_opd_teacher`.
"""

from __future__ import annotations

from slime.utils.errors import SlimeConfigError

TRAINER_OPD_TYPES = ("fsdp", "megatron")
SERVED_OPD_TYPE = "sglang"
OPD_TYPES = (SERVED_OPD_TYPE, *TRAINER_OPD_TYPES)
DEFAULT_TEACHER_MODEL = "teacher"


def add_opd_flags(p) -> None:
    g = p.add_argument_group("on-policy distillation (docs/algorithms.md)")
    g.add_argument("--use-opd", action="store_true",
                   help="on-policy distillation: a teacher scores the student's sampled tokens and the "
                        "per-token reverse KL is subtracted from the advantages")
    g.add_argument("--opd-type", choices=OPD_TYPES, default=None,
                   help="where the teacher runs: the train backend's name (fsdp, megatron: loaded in the "
                        "trainer from --opd-teacher-load) or sglang (a frozen model served beside the policy, "
                        "--sglang-config, named by --opd-teacher-model)")
    g.add_argument("--opd-kl-coef", type=float, default=1.0,
                   help="weight of the per-token reverse KL (student - teacher log-prob) in the advantages")
    g.add_argument("--opd-teacher-load", default=None,
                   help="Hugging Face model directory of the teacher (--opd-type fsdp|megatron); it must use "
                        "the student's tokenizer")
    g.add_argument("--opd-teacher-model", default=DEFAULT_TEACHER_MODEL,
                   help="--opd-type sglang: the name of the served teacher, a frozen model of --sglang-config "
                        f"(default {DEFAULT_TEACHER_MODEL}); it must use the student's tokenizer")


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise SlimeConfigError(message)


def served_teacher(args):
    """The frozen served model (`args.served_models`) named `--opd-teacher-model`, or None."""
    return next((m for m in args.served_models if m.name == args.opd_teacher_model), None)


def _check_served_teacher(args) -> None:
    _require(args.opd_teacher_load is None,
             f"--opd-teacher-load is the teacher loaded in the trainer (--opd-type {args.train_backend}); with "
             f"--opd-type sglang the teacher is the served model --opd-teacher-model ({args.opd_teacher_model}): "
             "leave --opd-teacher-load out")
    if served_teacher(args) is not None:
        return
    policy = f"the policy ({args.policy_model_name})"
    if args.sglang_config is None:
        where = f"this run serves only {policy}: no --sglang-config"
    elif args.served_models:
        names = ", ".join(m.name for m in args.served_models)
        where = f"--sglang-config {args.sglang_config} serves {names} beside {policy}"
    else:
        where = f"--sglang-config {args.sglang_config} serves only {policy}"
    raise SlimeConfigError(f"--opd-teacher-model {args.opd_teacher_model}: --opd-type sglang needs a frozen served "
                           f"model of that name (update_weights: false); {where}; add the teacher to "
                           "--sglang-config (docs/served_models.md) or pass --opd-teacher-model NAME")


def validate_opd(args) -> None:
    """The OPD flags (see the module docstring); sets `args.opd_in_trainer` (the trainer loads and
    runs the teacher) and `args.opd_served` (a served teacher scores the rollouts)."""
    args.opd_in_trainer = args.opd_served = False
    if not args.use_opd:
        given = [f for f, v in (("--opd-type", args.opd_type), ("--opd-teacher-load", args.opd_teacher_load))
                 if v is not None]
        given += ["--opd-kl-coef"] if args.opd_kl_coef != 1.0 else []
        given += ["--opd-teacher-model"] if args.opd_teacher_model != DEFAULT_TEACHER_MODEL else []
        _require(not given, f"{given[0]} is an on-policy distillation flag: add --use-opd" if given else "")
        return
    _require(args.opd_type is not None,
             f"--use-opd needs --opd-type: {args.train_backend} (the teacher in the trainer, from "
             "--opd-teacher-load) or sglang (a served teacher, --opd-teacher-model)")
    if args.opd_type == SERVED_OPD_TYPE:
        _check_served_teacher(args)
    else:
        _require(args.opd_type == args.train_backend,
                 f"--opd-type {args.opd_type} loads the teacher in the {args.opd_type} trainer, but this run trains "
                 f"with --train-backend {args.train_backend}; use --opd-type {args.train_backend}")
        _require(args.opd_teacher_load is not None,
                 f"--opd-type {args.opd_type} needs --opd-teacher-load DIR (the teacher's Hugging Face model "
                 "directory)")
        _require(args.opd_teacher_model == DEFAULT_TEACHER_MODEL,
                 f"--opd-teacher-model names a served teacher (--opd-type sglang); with --opd-type {args.opd_type} "
                 "the teacher is --opd-teacher-load: leave --opd-teacher-model out")
    _require(args.opd_kl_coef > 0, f"--opd-kl-coef must be > 0 (the weight of the teacher's signal), got "
                                   f"{args.opd_kl_coef}")
    _require(args.loss_type != "sft_loss", "--use-opd with --loss-type sft_loss: distillation trains the policy "
                                           "loss on the student's rollouts; leave one of them out")
    args.opd_served = args.opd_type == SERVED_OPD_TYPE
    args.opd_in_trainer = not args.opd_served
