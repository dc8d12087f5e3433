"""Evaluation flags: the eval sets (`--eval-prompt-data NAME PATH ...` or `--eval-config FILE`), when
to evaluate, and each set's settings (docs/custom_rollout.md, "Evaluation").

`--eval-config` is original slime's YAML file of per-dataset settings (its field names):

    eval:
      defaults:                      # every dataset's, unless it sets its own
        max_response_len: 1024
        top_p: 0.7
      datasets:                      # a list (each with `name`), or a mapping keyed by name
        - name: aime
          path: /data/aime.jsonl     # JSONL or Parquet; `path@[start:end]` takes a slice of the rows
          rm_type: deepscaler
          n_samples_per_eval_prompt: 16
        - name: gsm8k
          path: /data/gsm8k.jsonl
          input_key: question
          label_key: answer
          temperature: 0.0

The top-level `eval:` may be left out (the file is then that mapping). A dataset's field comes from,
first to last: the dataset's entry, `eval.defaults`, the command line (`--eval-temperature`,
`--eval-top-p`, `--eval-top-k`, `--eval-max-response-len`, `--n-samples-per-eval-prompt`, `--input-key`,
...), and the rollout's flags (`--rollout-temperature`, ...). `validate_eval` reads and checks the
file at parse time: an unknown field (with the closest known one), a value of the wrong type or
range, a missing data file, a reward or function path that does not import is one line naming the
file, its line and the field. The result is `args.eval_datasets` (one `EvalDataset` per set) and
`args.eval_sets` ({name: path}).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field, fields
from typing import Any

from slime.data.dataset import split_slice
from slime.utils.errors import SlimeConfigError
from slime.utils.hooks import load_function
from slime.utils.reward_names import RM_TYPES
from slime.utils.yaml_fields import YamlFile

EVAL_CONFIG_FLAG = "--eval-config"
# original slime's fields that this build does not act on: refused with a line saying so, not ignored
NOT_BUILT = ("multimodal_keys", "apply_chat_template", "apply_chat_template_kwargs", "min_new_tokens",
             "repetition_penalty", "skip_special_tokens", "no_stop_trim", "app_service", "eval_task_timeout",
             "min_eval_samples", "eval_early_stop_remaining", "eval_early_stop_idle_timeout", "message_processor",
             "reward_model", "remote_environment")


def add_eval_flags(p) -> None:
    g = p.add_argument_group("evaluation (docs/custom_rollout.md#evaluation)")
    g.add_argument("--eval-prompt-data", nargs="+", default=None,
                   help="NAME PATH [NAME PATH ...] (a single PATH is named 'eval')")
    g.add_argument(EVAL_CONFIG_FLAG, default=None, metavar="PATH",
                   help="YAML file of eval sets with their own settings (original slime's format: eval: {defaults: "
                        "{...}, datasets: [{name, path, input_key, label_key, temperature, top_p, top_k, "
                        "max_response_len, n_samples_per_eval_prompt, rm_type, custom_rm_path, ...}]}); "
                        "instead of --eval-prompt-data")
    g.add_argument("--eval-interval", type=int, default=None)
    g.add_argument("--skip-eval-before-train", action="store_true",
                   help="do not evaluate the initial weights (eval runs before training by default)")
    g.add_argument("--n-samples-per-eval-prompt", type=int, default=1)
    g.add_argument("--eval-temperature", type=float, default=None, help="default: --rollout-temperature")
    g.add_argument("--eval-top-p", type=float, default=None, help="default: --rollout-top-p")
    g.add_argument("--eval-top-k", type=int, default=None, help="default: --rollout-top-k")
    g.add_argument("--eval-max-response-len", type=int, default=None, help="default: --rollout-max-response-len")


@dataclass(frozen=True)
class EvalDataset:
    """One eval set and its resolved settings (module docstring). `rm_type` / `custom_rm_path` /
    `custom_generate_function_path` are None where the set uses the run's own."""

    name: str
    path: str
    input_key: str = "input"
    label_key: str | None = None
    metadata_key: str | None = None
    tool_key: str | None = None
    n_samples_per_eval_prompt: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_response_len: int = 1024
    stop: tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] | None = None
    rm_type: str | None = None
    custom_rm_path: str | None = None
    custom_generate_function_path: str | None = None
    metadata_overrides: dict = field(default_factory=dict)

    @property
    def own_reward(self) -> bool:
        return self.rm_type is not None or self.custom_rm_path is not None

    def args_view(self, args) -> argparse.Namespace:
        """The run's args as this set's evaluation sees them (the generate function, the reward and
        the sampling parameters read them): its sampling settings as the `--eval-*` values, its stop
        strings, data keys, samples per prompt, and its own reward or generate function when it has one."""
        view = argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "_frozen"})
        view.eval_temperature, view.eval_top_p, view.eval_top_k = self.temperature, self.top_p, self.top_k
        view.eval_max_response_len = self.max_response_len
        view.rollout_stop = list(self.stop) if self.stop else None
        view.rollout_stop_token_ids = list(self.stop_token_ids) if self.stop_token_ids else None
        view.n_samples_per_eval_prompt = self.n_samples_per_eval_prompt
        view.input_key, view.label_key = self.input_key, self.label_key
        view.metadata_key, view.tool_key = self.metadata_key, self.tool_key
        if self.own_reward:
            view.reward_functions = view.reward_weights = None
            view.custom_rm_path = self.custom_rm_path
            view.rm_type = self.rm_type or args.rm_type
        if self.custom_generate_function_path is not None:
            view.custom_generate_function_path = self.custom_generate_function_path
        return view


