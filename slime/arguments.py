"""One parser for every slime flag, validated once and read-only afterwards.

Flag names follow the original slime (Megatron-style training names, `--rollout-*`
for generation, `--sglang-*` passed through to the engines). `parse_args` returns a
frozen `Args`; every derived value (data-parallel size, number of engines, steps per
rollout, output directory, ...) is computed in `validate`, nowhere else; the checks of
the engine, custom-rollout, async, algorithm, batching, megatron and debug flag groups it
runs live in `slime.argument_checks`.

Errors are `SlimeConfigError`s whose message names the flag; `main`-style callers
print them as one line (see `slime.utils.errors.run_main`).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import secrets
import sys
from pathlib import Path

from slime import config_file
from slime.argument_checks import (  # noqa: F401 (POLICY_LOSS_OF_ESTIMATOR: re-exported)
    POLICY_LOSS_OF_ESTIMATOR,
    check_checkpoint_dirs,
    check_frozen_model,
    check_opd_teacher,
    check_prompt_data,
    require,
    validate_algorithm,
    validate_async,
    validate_batching,
    validate_custom_rollout,
    validate_debug,
    validate_engines,
    validate_lr_schedule,
    validate_megatron,
    validate_recompute,
    validate_script_flags,
    validate_served_models,
)
from slime.data.dataset import count_rows, split_slice
from slime.engines.auth import env_api_key
from slime.engines.kinds import KINDS, UPDATE_WEIGHTS_MODES, engine_kind
from slime.eval_flags import add_eval_flags, validate_eval
from slime.lora_flags import add_lora_flags, validate_lora
from slime.mcp_flags import add_mcp_flags, validate_mcp
from slime.moe_flags import add_moe_flags, validate_moe
from slime.off_policy_flags import add_off_policy_flags, validate_off_policy
from slime.profile_flags import add_profile_flags, validate_profile
from slime.opd_flags import add_opd_flags, validate_opd
from slime.environment_flags import add_environment_flags, validate_environment
from slime.reward_flags import add_judge_flags, add_reward_flags, validate_judge
from slime.model_flags import add_model_flags
from slime.script_flags import add_script_flags
from slime.utils.args_namespace import Args  # noqa: F401 (the namespace parse_args returns)
from slime.utils.errors import SlimeConfigError
from slime.utils.flag_parsing import check_unknown_flags, collect_pass_through, json_object
from slime.utils.reward_names import UNAVAILABLE_RM_TYPES, unavailable_message
from slime.utils.slime_paths import check_args as check_slime_paths

SGLANG_PREFIX = "--sglang-"
VLLM_PREFIX = "--vllm-"
PASS_THROUGH_PREFIXES = (SGLANG_PREFIX, VLLM_PREFIX)
KL_LOSS_TYPES = ("k1", "k2", "k3", "low_var_kl")
ADVANTAGE_ESTIMATORS = ("grpo", "gspo", "cispo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "rloo", "ppo")
LOSS_TYPES = ("policy_loss", "sft_loss", "custom_loss")
TIS_LEVELS = ("token", "sequence", "geometric")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one clear line, no usage dump
        raise SlimeConfigError(message)


def _size(text: str) -> int:
    """Parse a byte size such as `512MB`, `1GiB` or `1048576`."""
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
    t = text.strip().lower()
    num = t.rstrip("kmgib")
    unit = t[len(num) :]
    if unit not in units:
        raise argparse.ArgumentTypeError(f"invalid size {text!r} (use e.g. 512MB or 1GiB)")
    try:
        return int(float(num) * units[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid size {text!r} (use e.g. 512MB or 1GiB)") from None


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="train.py", description="slime: RL post-training of LLMs.", allow_abbrev=False)

    g = p.add_argument_group("cluster")
    g.add_argument("--actor-num-nodes", type=int, default=1)
    g.add_argument("--actor-num-gpus-per-node", type=int, default=1,
                   help="train ranks per node; on a machine without CUDA each counts as one process (gloo)")
    g.add_argument("--rollout-num-gpus", type=int, default=None,
                   help="devices for rollout engines in total (default: the actor's when --colocate, else 1)")
    g.add_argument("--rollout-num-gpus-per-engine", type=int, default=1)
    g.add_argument("--colocate", action="store_true",
                   help="place engines on the same devices (placement bundles) as the train ranks")
    g.add_argument("--train-backend", choices=("fsdp", "megatron"), default="fsdp",
                   help="fsdp: FSDP2 over Hugging Face models; megatron: megatron-core (optional extra)")

    g = p.add_argument_group("megatron (--train-backend megatron; docs/megatron.md)")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1,
                   help="megatron tensor parallelism: ranks each layer's weights are split over")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                   help="megatron pipeline parallelism (not supported by slime's megatron backend yet: must be 1)")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="megatron context parallelism (needs Transformer Engine on GPUs; must be 1 here)")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="megatron sequence parallelism within the tensor-parallel group (not supported yet)")

    g = p.add_argument_group("checkpoints")
    g.add_argument("--hf-checkpoint", required=True, help="Hugging Face model directory (weights, config, tokenizer)")
    g.add_argument("--load", default=None,
                   help="checkpoint directory to resume from (written by --save); empty: start fresh; it must "
                        "exist unless it is the --save directory")
    g.add_argument("--save", default=None, help="checkpoint directory")
    g.add_argument("--save-keep-last", type=int, default=None,
                   help="keep only the newest N checkpoints in --save (default: all)")
    g.add_argument("--overwrite-checkpoints", action="store_true",
                   help="let a run save into a --save directory whose checkpoints are as new as or newer "
                        "than its own (another run's), instead of refusing to start")
    g.add_argument("--ref-load", default=None,
                   help="Hugging Face model directory of the KL reference model (default: --hf-checkpoint); same "
                        "vocabulary as the policy")
    g.add_argument("--save-interval", type=int, default=None, help="save every N rollouts (and after the last)")

    g = p.add_argument_group("data")
    g.add_argument("--prompt-data", default=None, help="JSONL or Parquet file of prompts")
    g.add_argument("--input-key", default="input")
    g.add_argument("--label-key", default=None)
    g.add_argument("--metadata-key", default="metadata")
    g.add_argument("--apply-chat-template", action="store_true")
    g.add_argument("--apply-chat-template-kwargs", type=json_object, default=None, metavar="JSON",
                   help='a JSON object of keyword arguments for the chat template, e.g. \'{"enable_thinking": false}\'')
    g.add_argument("--tool-key", default=None,
                   help="row field with a list of tool schemas for the chat template (kept in metadata['tools'])")
    g.add_argument("--rollout-shuffle", action="store_true")
    g.add_argument("--rollout-seed", type=int, default=42)
    g.add_argument("--num-rollout", type=int, default=None)
    g.add_argument("--num-epoch", type=int, default=None,
                   help="derive --num-rollout from passes over the prompt data")

    g = p.add_argument_group("rollout")
    g.add_argument("--rollout-batch-size", type=int, required=True, help="prompts per rollout")
    g.add_argument("--n-samples-per-prompt", type=int, default=1)
    g.add_argument("--rollout-temperature", type=float, default=1.0)
    g.add_argument("--rollout-top-p", type=float, default=1.0)
    g.add_argument("--rollout-top-k", type=int, default=-1)
    g.add_argument("--rollout-max-response-len", type=int, default=1024)
    g.add_argument("--rollout-max-context-len", type=int, default=None,
                   help="most tokens of prompt + response: each request's max_new_tokens is cut to fit")
    g.add_argument("--rollout-max-prompt-len", type=int, default=None,
                   help="prompts longer than this (in tokens) are dropped, with a counted warning")
    g.add_argument("--rollout-stop", nargs="+", default=None, help="stop strings")
    g.add_argument("--rollout-stop-token-ids", nargs="+", type=int, default=None)
    add_reward_flags(g)  # --rm-type, --rm-*, --reward-*: slime.reward_flags
    g.add_argument("--rollout-request-timeout", type=float, default=600.0,
                   help="seconds one /generate call may take before it is an error")
    g.add_argument("--engine-startup-timeout", type=float, default=300.0)
    g.add_argument("--stage-timeout", type=float, default=3600.0,
                   help="seconds any one stage (a rollout, a train step, a weight sync, a save) may take "
                        "before the run stops with an error naming the stage and the actor")

    g = p.add_argument_group("custom rollout (signatures: docs/custom_rollout.md)")
    g.add_argument("--rollout-function-path", default=None,
                   help="replaces the whole rollout: fn(args, rollout_id, data_source, evaluation=False) -> groups")
    g.add_argument("--custom-generate-function-path", default=None,
                   help="async fn(args, sample, sampling_params) -> Sample or [Sample, ...] (multi-turn, tools)")
    g.add_argument("--custom-rm-path", default=None,
                   help="reward: [async] fn(args, sample) -> float | dict, or fn(args, samples) with --group-rm")
    g.add_argument("--group-rm", action="store_true", help="the reward function scores a whole group at once")
    g.add_argument("--data-source-path", default=None,
                   help="a class cls(args) with get_samples/add_samples/state_dict/load_state_dict")
    g.add_argument("--buffer-filter-path", default=None,
                   help="fn(args, buffer, num_groups) -> the groups to take from the data buffer")
    g.add_argument("--rollout-sample-filter-path", default=None,
                   help="fn(args, groups) -> None; sets sample.remove_sample to keep a sample out of the loss")
    g.add_argument("--eval-function-path", default=None,
                   help="replaces evaluation: [async] fn(args, rollout_id) -> {metric: value}")
    g.add_argument("--custom-config-path", default=None,
                   help="a YAML file of parameters for custom code; each key becomes an attribute of args")
    g.add_argument("--max-turns", type=int, default=8,
                   help="most model turns of a multi-turn episode (slime.rollout.multiturn)")

    g = p.add_argument_group("asynchronous training (train_async.py)")
    g.add_argument("--update-weights-interval", type=int, default=1,
                   help="push weights to the engines every N rollouts (train_async.py)")
    g.add_argument("--partial-rollout", action="store_true",
                   help="with over-sampling: groups still generating when enough are done are aborted and "
                        "continue in the next rollout instead of being thrown away")
    g.add_argument("--mask-offpolicy-in-partial-rollout", action="store_true",
                   help="a resumed partial response trains only on the tokens generated after it resumed")
    g.add_argument("--max-staleness", type=int, default=None,
                   help="most policy versions a sample's oldest token may lag the trainer; older partial "
                        "samples are regenerated, older finished groups dropped")
    g.add_argument("--fully-async", action="store_true",
                   help="train_async.py: a background loop keeps --async-groups-in-flight groups generating "
                        "across rollout boundaries; weights change under requests in flight (paused, updated, "
                        "continued)")
    g.add_argument("--async-groups-in-flight", type=int, default=None,
                   help="groups kept generating by --fully-async (default: --over-sampling-batch-size)")

    g = p.add_argument_group("engines")
    g.add_argument("--rollout-backend", choices=tuple(KINDS), default="native",
                   help="native: the embedded PyTorch engine; sglang: sglang.launch_server (--sglang-* "
                        "forwarded); vllm: vLLM's OpenAI server behind slime's adapter (--vllm-* forwarded)")
    g.add_argument("--sglang-server-concurrency", type=int, default=512,
                   help="most requests in flight to one engine")
    g.add_argument("--engine-api-key", default=None,
                   help="the secret every engine, adapter and router of the run requires (Authorization: Bearer "
                        "KEY); default: $SLIME_ENGINE_API_KEY, else a new random key per run; custom code reads it "
                        "as context().api_key")
    g.add_argument("--sglang-config", default=None, metavar="YAML",
                   help="serve several models, each with its own engines and router (slime's YAML: the policy and "
                        "frozen models such as a teacher or a judge; docs/served_models.md)")
    g.add_argument("--sglang-router-ip", default=None,
                   help="use this already running router instead of starting one")
    g.add_argument("--sglang-router-port", type=int, default=None)
    g.add_argument("--use-fault-tolerance", action="store_true",
                   help="health-check engines during rollout; restart a dead or silent one, give it the "
                        "current weights and retry its requests")
    g.add_argument("--rollout-health-check-interval", type=float, default=5.0,
                   help="seconds between engine health checks (--use-fault-tolerance)")
    g.add_argument("--rollout-health-check-timeout", type=float, default=10.0,
                   help="an engine that does not answer /health within this many seconds is restarted")

    g = p.add_argument_group("training")
    g.add_argument("--global-batch-size", type=int, default=None, help="samples per optimizer step")
    g.add_argument("--num-steps-per-rollout", type=int, default=None)
    g.add_argument("--micro-batch-size", type=int, default=1, help="samples per forward/backward on one rank")
    g.add_argument("--use-dynamic-batch-size", action="store_true",
                   help="micro-batches hold up to --max-tokens-per-gpu tokens instead of --micro-batch-size samples")
    g.add_argument("--max-tokens-per-gpu", type=int, default=None,
                   help="token budget of one micro-batch with --use-dynamic-batch-size")
    g.add_argument("--balance-data", action="store_true",
                   help="balance tokens across data-parallel ranks within each optimizer step")
    g.add_argument("--disable-sequence-packing", action="store_true",
                   help="train on padded [batch, max_len] micro-batches instead of packing each micro-batch's "
                        "samples into one row without padding (the default, exact)")
    g.add_argument("--recompute-granularity", choices=("full", "selective"), default=None,
                   help="activation recompute: full: each decoder layer keeps only its input and runs again in "
                        "backward; selective (megatron only): the core attention")
    g.add_argument("--gradient-checkpointing", dest="recompute_granularity", action="store_const", const="full",
                   help="the same as --recompute-granularity full")
    g.add_argument("--recompute-method", choices=("uniform", "block"), default=None,
                   help="with full: uniform (every layer; megatron: in groups of --recompute-num-layers) or block "
                        "(only the first --recompute-num-layers layers)")
    g.add_argument("--recompute-num-layers", type=int, default=None,
                   help="layers per recomputed group (uniform) or recomputed layers (block); default 1 / all")
    g.add_argument("--bf16", action="store_true",
                   help="mixed precision: bf16 compute, fp32 master weights and optimizer, gradients reduced in fp32 "
                        "(FSDP2's MixedPrecisionPolicy; megatron: bf16 parameters with fp32 main copies); the engines "
                        "serve bf16 unless their --*-dtype says otherwise")
    g.add_argument("--fp16", action="store_true", help="refused: fp16 training needs loss scaling; use --bf16")
    g.add_argument("--optimizer-cpu-offload", action="store_true",
                   help="keep the parameters' fp32 master copy, gradients and AdamW state in host memory and step "
                        "the optimizer there (FSDP2's CPU offload; on a CPU run it changes nothing and says so; "
                        "megatron: CPU runs only)")
    g.add_argument("--log-probs-chunk-size", type=int, default=1024,
                   help="the FSDP backend computes log-probs and entropy from the last hidden states, applying the "
                        "output layer to this many tokens at a time (no [tokens, vocab] tensor of the micro-batch); "
                        "0: from the model's full logits")
    g.add_argument("--lr", type=float, default=1e-6, help="the peak learning rate (slime.training.lr_schedule)")
    g.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine"), default="constant",
                   help="after the warm-up: --lr throughout (constant), or down to --min-lr by --lr-decay-iters")
    g.add_argument("--lr-decay-iters", type=int, default=None,
                   help="optimizer steps until --min-lr (default: every optimizer step of the run)")
    g.add_argument("--lr-warmup-iters", type=int, default=0, help="optimizer steps of linear warm-up")
    g.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="the warm-up as a fraction of --lr-decay-iters (instead of --lr-warmup-iters)")
    g.add_argument("--lr-warmup-init", type=float, default=0.0, help="the learning rate the warm-up starts from")
    g.add_argument("--min-lr", type=float, default=0.0, help="where linear and cosine decay end")
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.98)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--update-weight-buffer-size", type=_size, default=_size("512MB"),
                   help="bytes per weight-sync bucket sent to the engines")
    g.add_argument("--update-weights-mode", choices=UPDATE_WEIGHTS_MODES, default="auto",
                   help="how weights reach the engines: distributed (process-group broadcast; auto without "
                        "--colocate), disk (safetensors in /dev/shm handed by path, native engine; auto with "
                        "--colocate), tensor (safetensors bytes over HTTP); docs/cluster.md")
    g.add_argument("--offload-dir", default=None,
                   help="--colocate on a CPU-only machine: directory the trainer spills its state to while "
                        "the engines generate (default: the system temp dir)")

    g = p.add_argument_group("algorithm")
    g.add_argument("--advantage-estimator", choices=ADVANTAGE_ESTIMATORS, default="grpo")
    g.add_argument("--use-kl-loss", action="store_true")
    g.add_argument("--kl-loss-coef", type=float, default=0.0)
    g.add_argument("--kl-loss-type", choices=KL_LOSS_TYPES, default="low_var_kl")
    g.add_argument("--eps-clip", type=float, default=0.2)
    g.add_argument("--eps-clip-high", type=float, default=None, help="upper clip (default: --eps-clip)")
    g.add_argument("--entropy-coef", type=float, default=0.0)
    g.add_argument("--eps-clip-c", type=float, default=None,
                   help="dual-clip PPO: cap the loss of negative-advantage tokens at -A * eps_clip_c (> 1)")
    g.add_argument("--kl-coef", type=float, default=0.0,
                   help="KL(policy || ref) penalty in the reward, before advantages (ppo, reinforce_plus_plus*)")
    g.add_argument("--gamma", type=float, default=1.0, help="discount (ppo GAE, reinforce_plus_plus)")
    g.add_argument("--lambd", type=float, default=1.0, help="GAE lambda (ppo)")
    g.add_argument("--normalize-advantages", action="store_true",
                   help="whiten advantages over the rollout's loss-mask tokens (all ranks)")
    g.add_argument("--disable-grpo-std-normalization", action="store_false", dest="grpo_std_normalization",
                   help="center GRPO-style group rewards without dividing by the std (Dr. GRPO)")
    g.add_argument("--disable-rewards-normalization", action="store_false", dest="rewards_normalization",
                   help="train on the raw rewards (no group normalization)")
    g.add_argument("--loss-agg-mode", choices=LOSS_AGG_MODES, default="token-mean",
                   help="how per-token losses of a step are averaged (docs/algorithms.md)")
    g.add_argument("--loss-type", choices=LOSS_TYPES, default=None,
                   help="policy_loss: the estimator's RL loss; sft_loss: negative log-likelihood of the loss-mask "
                        "tokens of chat data in --prompt-data (no engines); custom_loss: "
                        "--custom-loss-function-path (default: custom_loss when that path is given, else policy_loss)")
    g.add_argument("--custom-loss-function-path", default=None,
                   help="dotted path of a per-token policy loss replacing the estimator's (docs/algorithms.md)")
    g.add_argument("--custom-advantage-function-path", default=None,
                   help="dotted path of an advantage function replacing the estimator's (docs/algorithms.md)")
    g.add_argument("--value-clip", type=float, default=0.2, help="PPO critic: clip range of the value loss")
    g.add_argument("--critic-lr", type=float, default=None, help="PPO critic learning rate (default: --lr)")
    g.add_argument("--custom-reward-post-process-path", default=None,
                   help="dotted path: (args, samples) -> training rewards, replacing group normalization")
    g.add_argument("--dynamic-sampling-filter-path", default=None,
                   help="dotted path: (args, group samples) -> keep?; e.g. "
                        "slime.rollout.filters.check_reward_nonzero_std (DAPO dynamic sampling)")
    g.add_argument("--over-sampling-batch-size", type=int, default=None,
                   help="prompts launched per sampling round (default: --rollout-batch-size)")
    g.add_argument("--dynamic-sampling-max-rounds", type=int, default=8,
                   help="sampling rounds before rejected groups fill what the filter left short")
    g.add_argument("--overlong-buffer-len", type=int, default=0,
                   help="DAPO soft overlong punishment: length of the penalty ramp before --rollout-max-response-len")
    g.add_argument("--overlong-penalty-factor", type=float, default=1.0,
                   help="reward penalty at --rollout-max-response-len (with --overlong-buffer-len)")
    g.add_argument("--mask-truncated-samples", action="store_true",
                   help="DAPO overlong filtering: samples cut off at --rollout-max-response-len train on nothing "
                        "(loss mask 0); counted in rollout/overlong_filtered")
    g.add_argument("--use-unbiased-kl", action="store_true",
                   help="weight the KL loss by the importance ratio exp(logp - logp_old) (unbiased under "
                        "off-policy samples; needs --use-kl-loss)")
    g.add_argument("--use-rollout-logprobs", action="store_true",
                   help="use the engine's log-probs as the old log-probs of the PPO ratio (no old-log-prob pass)")
    g.add_argument("--use-tis", action="store_true",
                   help="truncated importance sampling: weight the policy loss by clip(pi_train_old / pi_rollout, "
                        "--tis-clip-low, --tis-clip) to correct the engine/trainer mismatch")
    g.add_argument("--tis-clip", type=float, default=2.0, help="upper clip of the TIS weight")
    g.add_argument("--tis-clip-low", type=float, default=0.0, help="lower clip of the TIS weight")
    g.add_argument("--tis-level", choices=TIS_LEVELS, default="token",
                   help="token: one weight per token; sequence: the product of a sequence's token ratios; "
                        "geometric: their geometric mean (one weight per sequence)")
    g.add_argument("--custom-tis-function-path", default=None,
                   help="dotted path of a TIS function replacing the built-in one "
                        "(docs/algorithms.md; needs --use-tis)")

    add_eval_flags(p)  # --eval-prompt-data, --eval-config, --eval-*: slime.eval_flags

    g = p.add_argument_group("run")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--output-dir", default=None, help="metrics and logs (default: a new folder under ./outputs)")
    g.add_argument("--config", default=None, metavar="PATH",
                   help="a YAML file of flags (name: value); command-line flags win")
    g.add_argument("--print-config", action="store_true", help="print the flags as a --config file and exit")

    g = p.add_argument_group("debug")
    g.add_argument("--debug-rollout-only", action="store_true",
                   help="generate and score rollouts without training (no train ranks, no weight sync)")
    g.add_argument("--debug-train-only", action="store_true",
                   help="train on rollouts saved earlier (--load-debug-rollout-data) without engines")
    g.add_argument("--save-debug-rollout-data", default=None,
                   help="write each rollout's scored samples to this path; {rollout_id} is replaced")
    g.add_argument("--load-debug-rollout-data", default=None,
                   help="train on samples written by --save-debug-rollout-data instead of generating "
                        "(implies --debug-train-only); {rollout_id} is replaced")
    g.add_argument("--check-weight-update-equal", action="store_true",
                   help="after every weight sync, check that each engine's weights equal the trainer's bit for bit")

    g = p.add_argument_group("logging")
    g.add_argument("--use-tensorboard", action=argparse.BooleanOptionalAction, default=True,
                   help="log metrics to TensorBoard under <output-dir>/tensorboard (default on)")
    g.add_argument("--use-wandb", action="store_true", help="also log metrics to Weights & Biases")
    g.add_argument("--wandb-project", default="slime")
    g.add_argument("--wandb-group", default=None)
    g.add_argument("--wandb-run-name", default=None, help="default: the output folder's name")
    g.add_argument("--wandb-mode", choices=("online", "offline"), default=None,
                   help="default: $WANDB_MODE, else online; offline writes runs under <output-dir>/wandb for `wandb sync`")
    g.add_argument("--wandb-key", default=None, help="W&B API key (default: $WANDB_API_KEY or `wandb login`)")
    g.add_argument("--wandb-team", default=None, help="W&B entity (team or user) the run is logged under")
    g.add_argument("--wandb-host", default=None, help="W&B server URL (default: https://api.wandb.ai)")
    add_lora_flags(p)
    add_opd_flags(p)
    add_moe_flags(p)
    add_off_policy_flags(p)
    add_judge_flags(p)
    add_mcp_flags(p)
    add_environment_flags(p)
    add_model_flags(p)
    add_script_flags(p)
    add_profile_flags(p)  # --profile-rollouts: slime.profile_flags
    return p


def _default_output_dir() -> str:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = Path("outputs") / f"run-{stamp}"
    path, k = base, 1
    while path.exists():
        path, k = Path(f"{base}-{k}"), k + 1
    return str(path)


def validate(args: Args) -> Args:
    """Check every flag and compute derived values; returns the frozen args."""
    # cluster
    for flag in ("actor_num_nodes", "actor_num_gpus_per_node", "rollout_num_gpus_per_engine"):
        require(getattr(args, flag) >= 1, f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    args.dp_size = args.actor_num_nodes * args.actor_num_gpus_per_node
    validate_served_models(args)  # --sglang-config: every served model's devices and the policy's engines
    if args.rollout_num_gpus is None:
        args.rollout_num_gpus = args.dp_size if args.colocate else 1
    require(args.rollout_num_gpus >= 1, f"--rollout-num-gpus must be >= 1, got {args.rollout_num_gpus}")
    if args.sglang_config is None:
        require(
            args.rollout_num_gpus % args.rollout_num_gpus_per_engine == 0,
            f"--rollout-num-gpus {args.rollout_num_gpus} is not a multiple of "
            f"--rollout-num-gpus-per-engine {args.rollout_num_gpus_per_engine}",
        )
        args.num_engines = args.rollout_num_gpus // args.rollout_num_gpus_per_engine
    validate_engines(args)

    # files
    hf = Path(args.hf_checkpoint)
    require(hf.is_dir(), f"--hf-checkpoint: directory {args.hf_checkpoint} does not exist")
    require((hf / "config.json").is_file(), f"--hf-checkpoint: {args.hf_checkpoint} has no config.json")
    if args.ref_load is not None:
        check_frozen_model(args, "--ref-load", args.ref_load, "the reference")
    validate_opd(args)
    check_opd_teacher(args)  # the teacher (--opd-teacher-load or the served one) uses the student's tokenizer
    validate_script_flags(args)  # architecture flags against config.json; Megatron/slime script flags
    validate_moe(args)  # --use-rollout-routing-replay, --use-routing-replay, --moe-aux-loss-coeff
    if args.rm_type in UNAVAILABLE_RM_TYPES:
        raise SlimeConfigError(unavailable_message(args.rm_type))
    validate_environment(args)  # --env-id: the verifiers/OpenEnv adapter, its reward and data defaults
    require(args.prompt_data is not None or args.data_source_path or args.rollout_function_path,
            "--prompt-data is required (unless --data-source-path or --rollout-function-path supplies the data)")
    if args.prompt_data is not None:
        require(_data_file(args.prompt_data).is_file(), f"--prompt-data: file {args.prompt_data} does not exist")
    require(args.apply_chat_template_kwargs is None or args.apply_chat_template,
            "--apply-chat-template-kwargs needs --apply-chat-template (its keys go to the chat template)")
    validate_custom_rollout(args)
    validate_mcp(args)  # --mcp-config: the MCP servers' file (nothing starts here)
    validate_judge(args)  # --rm-type llm_judge: the served --judge-model and the --judge-template file
    check_slime_paths(args)  # slime's own module paths that need another flag here
    check_checkpoint_dirs(args)
    require(args.save_interval is None or args.save_interval >= 1, "--save-interval must be >= 1")
    require(args.save_interval is None or args.save is not None, "--save-interval needs --save DIR")

    # rollout
    require(args.rollout_batch_size >= 1, f"--rollout-batch-size must be >= 1, got {args.rollout_batch_size}")
    require(args.n_samples_per_prompt >= 1, f"--n-samples-per-prompt must be >= 1, got {args.n_samples_per_prompt}")
    require(args.rollout_temperature >= 0, f"--rollout-temperature must be >= 0, got {args.rollout_temperature}")
    require(0 < args.rollout_top_p <= 1, f"--rollout-top-p must be in (0, 1], got {args.rollout_top_p}")
    require(args.rollout_top_k == -1 or args.rollout_top_k >= 1, f"--rollout-top-k must be -1 or >= 1, got {args.rollout_top_k}")
    require(args.rollout_max_response_len >= 1, "--rollout-max-response-len must be >= 1")
    require(args.n_samples_per_eval_prompt >= 1, "--n-samples-per-eval-prompt must be >= 1")
    for name in ("temperature", "top_p", "top_k", "max_response_len"):
        if getattr(args, f"eval_{name}") is None:
            setattr(args, f"eval_{name}", getattr(args, f"rollout_{name}"))
    validate_eval(args)  # the eval sets (--eval-prompt-data or --eval-config) and their settings; eval schedule

    # the batch rule: rollout_batch_size * n_samples_per_prompt = global_batch_size * num_steps_per_rollout
    samples = args.rollout_batch_size * args.n_samples_per_prompt
    rule = (
        f"rollout_batch_size * n_samples_per_prompt ({args.rollout_batch_size} * {args.n_samples_per_prompt} "
        f"= {samples}) must equal global_batch_size * num_steps_per_rollout"
    )
    if args.global_batch_size is None:
        steps = args.num_steps_per_rollout or 1
        require(samples % steps == 0, f"{rule} ({samples} is not divisible by --num-steps-per-rollout {steps})")
        args.global_batch_size = samples // steps
    if args.num_steps_per_rollout is None:
        require(
            samples % args.global_batch_size == 0,
            f"{rule} ({samples} is not a multiple of --global-batch-size {args.global_batch_size})",
        )
        args.num_steps_per_rollout = samples // args.global_batch_size
    require(
        samples == args.global_batch_size * args.num_steps_per_rollout,
        f"{rule} ({args.global_batch_size} * {args.num_steps_per_rollout} = "
        f"{args.global_batch_size * args.num_steps_per_rollout})",
    )
    require(
        args.global_batch_size % args.dp_size == 0,
        f"--global-batch-size {args.global_batch_size} must be divisible by the data-parallel size {args.dp_size}",
    )
    require(args.micro_batch_size >= 1, "--micro-batch-size must be >= 1")
    validate_batching(args)

    # algorithm
    if args.eps_clip_high is None:
        args.eps_clip_high = args.eps_clip
    validate_algorithm(args)
    validate_async(args)
    validate_megatron(args)
    validate_recompute(args)
    validate_lora(args, engine_kind(args))
    validate_off_policy(args)  # --tis-mode, OPSM, top-entropy tokens, SAPO, frozen parameters, reference updates
    require(args.kl_loss_coef >= 0, "--kl-loss-coef must be >= 0")
    require(args.lr > 0, f"--lr must be > 0, got {args.lr}")
    require(not (args.bf16 and args.fp16), "--bf16 and --fp16: give one")
    require(not args.fp16, "--fp16 needs loss scaling, which slime does not implement; use --bf16")
    require(args.log_probs_chunk_size >= 0, f"--log-probs-chunk-size must be >= 0, got {args.log_probs_chunk_size}")

    # length of the run
    require(
        args.num_rollout is not None or args.num_epoch is not None,
        "one of --num-rollout or --num-epoch is required",
    )
    if args.num_rollout is None:
        require(args.num_epoch >= 1, f"--num-epoch must be >= 1, got {args.num_epoch}")
        require(args.prompt_data is not None, "--num-epoch needs --prompt-data (use --num-rollout)")
        args.num_rollout = max(1, args.num_epoch * count_rows(args.prompt_data) // args.rollout_batch_size)
    require(args.num_rollout >= 1 or (args.num_rollout == 0 and (args.eval_sets or args.eval_function_path)),
            f"--num-rollout must be >= 1 (or 0 with --eval-prompt-data: an eval-only run), got {args.num_rollout}")
    require(not (args.num_rollout == 0 and args.skip_eval_before_train),
            "--num-rollout 0 is an eval-only run; --skip-eval-before-train would leave nothing to do")
    validate_lr_schedule(args)
    validate_debug(args)
    validate_profile(args)  # --profile-rollouts A-B against --num-rollout
    if args.output_dir is None:
        args.output_dir = _default_output_dir()
    if args.engine_api_key is None:  # a job's processes share one key: its environment's, else a new one
        args.engine_api_key = env_api_key() or secrets.token_hex(24)  # hex: never "-..." (a flag to the router)
    key = args.engine_api_key
    require(len(key) >= 16 and key.isprintable() and " " not in key and not key.startswith("-"),
            "--engine-api-key must be at least 16 printable characters without spaces, not starting with '-'")
    check_prompt_data(args)  # every row, as the rollout reads it (after the flags): before anything starts
    return args.freeze()


def _data_file(spec: str) -> Path:
    return split_slice(spec)[0]


def parse_flags(argv: list[str] | None = None) -> Args:
    """Parse the command line without validating it (no file is read but a `--config` YAML,
    whose flags come before the command line's): what a launch script's flags mean to slime.
    `parse_args` validates the result."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    check_unknown_flags(argv, parser, PASS_THROUGH_PREFIXES)
    argv = config_file.with_config(argv, parser, PASS_THROUGH_PREFIXES)  # the file's flags first: argv wins
    args, extra = parser.parse_known_args(argv, namespace=Args())
    passed = collect_pass_through(extra, PASS_THROUGH_PREFIXES, argv)
    args.sglang_args, args.vllm_args = passed[SGLANG_PREFIX], passed[VLLM_PREFIX]
    return args


def parse_args(argv: list[str] | None = None, overlap_training: bool = False) -> Args:
    """Parse and validate the flags. `overlap_training`: the driver generates while it trains
    (train_async.py), which decides how the two share this machine's CPUs (`cpu_threads`)."""
    args = parse_flags(argv)
    args.overlap_training = overlap_training
    given = copy.deepcopy(vars(args)) if args.print_config else None
    args = validate(args)
    if args.print_config:  # train.py and train_async.py: nothing starts
        print(config_file.dump_config(build_parser(), given, args, PASS_THROUGH_PREFIXES), end="")
        sys.exit(0)
    return args
