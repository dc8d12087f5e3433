"""Mixture-of-experts training flags (slime's names) and their start-up checks (docs/moe.md).

- `--use-rollout-routing-replay` (R3): every `/generate` asks the engine for the experts each token
  was routed to (SGLang's `return_routed_experts`; the native engine and SGLang serve it, vLLM does
  not), the sample keeps them, and the trainer's policy forwards use exactly those experts.
- `--use-routing-replay` (R2): the trainer's old-policy forward records its routing and the policy
  forwards of the same rollout replay it.
- `--moe-aux-loss-coeff C` (Megatron's name, in slime.script_flags): C x the routers' load-balancing
  loss joins the policy loss (both train backends: the same Hugging Face formula).

`validate_moe(args)` runs at parse time: each of them needs a mixture-of-experts `--hf-checkpoint`
(its config.json names a number of experts); one line for each bad combination.
"""

from __future__ import annotations

import json
from pathlib import Path

from slime.engines.kinds import KINDS, engine_kind
from slime.utils.errors import SlimeConfigError

EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def add_moe_flags(p) -> None:
    g = p.add_argument_group("mixture of experts (docs/moe.md)")
    g.add_argument("--use-rollout-routing-replay", action="store_true",
                   help="R3: the engines return the experts each token was routed to and the trainer's policy "
                        "forwards use exactly those (native engine or SGLang)")
    g.add_argument("--use-routing-replay", action="store_true",
                   help="R2: the trainer's old-policy forward records its routing and the policy forwards of the "
                        "rollout replay it")


def is_moe_checkpoint(path: str) -> bool:
    """Whether the Hugging Face config at `path` declares routed experts."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    config = {**config, **(config.get("text_config") or {})}
    return any(int(config.get(k) or 0) > 1 for k in EXPERT_COUNT_KEYS)


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise SlimeConfigError(message)


def validate_moe(args) -> None:
    _validate_moe_layout(args)
    given = [f for f, on in (("--use-rollout-routing-replay", args.use_rollout_routing_replay),
                             ("--use-routing-replay", args.use_routing_replay),
                             (f"--moe-aux-loss-coeff {args.moe_aux_loss_coeff}", bool(args.moe_aux_loss_coeff)))
             if on]
    if not given:
        return
    _require(is_moe_checkpoint(args.hf_checkpoint),
             f"{given[0]} needs a mixture-of-experts model; --hf-checkpoint {args.hf_checkpoint} declares no "
             f"experts ({', '.join(EXPERT_COUNT_KEYS)} in config.json)")
    _require(not (args.use_rollout_routing_replay and args.use_routing_replay),
             "--use-rollout-routing-replay and --use-routing-replay both decide the trainer's experts; give one")
    _require(args.moe_aux_loss_coeff >= 0, f"--moe-aux-loss-coeff must be >= 0, got {args.moe_aux_loss_coeff}")
    _require(args.recompute_granularity is None or not (args.use_rollout_routing_replay or args.use_routing_replay),
             f"{given[0]} with --recompute-granularity full: the recomputed layers would route again in "
             "backward; routing replay under activation recompute is not built")
    # megatron-core's recompute runs the layers' first forward without autograd (its reentrant
    # checkpoint), so the router logits slime records there would carry no gradient: the HF-formula
    # load-balancing loss would be logged but never train the routers
    _require(not (args.train_backend == "megatron" and args.recompute_granularity and args.moe_aux_loss_coeff),
             f"--moe-aux-loss-coeff {args.moe_aux_loss_coeff} with --recompute-granularity "
             f"{args.recompute_granularity} on --train-backend megatron: megatron's recompute records the router "
             "logits without gradients, so the load-balancing loss would not reach the routers; use "
             "--train-backend fsdp or drop one of them")
    if args.use_rollout_routing_replay:
        able = [k.name for k in KINDS.values() if k.returns_routed_experts]
        _require(engine_kind(args).returns_routed_experts,
                 f"--use-rollout-routing-replay: --rollout-backend {args.rollout_backend} does not return the "
                 f"routed experts; use {' or '.join(able)}")
        _require(args.loss_type != "sft_loss", "--use-rollout-routing-replay needs rollouts; --loss-type sft_loss "
                                               "has none")


def _validate_moe_layout(args) -> None:
    """Tensor parallelism for a mixture-of-experts model on the megatron backend needs sequence
    parallelism (megatron's MoE layers require it), one line."""
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    if args.train_backend != "megatron" or tp == 1 or not is_moe_checkpoint(args.hf_checkpoint):
        return
    _require(args.sequence_parallel, f"--tensor-model-parallel-size {tp} with a mixture-of-experts model needs "
                                     "--sequence-parallel (megatron-core's MoE layers train under tensor "
                                     "parallelism only with it)")
