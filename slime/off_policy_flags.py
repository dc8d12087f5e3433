"""Off-policy correction flags and their start-up checks (docs/algorithms.md, "Off-policy
corrections"); original slime's names where it has them.

- `--tis-mode truncate|mask|clip`, `--tis-veto-threshold` (with `--use-tis`): the built-in TIS
  function `slime.algorithms.off_policy.off_policy_tis`;
- `--use-opsm`, `--opsm-delta`: Off-Policy Sequence Masking (`opsm_mask`);
- `--top-entropy-token-fraction F`: only the highest-entropy F of each micro-batch's loss tokens
  keep their policy loss (`top_entropy_mask`);
- `--policy-loss-type ppo|gspo|cispo|sapo` (default: the estimator's, as before), `--sapo-tau-pos`,
  `--sapo-tau-neg`: the per-token policy loss (`policy_loss_for`);
- `--freeze-params-name-list PATTERN ...`: parameters whose name matches a regex (re.search) never
  train (`slime.training.freeze.freeze_parameters`);
- `--ref-update-interval N`: the KL reference becomes the current policy after every N rollouts
  (`slime.training.freeze.ref_update_due`, `copy_policy_into_reference`).

`validate_off_policy(args)` runs at parse time after the algorithm, batch and LoRA checks (it reads
`args.num_steps_per_rollout`, `args.loss_type`, `args.lora`) and gives one line for each bad
value or combination, naming the flag. It resolves `args.policy_loss_type` when it is still None.
"""

from __future__ import annotations

import re

import torch

from slime.algorithms.losses import POLICY_LOSSES
from slime.algorithms.off_policy import POLICY_LOSS_TYPES, SAPO_TAU_NEG, SAPO_TAU_POS, TIS_MODES
from slime.utils.errors import SlimeConfigError
from slime.utils.vision import is_vision_config

OPSM_DELTA = 1e-4  # original slime's default


def add_off_policy_flags(p) -> None:
    g = p.add_argument_group("off-policy corrections (docs/algorithms.md)")
    g.add_argument("--tis-mode", choices=TIS_MODES, default="truncate",
                   help="with --use-tis: truncate (weight clamp(r, --tis-clip-low, --tis-clip)), mask (IcePop/MIS: "
                        "tokens, or with --tis-level sequence|geometric whole sequences, whose ratio leaves "
                        "[--tis-clip-low, --tis-clip] are dropped from the policy loss; the others keep weight r), "
                        "clip (clamp to [--tis-clip-low > 0, --tis-clip])")
    g.add_argument("--tis-veto-threshold", type=float, default=None,
                   help="with --use-tis: a sequence with any loss token whose ratio pi_train_old / pi_rollout is "
                        "below this (e.g. 1e-4) is dropped from the policy loss (original slime's rs_veto_threshold)")
    g.add_argument("--use-opsm", action="store_true",
                   help="Off-Policy Sequence Masking (DeepSeek-V3.2): drop the policy loss of negative-advantage "
                        "tokens of sequences whose KL(pi_old || pi) exceeds --opsm-delta")
    g.add_argument("--opsm-delta", type=float, default=None,
                   help=f"the OPSM threshold on the sequence's mean log(pi_old / pi) (default {OPSM_DELTA})")
    g.add_argument("--top-entropy-token-fraction", type=float, default=1.0,
                   help="only this fraction (0, 1] of each micro-batch's loss tokens, those of highest entropy, keep "
                        "their policy loss (Wang et al. 2025, high-entropy minority tokens: 0.2); 1 keeps all")
    g.add_argument("--policy-loss-type", choices=POLICY_LOSS_TYPES, default=None,
                   help="the per-token policy loss (default: the estimator's: gspo, cispo, else ppo); sapo: Soft "
                        "Adaptive Policy Optimization's smooth gate instead of the clip (--sapo-tau-pos/-neg)")
    g.add_argument("--sapo-tau-pos", type=float, default=SAPO_TAU_POS,
                   help="SAPO temperature of positive-advantage tokens (larger: the gate decays faster)")
    g.add_argument("--sapo-tau-neg", type=float, default=SAPO_TAU_NEG,
                   help="SAPO temperature of the other tokens")
    g.add_argument("--freeze-params-name-list", nargs="+", default=None, metavar="PATTERN",
                   help="regexes (re.search) on the trainer's parameter names (Hugging Face names on fsdp, "
                        "megatron-core names on megatron); matching parameters never train")
    g.add_argument("--ref-update-interval", type=int, default=None,
                   help="after every N rollouts the KL reference model becomes a copy of the current policy "
                        "(needs --use-kl-loss --kl-loss-coef > 0 or --kl-coef > 0)")


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise SlimeConfigError(message)


