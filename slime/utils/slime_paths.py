"""Original slime's built-in functions, by the dotted paths its launch scripts pass, mapped to this
project's equivalents.

This package is also named `slime`, so a path such as
`slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std` would otherwise fail to
import. `slime.utils.hooks.load_function` looks every path up here first: an aliased path loads
its equivalent here (logged at INFO; a difference worth knowing is logged as a warning), and a
refused one stops the run with one line naming the flag, the path and why, saying what to do
instead. Each alias belongs to one flag; the target has the signature this project's flag
expects (docs/custom_rollout.md), through an adapter in `slime.rollout.upstream_compat` where
original slime's signature differs. Paths only (strings): this module imports nothing of slime's
upper layers.
"""

from __future__ import annotations

from dataclasses import dataclass

from slime.utils.errors import SlimeConfigError


@dataclass(frozen=True)
class Alias:
    flag: str  # the flag original slime passes this path to
    target: str | None = None  # this project's dotted path; None: refused
    reason: str = ""  # why it is refused, and what to do instead
    note: str = ""  # a difference from original slime, logged as a warning when the alias is used

    def refusal(self, flag: str, path: str) -> str:
        return f"{flag} {path}: {self.reason}"


_FILTERS = "slime.rollout.filter_hub.dynamic_sampling_filters."
_COMPAT = "slime.rollout.upstream_compat."
_OPD = ("on-policy distillation with a served teacher is built in here: drop --custom-rm-path, "
        "--custom-reward-post-process-path and --rm-url, serve the teacher with --sglang-config and pass --use-opd "
        "--opd-type sglang --opd-teacher-model NAME (docs/algorithms.md)")

ALIASES: dict[str, Alias] = {
    # --dynamic-sampling-filter-path
    _FILTERS + "check_reward_nonzero_std": Alias(
        "--dynamic-sampling-filter-path", "slime.rollout.filters.check_reward_nonzero_std"),
    _FILTERS + "check_reward_nonzero_std_with_fallback": Alias(
        "--dynamic-sampling-filter-path", "slime.rollout.filters.check_reward_nonzero_std",
        note="original slime's _with_fallback fills the batch with rejected groups instead of sampling another "
             "round; here rejected groups fill it after --dynamic-sampling-max-rounds rounds (pass 1 for the same)"),
    # --rollout-function-path
    # (SFT here is --loss-type sft_loss, which serves the chat data itself; the adapter refuses to run without it)
    "slime.rollout.sft_rollout.generate_rollout": Alias("--rollout-function-path", _COMPAT + "sft_rollout"),
    "slime.rollout.sleep_rollout.sleep": Alias(
        "--rollout-function-path", _COMPAT + "sleep_rollout",
        note="the rollout never returns: --stage-timeout (default 3600 s) stops the run; raise it for long "
             "profiling sessions"),
    "slime.rollout.fully_async_rollout.generate_rollout_fully_async": Alias(
        "--rollout-function-path",
        reason="fully-async rollout is a flag in this project, not a function: drop --rollout-function-path and "
               "pass --fully-async to train_async.py"),
    "slime.rollout.sglang_rollout.generate_rollout": Alias(
        "--rollout-function-path",
        reason="original slime's default rollout is this project's built-in rollout, which runs when no "
               "--rollout-function-path is given: drop the flag"),
    "slime.rollout.forge_load.generate_rollout": Alias(
        "--rollout-function-path",
        reason="replaying a forged rollout dump with the engines kept live (--load-forge-rollout-data) is not "
               "built here; --load-debug-rollout-data replays saved rollouts without generating"),
    # --eval-function-path
    "slime.rollout.sglang_rollout.eval_rollout": Alias(
        "--eval-function-path",
        reason="original slime's default evaluation is this project's built-in evaluation, which runs when no "
               "--eval-function-path is given: drop the flag"),
    # --custom-generate-function-path
    "slime.rollout.sglang_rollout.generate": Alias("--custom-generate-function-path", _COMPAT + "generate"),
    "slime.rollout.sglang_streaming_rollout.generate_streaming": Alias(
        "--custom-generate-function-path", _COMPAT + "generate",
        note="this project does not stream: one /generate call per turn; a request aborted mid-generation keeps "
             "the tokens the engine returned with the abort"),
    # --custom-rm-path / --custom-reward-post-process-path
    "slime.rollout.on_policy_distillation.reward_func": Alias("--custom-rm-path", reason=_OPD),
    "slime.rollout.on_policy_distillation.post_process_rewards": Alias(
        "--custom-reward-post-process-path", reason=_OPD),
    "slime.rollout.rm_hub.async_rm": Alias(
        "--custom-rm-path",
        reason="original slime's built-in reward dispatch is --rm-type here: drop --custom-rm-path and pass "
               "--rm-type NAME"),
    "slime.rollout.rm_hub.batched_async_rm": Alias(
        "--custom-rm-path",
        reason="original slime's built-in reward dispatch is --rm-type here: drop --custom-rm-path and pass "
               "--rm-type NAME"),
    # --data-source-path / --buffer-filter-path
    "slime.rollout.data_source.RolloutDataSourceWithBuffer": Alias(
        "--data-source-path", "slime.data.source.RolloutDataSource"),
    "slime.rollout.data_source.RolloutDataSource": Alias("--data-source-path", "slime.data.source.RolloutDataSource"),
    "slime.rollout.data_source.pop_first": Alias("--buffer-filter-path", _COMPAT + "pop_first"),
}

GENERIC_FLAG = "--custom-function-path"  # load_function's default: callers that name no flag


def resolve(path: str, flag: str) -> tuple[str, Alias] | None:
    """(this project's dotted path, the alias) for an aliased original-slime path; None for any
    other path. A refused path, or an alias given to another flag than its own, raises
    SlimeConfigError with one line naming the flag and the path."""
    alias = ALIASES.get(path)
    if alias is None:
        return None
    if flag not in (alias.flag, GENERIC_FLAG):
        raise SlimeConfigError(f"{flag} {path}: original slime's {path} is a {alias.flag} function, "
                               f"not a {flag} one")
    if alias.target is None:
        raise SlimeConfigError(alias.refusal(flag, path))
    return alias.target, alias


def check_args(args) -> None:
    """Start-up checks for aliases that need other flags (for argument validation to call):
    original slime's SFT rollout needs `--loss-type sft_loss`."""
    path = getattr(args, "rollout_function_path", None)
    if path == "slime.rollout.sft_rollout.generate_rollout" and getattr(args, "loss_type", None) != "sft_loss":
        raise SlimeConfigError(f"--rollout-function-path {path}: SFT here is --loss-type sft_loss; add it")
