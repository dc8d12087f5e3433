"""The rest of the flags slime's launch scripts carry: Megatron-LM training settings and slime features.

Nothing here is silently ignored. Each flag is one `ScriptFlag` with a rule run at start-up
(`check_script_flags`, from `slime.arguments.validate`), one of:

- it takes effect (the rule routes it: `--attention-backend` picks the FSDP model's attention
  implementation, `--make-vocab-size-divisible-by` pads the megatron backend's vocabulary, ...);
- it is checked: what it asks for is what this build does, or it is refused with one line
  (`--attention-dropout 0.1`: slime trains without dropout; `--calculate-per-token-loss` is
  `--loss-agg-mode token-mean`, the default);
- it needs hardware or a feature this build does not have: the run refuses at start-up with one line
  naming the flag and what is missing (fp8, Transformer Engine, on-policy distillation, ...).

Flags whose request holds by construction (fp32 gradient reduction, no kernel fusions to turn off)
are printed once at start-up with the reason (`stated`). The table of every flag, backend by
backend, is docs/coming_from_slime.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from slime.utils.flag_parsing import json_object

FSDP_ATTENTION = {"auto": "sdpa", "fused": "sdpa", "unfused": "eager", "local": "eager", "flash": "flash_attention_2"}


@dataclass(frozen=True)
class ScriptFlag:
    flag: str
    kwargs: dict = field(default_factory=dict)
    # rule(args, value, moe) -> an error line, or None; `moe`: the checkpoint is a mixture of experts
    rule: Callable | None = None
    stated: str = ""  # why the request holds by construction (printed at start-up when the flag is given)

    @property
    def dest(self) -> str:
        return self.kwargs.get("dest") or self.flag[2:].replace("-", "_")


def _switch(**kw):
    return dict(action="store_true", **kw)


def _refuse(what: str):
    return lambda args, value, moe: what


def _must_be(expected, why: str):
    return lambda args, value, moe: None if value == expected else why


def _needs(cond: Callable, why: str):
    return lambda args, value, moe: None if cond(args) else why


def _multimodal_keys(args, value, moe):
    """--multimodal-keys '{"image": COLUMN}': a vision-language checkpoint, chat prompts, a trainer that takes images."""
    if set(value) != {"image"} or not isinstance(value["image"], str) or not value["image"]:
        return f"must map \"image\" to the dataset column of the images, e.g. '{{\"image\": \"images\"}}', " \
               f"got {value!r}"
    if args.train_backend == "megatron":
        from slime.utils.vision import megatron_refusal  # deferred: slime.utils.vision imports torch and PIL

        why = megatron_refusal(args.pipeline_model_parallel_size, args.advantage_estimator == "ppo",
                               bool(getattr(args, "opd_teacher_load", None)))
        if why:
            return why
    if not args.apply_chat_template:
        return "needs --apply-chat-template (the chat template places the images in the prompt)"
    config = Path(args.hf_checkpoint or "") / "config.json"
    if config.is_file():
        cfg = json.loads(config.read_text())
        if not (cfg.get("vision_config") and cfg.get("image_token_id") is not None):
            return f"{args.hf_checkpoint} is a text-only model ({cfg.get('model_type')}); it takes no images"
    return None


def _megatron_only_refused(why: str):
    return lambda args, value, moe: why if args.train_backend == "megatron" else None


MOE_KERNEL = ("needs GPU kernels that slime's megatron MoE layers do not use (megatron's SequentialMLP experts, "
              "the all-to-all / all-gather token dispatcher); leave it out")


def _moe_flag(why_megatron: str | None = None):
    def rule(args, value, moe):
        if not moe:
            return "applies to mixture-of-experts models only, and the checkpoint has no experts"
        return why_megatron if args.train_backend == "megatron" else None
    return rule


def _attention_backend(args, value, moe):
    if args.train_backend == "megatron":
        if value in ("flash", "fused"):
            return ("needs Transformer Engine's attention; slime's megatron backend builds megatron's local layer "
                    "spec (unfused attention): use --attention-backend unfused or auto")
        return None
    if value == "flash":
        import torch  # here: this module is imported wherever `args` is unpickled

        if not torch.cuda.is_available() or importlib.util.find_spec("flash_attn") is None:
            return ("flash needs a CUDA device and the flash-attn package (pip install flash-attn); use "
                    "--attention-backend auto (PyTorch SDPA, which picks flash kernels on GPUs itself)")
    return None


def _fp8(args, value, moe):
    return "fp8 training needs Transformer Engine on Hopper-or-newer GPUs, which slime's trainers do not use"


def _dropout(args, value, moe):
    if value:
        return ("slime trains without dropout (the PPO ratio compares two passes of the same function); "
                "give 0.0")
    return None


def _expert_tensor_parallel(args, value, moe):
    """Megatron's default (not given) is the TP size; slime builds that and 1 (every expert whole on
    each TP rank), not an expert-TP group of another size."""
    tp = args.tensor_model_parallel_size
    if value is None or value in (1, tp):
        return None
    return (f"must be 1 (every expert whole on each tensor-parallel rank) or the --tensor-model-parallel-size {tp} "
            "(each expert split over the tensor-parallel group); other sizes are not built")


def _expert_parallel(args, value, moe):
    if value == 1:
        return None
    if not moe:
        return "expert parallelism needs a mixture-of-experts model, and the checkpoint has no experts"
    if args.dp_size % value:
        return f"must divide the {args.dp_size} train ranks"
    return None


FLAGS: tuple[ScriptFlag, ...] = (
    # parallel layout (--tensor/pipeline/context-model-parallel-size and --sequence-parallel: slime.arguments)
    ScriptFlag("--expert-model-parallel-size", dict(type=int, default=1), _expert_parallel),
    ScriptFlag("--expert-tensor-parallel-size", dict(type=int, default=None), _expert_tensor_parallel),
    ScriptFlag("--virtual-pipeline-model-parallel-size", dict(type=int, default=None),
               _needs(lambda a: a.pipeline_model_parallel_size > 1, "needs --pipeline-model-parallel-size > 1")),
    ScriptFlag("--num-layers-per-virtual-pipeline-stage", dict(type=int, default=None),
               _needs(lambda a: a.pipeline_model_parallel_size > 1, "needs --pipeline-model-parallel-size > 1")),
    ScriptFlag("--decoder-first-pipeline-num-layers", dict(type=int, default=None),
               _needs(lambda a: a.pipeline_model_parallel_size > 1, "needs --pipeline-model-parallel-size > 1")),
    ScriptFlag("--decoder-last-pipeline-num-layers", dict(type=int, default=None),
               _needs(lambda a: a.pipeline_model_parallel_size > 1, "needs --pipeline-model-parallel-size > 1")),
    ScriptFlag("--allgather-cp", _switch(),
               _needs(lambda a: a.context_parallel_size > 1, "needs --context-parallel-size > 1")),
    # precision and numerics
    ScriptFlag("--accumulate-allreduce-grads-in-fp32", _switch(),
               stated="gradients are accumulated and reduced in fp32 by both backends (with --bf16 too)"),
    ScriptFlag("--attention-softmax-in-fp32", _switch(),
               stated="the attention softmax runs in fp32 (PyTorch SDPA / eager attention accumulate in fp32)"),
    ScriptFlag("--attention-dropout", dict(type=float, default=0.0), _dropout),
    ScriptFlag("--hidden-dropout", dict(type=float, default=0.0), _dropout),
    ScriptFlag("--attention-backend", dict(choices=tuple(FSDP_ATTENTION), default="auto"), _attention_backend),
    ScriptFlag("--transformer-impl", dict(choices=("local", "transformer_engine"), default="local"),
               _must_be("local", "Transformer Engine is not used by slime's trainers; give local (or leave it out)")),
    ScriptFlag("--no-masked-softmax-fusion", _switch(), stated="neither backend fuses the masked softmax"),
    ScriptFlag("--no-rope-fusion", _switch(), stated="neither backend fuses RoPE"),
    ScriptFlag("--no-gradient-accumulation-fusion", _switch(), stated="neither backend fuses gradient accumulation"),
    ScriptFlag("--no-check-for-nan-in-loss-and-grad", _switch(),
               stated="slime never applies a step whose gradient norm is not finite: it skips it with a warning"),
    ScriptFlag("--calculate-per-token-loss", _switch(),
               _needs(lambda a: a.loss_agg_mode == "token-mean",
                      "is --loss-agg-mode token-mean (every token of the step weighs the same), which contradicts "
                      "the --loss-agg-mode given")),
    ScriptFlag("--fp8-format", dict(choices=("e4m3", "hybrid"), default=None), _fp8),
    ScriptFlag("--fp8-recipe", dict(default=None), _fp8),
    ScriptFlag("--make-vocab-size-divisible-by", dict(type=int, default=128),
               lambda a, v, moe: None if v >= 1 else "must be >= 1"),
    ScriptFlag("--data-pad-size-multiplier", dict(type=int, default=128),
               lambda a, v, moe: None if v >= 1 else "must be >= 1",
               stated="slime packs samples without padding (nothing to round up; the numbers are the same)"),
    # optimizer
    ScriptFlag("--optimizer", dict(choices=("adam", "sgd"), default="adam"),
               _must_be("adam", "only adam (torch AdamW with --adam-beta1/2, --adam-eps, --weight-decay) is built")),
    ScriptFlag("--use-distributed-optimizer", _switch(),
               stated="with fsdp the optimizer state is sharded over the train ranks; with megatron each "
                      "data-parallel rank keeps and updates its share of the AdamW state (ZeRO-1)"),
    ScriptFlag("--use-precision-aware-optimizer", _switch(),
               _refuse("megatron's precision-aware optimizer (low-precision main weights and moments, Transformer "
                       "Engine FusedAdam) is not built; slime keeps fp32 master weights")),
    ScriptFlag("--overlap-cpu-optimizer-d2h-h2d", _switch(),
               _needs(lambda a: a.optimizer_cpu_offload, "needs --optimizer-cpu-offload"),
               stated="FSDP2's CPU offload overlaps its copies with compute"),
    # mixture of experts: routing and kernels (the architecture flags are in slime.model_flags)
    ScriptFlag("--moe-grouped-gemm", _switch(), _moe_flag(MOE_KERNEL),
               stated="the Hugging Face MoE block computes every expert; the numbers do not depend on the kernel"),
    ScriptFlag("--moe-permute-fusion", _switch(), _moe_flag(MOE_KERNEL),
               stated="a kernel choice of megatron's MoE layer"),
    ScriptFlag("--moe-enable-deepep", _switch(), _moe_flag(MOE_KERNEL),
               stated="a dispatch kernel of megatron's MoE layer"),
    ScriptFlag("--moe-token-dispatcher-type", dict(choices=("allgather", "alltoall", "flex"), default=None),
               lambda a, v, moe: _moe_flag()(a, v, moe) or (MOE_KERNEL if v == "flex" and a.train_backend == "megatron"
                                                              else None),
               stated="a dispatch scheme, not a change of the numbers (the megatron backend dispatches all-to-all "
                      "under expert parallelism, all-gather without; FSDP shards whole experts)"),
    ScriptFlag("--moe-token-drop-policy", dict(choices=("probs", "position"), default=None), _moe_flag(),
               stated="routing is dropless (no capacity factor), so no token is dropped"),
    ScriptFlag("--moe-router-dtype", dict(choices=("fp32", "fp64"), default=None),
               lambda a, v, moe: _moe_flag()(a, v, moe) or (None if v == "fp32" else
                                                              "the Hugging Face routers compute in fp32"),
               stated="the routers compute their scores in fp32"),
    # the load-balancing loss of the Hugging Face routers (fsdp; checked with the MoE flags, slime.moe_flags)
    ScriptFlag("--moe-aux-loss-coeff", dict(type=float, default=0.0)),
    ScriptFlag("--moe-router-load-balancing-type", dict(choices=("aux_loss", "seq_aux_loss", "sinkhorn", "none"),
                                                        default=None),
               lambda a, v, moe: None if v in ("none", "aux_loss", None) or not a.moe_aux_loss_coeff else
               "only the Switch load-balancing loss (aux_loss, the Hugging Face routers' own) is built"),
    ScriptFlag("--moe-router-bias-update-rate", dict(type=float, default=0.0),
               lambda a, v, moe: None if not v else
               "updating the expert bias during training is not built; give 0 (the bias stays as loaded)"),
    ScriptFlag("--enable-mtp-training", _switch(),
               _refuse("multi-token-prediction training is not built (the MTP layers are not loaded)")),
    ScriptFlag("--mtp-loss-scaling-factor", dict(type=float, default=None),
               _needs(lambda a: a.enable_mtp_training, "needs --enable-mtp-training")),
    ScriptFlag("--enable-experimental", _switch(),
               _refuse("megatron's experimental features are not part of slime's trainers")),
    # slime features built elsewhere in this project's plan, or not at all
    ScriptFlag("--deterministic-mode", _switch(),
               _megatron_only_refused("deterministic trainer reductions are built for --train-backend fsdp only"),
               stated="batch-invariant engine numerics and deterministic trainer algorithms: the same --seed gives "
                      "bitwise-identical rollouts, log-probs and metrics (docs/reproducibility.md)"),
    ScriptFlag("--multimodal-keys", dict(type=json_object, default=None, metavar="JSON"), _multimodal_keys,
               stated="images in prompts for Qwen2-VL / Qwen2.5-VL models (docs/vlm.md)"),
    ScriptFlag("--loss-mask-type", dict(choices=("qwen", "qwen3", "qwen3_5", "distill_qwen"), default=None),
               stated="slime derives loss masks from the tokenizer's own chat template, for every model family"),
    ScriptFlag("--prefill-num-servers", dict(type=int, default=None),
               _refuse("prefill/decode disaggregated engines are not built")),
    ScriptFlag("--disable-compute-advantages-and-returns", dict(action="store_false",
                                                                dest="compute_advantages_and_returns"),
               _needs(lambda a: a.loss_type == "sft_loss", "is for --loss-type sft_loss (the other losses "
                                                           "need advantages)"),
               stated="sft_loss uses no advantages"),
    *(ScriptFlag(f"--update-weight-{name}", dict(default=None),
                 _refuse("delta weight updates through a shared disk are not built; slime pushes full weights "
                         "(--update-weights-mode)"))
      for name in ("mode", "transport", "disk-dir", "local-checkpoint-dir", "delta-encoding", "delta-checksum")),
)


def add_script_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("Megatron-LM and slime script flags (checked, routed or refused at start-up; "
                                  "docs/coming_from_slime.md)")
    for f in FLAGS:
        g.add_argument(f.flag, **f.kwargs)


def _given(f: ScriptFlag, args) -> bool:
    value = getattr(args, f.dest)
    if f.kwargs.get("action") == "store_false":
        return value is False
    return value not in (None, False) and value != f.kwargs.get("default")


def given_flags(args) -> list[ScriptFlag]:
    """The script flags given a value other than their default."""
    return [f for f in FLAGS if _given(f, args)]


def check_script_flags(args, moe: bool) -> tuple[list[str], list[str]]:
    """(refusal lines, notes) of the flags given: each line names its flag; the notes say why a `stated`
    flag's request holds (the driver prints them at start-up)."""
    errors, stated = [], []
    for f in given_flags(args):
        value = getattr(args, f.dest)
        why = f.rule(args, value, moe) if f.rule else None
        shown = "" if isinstance(value, bool) else f" {value}"
        if why:
            errors.append(f"{f.flag}{shown}: {why}")
        elif f.stated:
            stated.append(f"{f.flag}: {f.stated}")
    return errors, stated


def attention_implementation(args) -> str:
    """The Hugging Face attention implementation of the fsdp backend's models."""
    return FSDP_ATTENTION[args.attention_backend]