FIELDS = tuple(f.name for f in fields(EvalDataset))
DEFAULT_FIELDS = tuple(f for f in FIELDS if f not in ("name", "path"))
# a field's value when neither the dataset nor eval.defaults set it: the attribute of args
FROM_ARGS = {"input_key": "input_key", "label_key": "label_key", "metadata_key": "metadata_key",
             "tool_key": "tool_key", "n_samples_per_eval_prompt": "n_samples_per_eval_prompt",
             "temperature": "eval_temperature", "top_p": "eval_top_p", "top_k": "eval_top_k",
             "max_response_len": "eval_max_response_len", "stop": "rollout_stop",
             "stop_token_ids": "rollout_stop_token_ids"}


def _parse_eval_prompt_data(values: list[str] | None) -> list[tuple[str, str]]:
    if not values:
        return []
    if len(values) == 1:
        return [("eval", values[0])]
    if len(values) % 2:
        raise SlimeConfigError(f"--eval-prompt-data takes NAME PATH pairs, got {len(values)} values: {values}")
    pairs = list(zip(values[::2], values[1::2]))
    if len({n for n, _ in pairs}) != len(pairs):
        raise SlimeConfigError(f"--eval-prompt-data repeats a name: {values[::2]}")
    return pairs


def _from_args(args, name: str):
    value = getattr(args, FROM_ARGS[name])
    return tuple(value) if isinstance(value, list) else value


def validate_eval(args) -> None:
    """`args.eval_datasets` and `args.eval_sets` from --eval-prompt-data or --eval-config (after the
    --eval-* flags have their --rollout-* defaults); every data file exists. Also the eval schedule."""
    if args.eval_config is not None and args.eval_prompt_data:
        raise SlimeConfigError("--eval-config and --eval-prompt-data both name eval sets; give one (list every set "
                               "in the --eval-config file)")
    if args.eval_config is not None:
        datasets = load_eval_config(args.eval_config, args)
    else:
        datasets = []
        for name, path in _parse_eval_prompt_data(args.eval_prompt_data):
            if not split_slice(path)[0].is_file():
                raise SlimeConfigError(f"--eval-prompt-data: file {path} (set {name!r}) does not exist")
            datasets.append(EvalDataset(name=name, path=path, **{k: _from_args(args, k) for k in FROM_ARGS}))
    args.eval_datasets = tuple(datasets)
    args.eval_sets = {d.name: d.path for d in datasets}
    if (args.eval_sets or args.eval_function_path) and args.eval_interval is None:
        args.eval_interval = 1 << 30  # before training and after the last rollout only


def load_eval_config(path: str, args) -> list[EvalDataset]:
    """The datasets of an `--eval-config` file (module docstring), checked and resolved against `args`."""
    doc = YamlFile.load(EVAL_CONFIG_FLAG, path)
    root = doc.data
    if root is None:
        doc.fail((), "the file is empty; it needs `eval: {datasets: [{name: ..., path: ...}]}`")
    doc.mapping((), root, "settings (eval: {defaults, datasets})")
    at: tuple = ()
    if "eval" in root:
        doc.keys((), root, ("eval",))
        at, root = ("eval",), doc.mapping(("eval",), root["eval"], "settings (defaults, datasets)")
    doc.keys(at, root, ("defaults", "datasets") if at else ("eval", "defaults", "datasets"))
    defaults = root.get("defaults") or {}
    doc.mapping(at + ("defaults",), defaults, "dataset fields")
    _check_keys(doc, at + ("defaults",), defaults, DEFAULT_FIELDS)
    raw = root.get("datasets")
    if isinstance(raw, dict):  # keyed by name
        entries = [(at + ("datasets", name), {"name": name, **doc.mapping(at + ("datasets", name), e or {},
                                                                           "dataset fields")})
                   for name, e in raw.items()]
    elif isinstance(raw, list):
        entries = [(at + ("datasets", i), doc.mapping(at + ("datasets", i), e, "dataset fields"))
                   for i, e in enumerate(raw)]
    else:
        entries = []
    if not entries:
        doc.fail(at + ("datasets",), "required: a non-empty list of datasets, each with `name` and `path`")
    out: list[EvalDataset] = []
    for where, entry in entries:
        _check_keys(doc, where, entry, FIELDS)
        d = _dataset(doc, where, entry, defaults, at + ("defaults",), args)
        if d.name in {x.name for x in out}:
            doc.fail(where + ("name",), f"{d.name!r} is used twice; every dataset needs its own name")
        out.append(d)
    return out


