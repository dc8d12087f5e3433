"""The checks of one group of slime flags each, run in order by `slime.arguments.validate`.

Each `validate_*` raises a `SlimeConfigError` whose message names the flag, and computes the
derived values of its group (weight-update mode, reward type, custom config, groups in flight,
loss type, ...). The parser, the cluster, file and batch-size checks and the order the groups
run in live in `slime.arguments`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from slime import model_flags, script_flags
from slime.data.dataset import check_prompt_file
from slime.engines.kinds import KINDS, engine_kind
from slime.engines.served_models import POLICY_DEFAULT_NAME, load_served_models, model_args, pass_through_key
from slime.opd_flags import served_teacher
from slime.utils import checkpoint_files
from slime.utils.errors import SlimeConfigError
from slime.utils.hooks import load_function
from slime.utils.pipeline_layout import PipelineLayout
from slime.utils.reward_names import UNAVAILABLE_RM_TYPES, is_builtin, reward_name
from slime.utils.yaml_fields import yaml_problem

if TYPE_CHECKING:
    from slime.utils.args_namespace import Args

# the policy loss each estimator trains with (slime.algorithms.losses.POLICY_LOSSES)
POLICY_LOSS_OF_ESTIMATOR = {"gspo": "gspo", "cispo": "cispo"}


def require(cond: bool, message: str) -> None:
    if not cond:
        raise SlimeConfigError(message)


def validate_engines(args: Args) -> None:
    """Engine flags: --sglang-server-concurrency, the router address, health checks, --colocate's device
    count, then what the engine kind checks (slime.engines.kinds): the weight-update mode it takes and
    its own flags."""
    require(args.sglang_server_concurrency >= 1,
            f"--sglang-server-concurrency must be >= 1, got {args.sglang_server_concurrency}")
    require((args.sglang_router_ip is None) == (args.sglang_router_port is None),
            "--sglang-router-ip and --sglang-router-port go together")
    require(args.rollout_health_check_interval > 0 and args.rollout_health_check_timeout > 0,
            "--rollout-health-check-interval and --rollout-health-check-timeout must be > 0")
    if args.colocate:
        require(
            args.rollout_num_gpus == args.dp_size,
            f"--colocate needs --rollout-num-gpus ({args.rollout_num_gpus}) equal to the actor's devices "
            f"(--actor-num-nodes x --actor-num-gpus-per-node = {args.dp_size})",
        )
    kind = engine_kind(args)
    if args.multimodal_keys and not kind.takes_images:
        able = " and ".join(k.name for k in KINDS.values() if k.takes_images)
        raise SlimeConfigError(f"--multimodal-keys: images are served by the {able} engines only; --rollout-backend "
                               f"{kind.name} takes none (docs/vlm.md)")
    args.update_weights_mode = kind.resolve_update_weights_mode(args.update_weights_mode, args.colocate)
    kind.check(args)


def validate_served_models(args: Args) -> None:
    """--sglang-config (slime.engines.served_models): the models served, the policy among them. Sets
    `args.served_models` (the frozen ones, in the file's order), `args.policy_model_name`, and the
    policy's `num_engines` and `--rollout-num-gpus-per-engine`; `--rollout-num-gpus` counts every
    served model's devices (given, it must equal the file's total, as in slime). The policy's
    overrides join the run's pass-through flags of its kind. Without the flag: no frozen models, the
    policy is named "actor"."""
    args.served_models, args.policy_model_name = (), POLICY_DEFAULT_NAME
    if args.sglang_config is None:
        return
    require(args.sglang_router_ip is None, "--sglang-config starts a router per served model; leave out "
                                           "--sglang-router-ip/--sglang-router-port")
    models = load_served_models(args.sglang_config, args.hf_checkpoint, args.rollout_backend,
                                args.rollout_num_gpus_per_engine, tuple(KINDS))
    policy = next(m for m in models if m.update_weights)
    total = sum(m.num_gpus for m in models)
    require(args.rollout_num_gpus in (None, total),
            f"--rollout-num-gpus {args.rollout_num_gpus}: --sglang-config {args.sglang_config} serves {total} devices ("
            + ", ".join(f"{m.name} {m.num_gpus}" for m in models) + "); make them agree or leave the flag out")
    args.rollout_num_gpus, args.num_engines = total, policy.num_engines
    args.rollout_num_gpus_per_engine = policy.gpus_per_engine
    key = pass_through_key(policy.engine)
    setattr(args, key, {**getattr(args, key), **policy.overrides})
    args.policy_model_name = policy.name
    args.served_models = tuple(m for m in models if not m.update_weights)
    for m in args.served_models:
        try:
            engine_kind(model_args(args, m)).check(model_args(args, m))
        except SlimeConfigError as e:
            raise SlimeConfigError(f"--sglang-config {args.sglang_config}: model {m.name}: {e}") from None


def check_prompt_data(args: Args) -> None:
    """Every row of --prompt-data (RL prompts, unless --data-source-path brings the data) and of each
    --eval-prompt-data set, checked as the rollout will read them (JSON, the --input-key/--label-key
    fields and their types), so bad data fails with its file and line before Ray or an engine starts."""
    data = [args.prompt_data] if args.prompt_data is not None and args.loss_type != "sft_loss" \
        and not args.data_source_path else []
    for spec in data:
        check_prompt_file(spec, args.input_key, args.label_key, args.metadata_key, args.apply_chat_template,
                          args.tool_key)
    for d in args.eval_datasets:  # each eval set with its own keys (--eval-config)
        check_prompt_file(d.path, d.input_key, d.label_key, d.metadata_key, args.apply_chat_template, d.tool_key)


def validate_custom_rollout(args: Args) -> None:
    """Reward choice, extension paths (imported now, so a typo fails at start-up naming the flag) and
    --custom-config-path (its keys become attributes of args)."""
    validate_reward_functions(args)
    if args.rm_type is None and not args.reward_functions:
        args.rm_type = "remote_rm" if args.rm_url else "math"
    require(args.rm_type != "remote_rm" or args.rm_url, "--rm-type remote_rm needs --rm-url URL")
    require(args.rm_url is None or args.rm_type == "remote_rm" or args.reward_functions,
            f"--rm-url is only used with --rm-type remote_rm, not {args.rm_type}")
    require(args.rm_url is None or args.rm_url.startswith(("http://", "https://")),
            f"--rm-url must be an http(s) URL, got {args.rm_url!r}")
    validate_reward_model(args)
    require(args.rm_timeout > 0, f"--rm-timeout must be > 0, got {args.rm_timeout}")
    require(args.rm_max_retries >= 0, f"--rm-max-retries must be >= 0, got {args.rm_max_retries}")
    require(args.max_turns >= 1, f"--max-turns must be >= 1, got {args.max_turns}")
    require(not args.group_rm or args.custom_rm_path, "--group-rm needs --custom-rm-path (a group reward function)")

    for flag in ("rollout_function_path", "custom_generate_function_path", "custom_rm_path", "data_source_path",
                 "buffer_filter_path", "rollout_sample_filter_path", "eval_function_path"):
        if getattr(args, flag):
            load_function(getattr(args, flag), "--" + flag.replace("_", "-"))
    args.custom_config = {}
    if args.custom_config_path:
        args.custom_config = _load_custom_config(args, args.custom_config_path)
        for key, value in args.custom_config.items():
            setattr(args, key, value)


GDPO_ESTIMATORS = ("grpo", "gspo", "cispo")  # the estimators whose group normalization gdpo replaces


def validate_reward_functions(args: Args) -> None:
    """--reward-functions, --reward-weights (default: 1 each) and --reward-aggregation
    (slime.rollout.rewards.mix): a function path is imported now; every refused combination is one line."""
    fns = args.reward_functions
    if not fns:
        require(args.reward_weights is None, "--reward-weights needs --reward-functions (one weight per reward)")
        require(args.reward_aggregation == "sum",
                f"--reward-aggregation {args.reward_aggregation} needs --reward-functions (several rewards)")
        return
    require(args.rm_type is None, f"--reward-functions replaces --rm-type: list {args.rm_type} in --reward-functions")
    require(not args.custom_rm_path, f"--reward-functions replaces --custom-rm-path: list {args.custom_rm_path} "
                                     "in --reward-functions")
    require(not args.group_rm, "--group-rm does not work with --reward-functions (each listed reward scores one "
                               "sample); score the group in a --custom-rm-path --group-rm function instead")
    for entry in fns:
        require(entry not in UNAVAILABLE_RM_TYPES, f"--reward-functions {entry}: {UNAVAILABLE_RM_TYPES.get(entry)}")
        if not is_builtin(entry):
            load_function(entry, "--reward-functions")
    names = [reward_name(e) for e in fns]
    dup = next((n for n in names if names.count(n) > 1), None)
    require(dup is None, f"--reward-functions: two entries are named {dup!r}; each reward is kept and logged "
                         "by its name, so give each function its own name")
    require("remote_rm" not in fns or args.rm_url, "--reward-functions remote_rm needs --rm-url URL")
    require(args.rm_url is None or "remote_rm" in fns, "--rm-url is only used by remote_rm, which "
                                                        "--reward-functions does not list")
    if args.reward_weights is None:
        args.reward_weights = [1.0] * len(fns)
    require(len(args.reward_weights) == len(fns), f"--reward-weights has {len(args.reward_weights)} weights for "
                                                  f"{len(fns)} --reward-functions; give one weight per reward")
    require(all(math.isfinite(w) for w in args.reward_weights),
            f"--reward-weights must be finite numbers, got {args.reward_weights}")
    if args.reward_aggregation != "gdpo":
        return
    require(args.advantage_estimator in GDPO_ESTIMATORS, "--reward-aggregation gdpo replaces the group "
            f"normalization of {', '.join(GDPO_ESTIMATORS)}; not --advantage-estimator {args.advantage_estimator}")
    require(args.n_samples_per_prompt > 1, "--reward-aggregation gdpo normalizes each reward within a prompt's "
                                           "samples; it needs --n-samples-per-prompt > 1")
    require(args.rewards_normalization, "--reward-aggregation gdpo normalizes the rewards; drop "
                                        "--disable-rewards-normalization (or use --reward-aggregation sum)")
    require(args.grpo_std_normalization, "--reward-aggregation gdpo divides each reward by its group std; drop "
                                         "--disable-grpo-std-normalization (or use --reward-aggregation sum)")
    require(not args.custom_reward_post_process_path, "--reward-aggregation gdpo and "
            "--custom-reward-post-process-path both make the training rewards; pass one of them")
    require(args.overlong_buffer_len == 0, "--reward-aggregation gdpo does not add the --overlong-buffer-len "
            "penalty; list a length reward in --reward-functions instead")


def validate_reward_model(args: Args) -> None:
    """--rm-path goes with reward_model (--rm-type, or an entry of --reward-functions); its config.json
    must be a sequence-classification model with one label (read now, no weights loaded)."""
    listed = "reward_model" in (args.reward_functions or ())
    flag = "--reward-functions reward_model" if listed else "--rm-type reward_model"
    if not (listed or args.rm_type == "reward_model"):
        require(args.rm_path is None, "--rm-path is only used by a reward model: pass --rm-type reward_model "
                                      "(or list reward_model in --reward-functions)")
        return
    require(args.rm_path, f"{flag} needs --rm-path DIR (a Hugging Face sequence-classification reward model)")
    path = Path(args.rm_path)
    require(path.is_dir(), f"--rm-path {args.rm_path}: directory does not exist")
    require((path / "config.json").is_file(), f"--rm-path {args.rm_path}: no config.json (not a Hugging Face model "
                                              "directory)")
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise SlimeConfigError(f"--rm-path {args.rm_path}: config.json is not valid JSON ({e})") from None
    archs = config.get("architectures") or []
    require(any(str(a).endswith("ForSequenceClassification") for a in archs),
            f"--rm-path {args.rm_path}: architectures {archs} is not a ...ForSequenceClassification model; a reward "
            "model is an AutoModelForSequenceClassification with num_labels 1")
    id2label = config.get("id2label")
    labels = len(id2label) if isinstance(id2label, dict) else config.get("num_labels", 2)  # transformers' default: 2
    require(labels == 1, f"--rm-path {args.rm_path}: the model has {labels} labels; a reward model has num_labels 1 "
                         "(one scalar score)")
    require((path / "tokenizer_config.json").is_file() or (path / "tokenizer.json").is_file(),
            f"--rm-path {args.rm_path}: no tokenizer (tokenizer_config.json or tokenizer.json)")


def _load_custom_config(args: Args, path: str) -> dict:
    require(Path(path).is_file(), f"--custom-config-path: file {path} does not exist")
    try:
        config = yaml.safe_load(Path(path).read_text()) or {}
    except yaml.YAMLError as e:
        line, why = yaml_problem(e)
        at = f" (line {line})" if line is not None else ""
        raise SlimeConfigError(f"--custom-config-path {path}: not valid YAML{at}: {why}") from None
    require(isinstance(config, dict), f"--custom-config-path {path}: must hold a mapping of names to values")
    for key in config:
        require(isinstance(key, str) and key.isidentifier(),
                f"--custom-config-path {path}: key {key!r} is not a valid Python name")
        require(not hasattr(args, key),
                f"--custom-config-path {path}: key {key!r} is a slime flag or setting; set it on the command line")
    return config


def validate_async(args: Args) -> None:
    require(args.update_weights_interval >= 1, f"--update-weights-interval must be >= 1, got {args.update_weights_interval}")
    require(args.max_staleness is None or args.max_staleness >= 0, f"--max-staleness must be >= 0, got {args.max_staleness}")
    require(not args.mask_offpolicy_in_partial_rollout or args.partial_rollout,
            "--mask-offpolicy-in-partial-rollout needs --partial-rollout")
    require(not args.partial_rollout or args.over_sampling_batch_size > args.rollout_batch_size
            or args.dynamic_sampling_filter_path,
            "--partial-rollout needs --over-sampling-batch-size > --rollout-batch-size (or a dynamic sampling "
            "filter): otherwise every launched group is used and nothing is ever aborted")
    require(not (args.partial_rollout and args.rollout_function_path),
            "--partial-rollout is part of the built-in rollout; a --rollout-function-path replaces it")
    if args.async_groups_in_flight is None:
        args.async_groups_in_flight = args.over_sampling_batch_size
    require(args.async_groups_in_flight >= 1, "--async-groups-in-flight must be >= 1")
    require(not (args.fully_async and args.partial_rollout),
            "--fully-async keeps generating across rollouts; --partial-rollout (abort and resume) does not apply")
    require(not (args.fully_async and args.rollout_function_path),
            "--fully-async is part of the built-in rollout; a --rollout-function-path replaces it")


def validate_batching(args: Args) -> None:
    """--use-dynamic-batch-size / --max-tokens-per-gpu (slime.training.actor). A sample longer than
    the token budget is not an error: it trains alone in its micro-batch. --balance-data needs no
    check (with one rank it changes nothing)."""
    if args.use_dynamic_batch_size:
        require(args.max_tokens_per_gpu is not None,
                "--use-dynamic-batch-size needs --max-tokens-per-gpu (the token budget of one micro-batch)")
    else:
        require(args.max_tokens_per_gpu is None,
                "--max-tokens-per-gpu is only used with --use-dynamic-batch-size (add that flag or drop this one)")
    require(args.max_tokens_per_gpu is None or args.max_tokens_per_gpu >= 1,
            f"--max-tokens-per-gpu must be >= 1, got {args.max_tokens_per_gpu}")


def validate_algorithm(args: Args) -> None:
    args.use_critic = args.advantage_estimator == "ppo"
    args.policy_loss_type = args.policy_loss_type or POLICY_LOSS_OF_ESTIMATOR.get(args.advantage_estimator, "ppo")
    if args.critic_lr is None:
        args.critic_lr = args.lr
    if args.over_sampling_batch_size is None:
        args.over_sampling_batch_size = args.rollout_batch_size
    require(args.eps_clip_c is None or args.eps_clip_c > 1, f"--eps-clip-c must be > 1, got {args.eps_clip_c}")
    require(args.kl_coef >= 0, f"--kl-coef must be >= 0, got {args.kl_coef}")
    require(0 <= args.gamma <= 1, f"--gamma must be in [0, 1], got {args.gamma}")
    require(0 <= args.lambd <= 1, f"--lambd must be in [0, 1], got {args.lambd}")
    require(args.value_clip > 0, f"--value-clip must be > 0, got {args.value_clip}")
    require(args.critic_lr > 0, f"--critic-lr must be > 0, got {args.critic_lr}")
    require(
        args.over_sampling_batch_size >= args.rollout_batch_size,
        f"--over-sampling-batch-size {args.over_sampling_batch_size} must be >= --rollout-batch-size "
        f"{args.rollout_batch_size}",
    )
    require(args.dynamic_sampling_max_rounds >= 1, "--dynamic-sampling-max-rounds must be >= 1")
    require(
        0 <= args.overlong_buffer_len < args.rollout_max_response_len,
        f"--overlong-buffer-len must be in [0, --rollout-max-response-len {args.rollout_max_response_len}), "
        f"got {args.overlong_buffer_len}",
    )
    require(args.overlong_penalty_factor >= 0, "--overlong-penalty-factor must be >= 0")
    if args.kl_coef > 0 and args.advantage_estimator in ("grpo", "gspo", "cispo", "rloo"):
        raise SlimeConfigError(
            f"--kl-coef (KL in the reward) has no effect with --advantage-estimator {args.advantage_estimator}; "
            "use --use-kl-loss --kl-loss-coef"
        )
    require(args.advantage_estimator != "rloo" or args.n_samples_per_prompt >= 2,
            "--advantage-estimator rloo needs --n-samples-per-prompt >= 2 (a leave-one-out baseline)")
    _validate_loss_type(args)
    require(not args.use_unbiased_kl or args.use_kl_loss, "--use-unbiased-kl has no effect without --use-kl-loss")
    require(args.tis_clip > 0, f"--tis-clip must be > 0, got {args.tis_clip}")
    require(0 <= args.tis_clip_low < args.tis_clip,
            f"--tis-clip-low must be in [0, --tis-clip {args.tis_clip}), got {args.tis_clip_low}")
    require(args.custom_tis_function_path is None or args.use_tis,
            "--custom-tis-function-path has no effect without --use-tis")

    for flag in ("custom_loss_function_path", "custom_advantage_function_path", "custom_tis_function_path",
                 "custom_reward_post_process_path", "dynamic_sampling_filter_path"):
        if getattr(args, flag):  # fail at start-up, naming the flag
            load_function(getattr(args, flag), "--" + flag.replace("_", "-"))


def _validate_loss_type(args: Args) -> None:
    """`--loss-type` (original slime's names): custom_loss when only --custom-loss-function-path is given."""
    if args.loss_type is None:
        args.loss_type = "custom_loss" if args.custom_loss_function_path else "policy_loss"
    require(args.loss_type != "custom_loss" or args.custom_loss_function_path is not None,
            "--loss-type custom_loss needs --custom-loss-function-path")
    require(args.loss_type == "custom_loss" or args.custom_loss_function_path is None,
            f"--custom-loss-function-path is only used with --loss-type custom_loss, not {args.loss_type}")
    if args.loss_type != "sft_loss":
        return
    # SFT trains on the chat data itself: no engines, samples, rewards or reference model
    require(args.n_samples_per_prompt == 1,
            f"--loss-type sft_loss needs --n-samples-per-prompt 1, got {args.n_samples_per_prompt}")
    require(not args.eval_sets, "--eval-prompt-data needs rollout engines, which --loss-type sft_loss does not start")
    for flag, on in (("--advantage-estimator ppo", args.use_critic), ("--use-kl-loss", args.use_kl_loss),
                     ("--kl-coef", args.kl_coef > 0), ("--use-tis", args.use_tis),
                     ("--use-rollout-logprobs", args.use_rollout_logprobs),
                     ("--dynamic-sampling-filter-path", args.dynamic_sampling_filter_path),
                     ("--custom-reward-post-process-path", args.custom_reward_post_process_path)):
        require(not on, f"{flag} has no effect with --loss-type sft_loss")
    require(args.sglang_config is None, "--sglang-config serves models for rollouts, which --loss-type sft_loss "
                                        "does not run")
    args.rollout_num_gpus = args.num_engines = 0  # no engines: placement reserves only the train ranks


def validate_recompute(args: Args) -> None:
    """--recompute-*: Megatron's flags; the FSDP backend recomputes whole decoder layers (all, or the
    first N with --recompute-method block)."""
    if args.recompute_granularity is None:
        require(args.recompute_method is None and args.recompute_num_layers is None,
                "--recompute-method and --recompute-num-layers need --recompute-granularity full")
        return
    if args.recompute_granularity == "selective":
        require(args.recompute_method is None, "--recompute-method goes with --recompute-granularity full")
        require(args.train_backend == "megatron", "--recompute-granularity selective (core attention only) needs "
                                                  "--train-backend megatron; the FSDP backend recomputes whole layers "
                                                  "(--recompute-granularity full)")
        return
    if args.recompute_method is None:
        args.recompute_method = "uniform"
    if args.recompute_num_layers is None:
        require(args.recompute_method == "uniform", "--recompute-method block needs --recompute-num-layers N "
                                                    "(the first N layers are recomputed)")
        args.recompute_num_layers = 1
    require(args.recompute_num_layers >= 1, f"--recompute-num-layers must be >= 1, got {args.recompute_num_layers}")
    require(args.train_backend == "megatron" or args.recompute_method == "block" or args.recompute_num_layers == 1,
            "--recompute-method uniform with --recompute-num-layers > 1 (groups of layers) needs --train-backend "
            "megatron; the FSDP backend recomputes one layer at a time")


def validate_megatron(args: Args) -> None:
    """Megatron's parallel sizes with --train-backend megatron: their product divides the train ranks;
    what the CPU (gloo) build cannot run is refused here with what it needs."""
    sizes = {"--tensor-model-parallel-size": args.tensor_model_parallel_size,
             "--pipeline-model-parallel-size": args.pipeline_model_parallel_size,
             "--context-parallel-size": args.context_parallel_size}
    for flag, n in sizes.items():
        require(n >= 1, f"{flag} must be >= 1, got {n}")
    if args.train_backend != "megatron":
        return  # checked against the model and logged by validate_script_flags (fsdp shards everything)
    tp, pp, cp = sizes.values()
    require(args.dp_size % (tp * pp * cp) == 0,
            f"tensor x pipeline x context parallel sizes ({tp} x {pp} x {cp} = {tp * pp * cp}) must divide the "
            f"{args.dp_size} train ranks (--actor-num-nodes x --actor-num-gpus-per-node)")
    require(cp == 1, "--context-parallel-size > 1 needs Transformer Engine's attention on GPUs; "
                     "megatron-core's local attention has no context-parallel path")
    require(not args.sequence_parallel or tp > 1, "--sequence-parallel needs --tensor-model-parallel-size > 1")


def validate_debug(args: Args) -> None:
    if args.load_debug_rollout_data:
        args.debug_train_only = True
    require(not (args.debug_rollout_only and args.debug_train_only),
            "--debug-rollout-only and --debug-train-only exclude each other")
    for flag in ("save_debug_rollout_data", "load_debug_rollout_data"):
        path = getattr(args, flag)
        require(path is None or args.num_rollout == 1 or "{rollout_id}" in path,
                f"--{flag.replace('_', '-')} {path!r} needs {{rollout_id}} in it when --num-rollout > 1")
    if args.debug_rollout_only:
        require(args.loss_type != "sft_loss", "--debug-rollout-only has nothing to generate with --loss-type sft_loss")
        require(args.save is None and args.load is None,
                "--save/--load need train ranks, which --debug-rollout-only does not start")
        require(not args.check_weight_update_equal, "--check-weight-update-equal needs train ranks")
    if args.debug_train_only:
        require(args.load_debug_rollout_data is not None, "--debug-train-only needs --load-debug-rollout-data PATH")
        require(not args.eval_sets, "--eval-prompt-data needs engines, which --debug-train-only does not start")
        require(not args.check_weight_update_equal, "--check-weight-update-equal needs engines")
        require(args.dynamic_sampling_filter_path is None, "--dynamic-sampling-filter-path needs engines")
        require(args.sglang_config is None, "--sglang-config serves models, which --debug-train-only does not start")
        args.rollout_num_gpus = args.num_engines = 0  # no engines: placement reserves only the train ranks


def check_checkpoint_dirs(args: Args) -> None:
    """--load and --save before anything starts: a --load that does not exist (a typo would start
    fresh) unless it is the --save directory (a run that resumes itself); a --save directory holding
    checkpoints as new as this run's first save or newer (another run's: the first save would
    replace them and move `latest` back) unless --overwrite-checkpoints."""
    require(args.save_keep_last is None or args.save_keep_last >= 1,
            f"--save-keep-last must be >= 1, got {args.save_keep_last}")
    require(args.save_keep_last is None or args.save is not None, "--save-keep-last needs --save DIR")
    same = args.load is not None and args.save is not None and Path(args.load).resolve() == Path(args.save).resolve()
    if args.load is not None:
        require(not Path(args.load).is_file(), f"--load: {args.load} is a file, not a checkpoint directory")
        require(Path(args.load).is_dir() or same,
                f"--load: {args.load} does not exist (to start fresh, leave --load out or give the --save directory)")
    if args.save is None or same or args.overwrite_checkpoints:
        return
    newest = checkpoint_files.complete_checkpoints(args.save)
    if not newest:
        return
    resumed = checkpoint_files.latest(args.load) if args.load is not None else None
    first_save = checkpoint_files.rollout_id_of(resumed) + 1 if resumed is not None else 0
    newest_id, newest_path = newest[-1]
    require(newest_id < first_save,
            f"--save: {args.save} holds checkpoints of another run up to {newest_path.name}, as new as or newer than "
            f"this run's first save (rollout {first_save}); resume it with --load {args.save}, choose another --save, "
            "or pass --overwrite-checkpoints")


def check_frozen_model(args: Args, flag: str, path: str, role: str) -> None:
    """A frozen model's Hugging Face directory (--ref-load, the OPD teacher) that scores the
    policy's tokens: it exists, has a config.json, the policy's vocabulary size and, where both
    directories have a tokenizer.json, the same token ids."""
    d = Path(path)
    require(d.is_dir(), f"{flag}: directory {path} does not exist")
    require((d / "config.json").is_file(), f"{flag}: {path} has no config.json (a Hugging Face model directory is "
                                           "expected)")
    vocab = [_vocab_size(x / "config.json") for x in (Path(args.hf_checkpoint), d)]
    require(vocab[0] == vocab[1], f"{flag} {path}: vocabulary of {vocab[1]} tokens, but --hf-checkpoint "
                                  f"{args.hf_checkpoint} has {vocab[0]}; {role} must score the same tokens")
    files = [x / "tokenizer.json" for x in (Path(args.hf_checkpoint), d)]
    if all(f.is_file() for f in files):
        ids = [json.loads(f.read_text()).get("model", {}).get("vocab") or {} for f in files]
        if ids[0] != ids[1]:
            diff = sorted(set(ids[0].items()) ^ set(ids[1].items()), key=str)[:1]
            require(False, f"{flag} {path}: its tokenizer differs from --hf-checkpoint's (first difference: "
                           f"token {diff[0][0]!r}); {role} must use the policy's tokenizer")


def check_opd_teacher(args: Args) -> None:
    """--use-opd (after `validate_opd`): the teacher's Hugging Face directory scores the policy's tokens
    (`check_frozen_model`): the trainer's --opd-teacher-load, or the model_path of the served
    --opd-teacher-model (--opd-type sglang)."""
    if args.opd_in_trainer:
        check_frozen_model(args, "--opd-teacher-load", args.opd_teacher_load, "the teacher")
    elif args.opd_served:
        check_frozen_model(args, f"--opd-teacher-model {args.opd_teacher_model} (its --sglang-config model_path)",
                           served_teacher(args).model_path, "the teacher")


def _vocab_size(config: Path) -> int | None:
    cfg = json.loads(config.read_text())
    return cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")


def validate_lr_schedule(args: Args) -> None:
    """The learning-rate flags (slime.training.lr_schedule), once the run's length is known."""
    require(args.min_lr >= 0 and args.lr_warmup_init >= 0, "--min-lr and --lr-warmup-init must be >= 0")
    require(args.min_lr <= args.lr, f"--min-lr {args.min_lr} is above --lr {args.lr}")
    require(args.lr_warmup_iters >= 0, f"--lr-warmup-iters must be >= 0, got {args.lr_warmup_iters}")
    require(args.lr_warmup_fraction is None or args.lr_warmup_iters == 0,
            "give --lr-warmup-iters or --lr-warmup-fraction, not both")
    require(args.lr_warmup_fraction is None or 0 <= args.lr_warmup_fraction <= 1,
            f"--lr-warmup-fraction must be in [0, 1], got {args.lr_warmup_fraction}")
    require(args.lr_decay_iters is None or args.lr_decay_iters >= 1,
            f"--lr-decay-iters must be >= 1, got {args.lr_decay_iters}")
    decay = args.lr_decay_iters or args.num_rollout * args.num_steps_per_rollout
    require(args.lr_warmup_iters <= decay, f"--lr-warmup-iters {args.lr_warmup_iters} is longer than the "
                                           f"{decay} optimizer steps of the decay (--lr-decay-iters)")


def hf_config(path: str):
    """The Hugging Face config of a checkpoint directory (transformers' AutoConfig), or a one-line error."""
    from transformers import AutoConfig  # here: the driver imports transformers only when a check reads a config

    try:
        return AutoConfig.from_pretrained(path)
    except Exception as e:  # an unknown model type, a malformed config.json
        raise SlimeConfigError(f"--hf-checkpoint {path}: transformers cannot read its config.json "
                               f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None


def validate_script_flags(args: Args) -> None:
    """The flags of slime's launch scripts: Megatron architecture flags against the checkpoint's config
    (slime.model_flags), the other Megatron-LM and slime flags by their rules (slime.script_flags), and
    Megatron's parallel sizes on the fsdp backend. Derives `attn_implementation`. The config is read
    only when one of these flags is given."""
    args.attn_implementation = script_flags.attention_implementation(args)
    args.start_up_notes = []  # printed by the driver at start-up
    sizes = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size,
             args.expert_model_parallel_size)
    if not (model_flags.given(args) or script_flags.given_flags(args) or args.rollout_max_context_len or max(sizes) > 1
            or args.sequence_parallel):
        return
    config = hf_config(args.hf_checkpoint)
    text = getattr(config, "text_config", None) or config
    moe = bool(model_flags.architecture_of(text).get("num_experts"))
    errors, args.start_up_notes = script_flags.check_script_flags(args, moe)
    errors = model_flags.architecture_mismatches(args, text) + errors
    if args.train_backend == "fsdp":
        errors += _fsdp_parallel_sizes(args, text)
    elif args.pipeline_model_parallel_size > 1:
        try:
            PipelineLayout.from_args(args, text.num_hidden_layers).check(text.num_hidden_layers)
        except SlimeConfigError as e:
            errors.append(str(e))
    limit = getattr(text, "max_position_embeddings", None)
    if args.rollout_max_context_len is not None:
        if args.rollout_max_context_len < 1:
            errors.append(f"--rollout-max-context-len must be >= 1, got {args.rollout_max_context_len}")
        elif limit and args.rollout_max_context_len > limit:
            errors.append(f"--rollout-max-context-len {args.rollout_max_context_len} is above the model's "
                          f"max_position_embeddings {limit}")
    if errors:
        more = f" (and {len(errors) - 1} more: {'; '.join(errors[1:])})" if len(errors) > 1 else ""
        raise SlimeConfigError(errors[0] + more)


def _fsdp_parallel_sizes(args: Args, config) -> list[str]:
    """Megatron's model-parallel sizes with --train-backend fsdp: checked as megatron checks them (they
    must split the heads, layers and ranks), then fsdp shards every parameter over all train ranks
    instead of splitting layers (a start-up note). Returns the error lines."""
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    errors = []
    if args.dp_size % (tp * pp * cp):
        errors.append(f"--tensor-model-parallel-size x --pipeline-model-parallel-size x --context-parallel-size "
                      f"({tp} x {pp} x {cp}) must divide the {args.dp_size} train ranks")
    heads, kv = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    if heads % tp or kv % tp:
        errors.append(f"--tensor-model-parallel-size {tp} must divide the model's {heads} attention heads and "
                      f"{kv} key/value heads")
    if config.num_hidden_layers < pp:
        errors.append(f"--pipeline-model-parallel-size {pp} is more than the model's {config.num_hidden_layers} layers")
    if args.sequence_parallel and tp == 1:
        errors.append("--sequence-parallel needs --tensor-model-parallel-size > 1")
    if not errors and (tp * pp * cp > 1 or args.sequence_parallel or args.expert_model_parallel_size > 1):
        args.start_up_notes.append(
            f"--train-backend fsdp: megatron's layout (TP {tp}, PP {pp}, CP {cp}, EP {args.expert_model_parallel_size}"
            f"{', sequence parallel' if args.sequence_parallel else ''}) is checked; FSDP shards every parameter, "
            f"gradient and optimizer state over all {args.dp_size} train ranks instead (--train-backend megatron "
            "for megatron's layout)")
    return errors