def _compiled(patterns: list[str], flag: str) -> list[re.Pattern]:
    out = []
    for pat in patterns:
        try:
            out.append(re.compile(pat))
        except re.error as e:
            raise SlimeConfigError(f"{flag} {pat!r}: not a regular expression ({e})") from None
    return out


def matching_names(names: list[str], patterns: list[str], flag: str = "--freeze-params-name-list") -> list[str]:
    """The names any pattern matches (re.search), in `names`' order. An invalid regex, or one that
    matches no name, is a SlimeConfigError naming it (and a few of the names it was tried on)."""
    compiled = _compiled(patterns, flag)
    for pat, rx in zip(patterns, compiled):
        if not any(rx.search(n) for n in names):
            sample = ", ".join(names[:3] + (["...", names[-1]] if len(names) > 3 else []))
            raise SlimeConfigError(f"{flag} {pat!r} matches no parameter; the names look like {sample} "
                                   "(tied weights are listed once)")
    return [n for n in names if any(rx.search(n) for rx in compiled)]


def _hf_parameter_names(hf_checkpoint: str) -> list[str]:
    """The checkpoint's causal LM parameter names, from a model on the meta device (no memory)."""
    # imported here: the Auto model classes pull transformers' modeling code (~1 s), which the
    # driver parsing flags without a parameter pattern never needs
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    with torch.device("meta"):
        config = AutoConfig.from_pretrained(hf_checkpoint)
        cls = AutoModelForImageTextToText if is_vision_config(config) else AutoModelForCausalLM
        model = cls.from_config(config)
    return [n for n, _ in model.named_parameters()]


def _default_policy_loss(args) -> str:
    """The estimator's policy loss (argument_checks.POLICY_LOSS_OF_ESTIMATOR: an estimator named like a loss)."""
    return args.advantage_estimator if args.advantage_estimator in POLICY_LOSSES else "ppo"


def validate_off_policy(args) -> None:
    """The off-policy flags (see the module docstring)."""
    _validate_tis(args)
    _validate_opsm(args)
    _validate_policy_loss(args)
    f = args.top_entropy_token_fraction
    _require(0 < f <= 1, f"--top-entropy-token-fraction must be in (0, 1] (1 keeps every token), got {f}")
    _require(f == 1 or args.loss_type != "sft_loss",
             "--top-entropy-token-fraction masks the policy loss, which --loss-type sft_loss does not train")
    _validate_freeze(args)
    _validate_ref_update(args)


def _validate_tis(args) -> None:
    if not args.use_tis:
        given = [flag for flag, on in (("--tis-mode", args.tis_mode != "truncate"),
                                       ("--tis-veto-threshold", args.tis_veto_threshold is not None)) if on]
        _require(not given, f"{given[0]} is a TIS flag: add --use-tis" if given else "")
        return
    custom = args.custom_tis_function_path
    for flag, on in (("--tis-mode", args.tis_mode != "truncate"), ("--tis-veto-threshold",
                                                                   args.tis_veto_threshold is not None)):
        _require(not (on and custom), f"{flag} configures the built-in TIS, which --custom-tis-function-path "
                                      f"{custom} replaces; leave one out")
    _require(args.tis_mode != "clip" or args.tis_clip_low > 0,
             "--tis-mode clip clamps both sides: give --tis-clip-low > 0 (e.g. 1 / --tis-clip); with a lower "
             "bound of 0 it is --tis-mode truncate")
    _require(args.tis_mode == "truncate" or args.tis_clip_low <= 1 <= args.tis_clip,
             f"--tis-mode {args.tis_mode} needs --tis-clip-low <= 1 <= --tis-clip (an on-policy token, ratio 1, "
             f"keeps weight 1), got [{args.tis_clip_low}, {args.tis_clip}]")
    v = args.tis_veto_threshold
    _require(v is None or 0 < v < 1, f"--tis-veto-threshold must be in (0, 1) (a ratio far below 1, e.g. 1e-4), "
                                     f"got {v}")