def _check_keys(doc: YamlFile, where: tuple, entry: dict, known: tuple) -> None:
    for key in entry:
        if key in NOT_BUILT:
            doc.fail(where + (key,), "original slime's field, not built here (remove it)")
    doc.keys(where, entry, known)


def _dataset(doc: YamlFile, where: tuple, entry: dict, defaults: dict, defaults_at: tuple, args) -> EvalDataset:
    values: dict[str, Any] = {}
    for name in FIELDS:
        if name in entry:
            values[name] = _checked(doc, where + (name,), name, entry[name])
        elif name in defaults:
            values[name] = _checked(doc, defaults_at + (name,), name, defaults[name])
        elif name in FROM_ARGS:
            values[name] = _from_args(args, name)
    for name in ("name", "path"):
        if values.get(name) is None:
            doc.fail(where + (name,), "required")
    if not split_slice(values["path"])[0].is_file():
        doc.fail(where + ("path",), f"file {values['path']} does not exist")
    if values.get("rm_type") is not None and values.get("custom_rm_path") is not None:
        doc.fail(where + ("rm_type",), "give rm_type or custom_rm_path, not both")
    needs = {"remote_rm": ("rm_url", "--rm-url"), "reward_model": ("rm_path", "--rm-path"),
             "llm_judge": ("judge_template", "--judge-template")}.get(values.get("rm_type"))
    if needs is not None and getattr(args, needs[0]) is None:
        doc.fail(where + ("rm_type",), f"{values['rm_type']} needs {needs[1]} on the command line")
    return EvalDataset(**values)


def _checked(doc: YamlFile, at: tuple, name: str, value):
    """One field's value, checked (`at` names it in the file)."""
    def bad(message: str):
        doc.fail(at, message)

    if name in ("name", "path", "input_key"):
        if not isinstance(value, str) or not value:
            bad(f"must be a non-empty string, got {value!r}")
    elif name in ("label_key", "metadata_key", "tool_key"):
        if value is not None and (not isinstance(value, str) or not value):
            bad(f"must be a field name or null, got {value!r}")
    elif name in ("n_samples_per_eval_prompt", "max_response_len"):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            bad(f"must be an integer >= 1, got {value!r}")
    elif name == "top_k":
        if isinstance(value, bool) or not isinstance(value, int) or not (value == -1 or value >= 1):
            bad(f"must be -1 (off) or an integer >= 1, got {value!r}")
    elif name in ("temperature", "top_p"):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            bad(f"must be a number, got {value!r}")
        if name == "temperature" and value < 0:
            bad(f"must be >= 0, got {value!r}")
        if name == "top_p" and not 0 < value <= 1:
            bad(f"must be in (0, 1], got {value!r}")
        value = float(value)
    elif name == "stop":
        value = [value] if isinstance(value, str) else value
        if value is not None and (not isinstance(value, list) or not all(isinstance(s, str) and s for s in value)):
            bad(f"must be a string or a list of strings, got {value!r}")
        value = tuple(value) if value else None
    elif name == "stop_token_ids":
        if value is not None and (not isinstance(value, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)):
            bad(f"must be a list of token ids, got {value!r}")
        value = tuple(value) if value else None
    elif name == "rm_type":
        if value is not None and value not in RM_TYPES:
            bad(f"{value!r} is not a reward type; choose from {', '.join(RM_TYPES)}")
    elif name in ("custom_rm_path", "custom_generate_function_path"):
        if value is not None:
            if not isinstance(value, str):
                bad(f"must be a function path (module.fn or file.py:fn), got {value!r}")
            try:
                load_function(value, name)
            except SlimeConfigError as e:
                bad(str(e))
    elif name == "metadata_overrides":
        value = {} if value is None else value
        if not isinstance(value, dict):
            bad(f"must be a mapping (merged into each sample's metadata), got {value!r}")
    return value