def _validate_opsm(args) -> None:
    if not args.use_opsm:
        _require(args.opsm_delta is None, "--opsm-delta is an Off-Policy Sequence Masking flag: add --use-opsm")
        return
    if args.opsm_delta is None:
        args.opsm_delta = OPSM_DELTA
    _require(args.opsm_delta >= 0, f"--opsm-delta must be >= 0 (a KL threshold), got {args.opsm_delta}")
    _require(args.loss_type != "sft_loss", "--use-opsm masks the policy loss, which --loss-type sft_loss does not "
                                           "train")
    _require(args.num_steps_per_rollout > 1 or args.use_tis or args.use_rollout_logprobs,
             "--use-opsm: with one optimizer step per rollout and no engine log-probs the old policy is the "
             "current one (KL 0, nothing is ever masked); add --use-tis or --use-rollout-logprobs (the engine's "
             "log-probs as pi_old, as DeepSeek-V3.2) or train several steps per rollout")


def _validate_policy_loss(args) -> None:
    default = _default_policy_loss(args)
    if args.policy_loss_type is None:
        args.policy_loss_type = default
    chosen = args.policy_loss_type
    if chosen != default:
        _require(args.advantage_estimator not in POLICY_LOSSES,
                 f"--policy-loss-type {chosen} with --advantage-estimator {args.advantage_estimator}: that estimator "
                 f"is GRPO with the {args.advantage_estimator} loss; use --advantage-estimator grpo --policy-loss-type "
                 f"{chosen}")
        _require(args.loss_type == "policy_loss",
                 f"--policy-loss-type {chosen} has no effect with --loss-type {args.loss_type}")
    _require(chosen != "sapo" or args.eps_clip_c is None,
             "--eps-clip-c is PPO's dual clip; --policy-loss-type sapo has no clip (its gate is --sapo-tau-pos/-neg)")
    for flag, value, default_tau in (("--sapo-tau-pos", args.sapo_tau_pos, SAPO_TAU_POS),
                                     ("--sapo-tau-neg", args.sapo_tau_neg, SAPO_TAU_NEG)):
        _require(value > 0, f"{flag} must be > 0 (a temperature), got {value}")
        _require(chosen == "sapo" or value == default_tau, f"{flag} is a SAPO flag: add --policy-loss-type sapo")


def _validate_freeze(args) -> None:
    patterns = args.freeze_params_name_list
    if patterns is None:
        return
    _require(not args.lora, "--freeze-params-name-list with LoRA: LoRA already trains only the adapters (choose "
                            "them with --target-modules); leave one out")
    if args.train_backend != "fsdp":  # megatron-core names: matched when the model is built
        _compiled(patterns, "--freeze-params-name-list")
        return
    names = _hf_parameter_names(args.hf_checkpoint)
    _require(len(matching_names(names, patterns)) < len(names),
             "--freeze-params-name-list matches every parameter: nothing would train")


def _validate_ref_update(args) -> None:
    n = args.ref_update_interval
    if n is None:
        return
    _require(n >= 1, f"--ref-update-interval must be >= 1 (rollouts), got {n}")
    _require((args.use_kl_loss and args.kl_loss_coef > 0) or args.kl_coef > 0,
             "--ref-update-interval updates the KL reference model, which this run does not have: add "
             "--use-kl-loss --kl-loss-coef C (or --kl-coef C)")
    _require(not args.lora, "--ref-update-interval with LoRA: the reference is the base with the adapter switched off "
                            "(no second model to update); leave --ref-update-interval out")
