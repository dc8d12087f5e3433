"""The models a run serves: `--sglang-config PATH`, original slime's YAML, for every engine kind.

Without the flag a run serves one model, the policy, on `--rollout-num-gpus` devices. With it the
file lists every served model, the policy too; each gets its own engines and its own router:

    sglang:
      - name: actor                      # the policy: starts from --hf-checkpoint, takes the trainer's weights
        server_groups:
          - worker_type: regular
            num_gpus: 2                  # two engines of one device each
      - name: teacher                    # a frozen model: its own checkpoint, never pushed to
        model_path: /models/teacher
        update_weights: false
        engine: vllm                     # this model's engine kind (default: --rollout-backend)
        server_groups:
          - worker_type: regular
            num_gpus: 1
            overrides: {max_running_requests: 64}   # its engines' flags, over the run's --sglang-*/--vllm-*

Fields (slime's): a model's `name` (required, unique), `model_path` (default --hf-checkpoint),
`update_weights` (default: true when the model starts from --hf-checkpoint), `num_gpus_per_engine`
(default --rollout-num-gpus-per-engine), `server_groups` (`engine_groups` also accepted); a group's
`worker_type`, `num_gpus`, `num_gpus_per_engine`, `overrides`. This project adds `engine`. Exactly
one model takes the trainer's weights: the policy. What this build does not serve is refused with
one line naming the file and field: prefill/decode/encoder workers (PD disaggregation),
placeholder groups, and groups of one model that differ in devices per engine or overrides.

`load_served_models` reads and checks the file at parse time; `model_args` is the view of the run's
args one served model's engines are launched with (its checkpoint, kind, engine count and flags).
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slime.utils.errors import SlimeConfigError
from slime.utils.yaml_fields import YamlFile, suggestion

POLICY_DEFAULT_NAME = "actor"  # the policy's name in a run without --sglang-config
MODEL_KEYS = ("name", "model_path", "update_weights", "num_gpus_per_engine", "server_groups", "engine_groups",
              "engine")
GROUP_KEYS = ("worker_type", "num_gpus", "num_gpus_per_engine", "overrides")
WORKER_TYPES = ("regular", "prefill", "decode", "placeholder", "encoder")
NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclass
class ServedModel:
    """One served model: `num_engines` engines of `gpus_per_engine` devices each, of engine kind
    `engine`, serving `model_path`; `overrides` are its engines' pass-through flags ({key: value},
    keys as in `--sglang-KEY` / `--vllm-KEY`)."""

    name: str
    model_path: str
    engine: str
    num_engines: int
    gpus_per_engine: int
    update_weights: bool
    overrides: dict[str, Any] = field(default_factory=dict)

    @property
    def num_gpus(self) -> int:
        return self.num_engines * self.gpus_per_engine


class _Where:
    """Error messages naming the file and the field."""

    def __init__(self, path: str):
        self.path = path

    def fail(self, field_name: str, message: str):
        raise SlimeConfigError(f"--sglang-config {self.path}: {field_name}: {message}")

    def keys(self, field_name: str, entry: dict, known: tuple[str, ...]) -> None:
        for key in entry:
            if key not in known:
                self.fail(f"{field_name}.{key}", "unknown field" + suggestion(key, known))


def _positive_int(where: _Where, field_name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        where.fail(field_name, f"must be an integer >= 1, got {value!r}")
    return value


def load_served_models(path: str, hf_checkpoint: str, default_engine: str, default_gpus_per_engine: int,
                       engine_kinds: tuple[str, ...]) -> list[ServedModel]:
    """Every model of the `--sglang-config` file at `path`, checked (see the module docstring);
    the policy is the one with `update_weights`."""
    where = _Where(path)
    doc = YamlFile.load("--sglang-config", path).data
    if not isinstance(doc, dict) or "sglang" not in doc:
        where.fail("sglang", "missing: the file is a mapping with a `sglang` list of models")
    where.keys("(top level)", doc, ("sglang",))
    entries = doc["sglang"]
    if not isinstance(entries, list) or not entries:
        where.fail("sglang", "must be a non-empty list of models")
    models = [_model(where, f"sglang[{i}]", e, hf_checkpoint, default_engine, default_gpus_per_engine, engine_kinds)
              for i, e in enumerate(entries)]
    names = [m.name for m in models]
    for i, name in enumerate(names):
        if name in names[:i]:
            where.fail(f"sglang[{i}].name", f"{name!r} is used twice; every model needs its own name")
    policies = [m.name for m in models if m.update_weights]
    if not policies:
        where.fail("sglang", "no model takes the trainer's weights; list the policy too (model_path omitted or "
                             "--hf-checkpoint, update_weights true)")
    if len(policies) > 1:
        where.fail("sglang", f"{' and '.join(policies)} both take the trainer's weights; serve the policy as one "
                             "model (more engines: a larger num_gpus) and the others with update_weights: false")
    return models


def _model(where: _Where, at: str, entry, hf_checkpoint: str, default_engine: str, default_per_engine: int,
           engine_kinds: tuple[str, ...]) -> ServedModel:
    if not isinstance(entry, dict):
        where.fail(at, f"must be a mapping of model fields, got {type(entry).__name__}")
    where.keys(at, entry, MODEL_KEYS)
    name = entry.get("name")
    if not isinstance(name, str) or not NAME_RE.match(name):
        where.fail(f"{at}.name", f"required: letters, digits, '_', '.', '-' (got {name!r})")
    model_path = entry.get("model_path") or hf_checkpoint
    if not isinstance(model_path, str):
        where.fail(f"{at}.model_path", f"must be a directory path, got {model_path!r}")
    is_policy_path = _same_path(model_path, hf_checkpoint)
    update_weights = entry.get("update_weights", is_policy_path)
    if not isinstance(update_weights, bool):
        where.fail(f"{at}.update_weights", f"must be true or false, got {update_weights!r}")
    if update_weights and not is_policy_path:
        where.fail(f"{at}.model_path", f"{model_path} is not --hf-checkpoint ({hf_checkpoint}), but the model takes "
                                       "the trainer's weights (update_weights); the policy starts from --hf-checkpoint")
    if not is_policy_path and not (Path(model_path) / "config.json").is_file():
        where.fail(f"{at}.model_path", f"{model_path} is not a Hugging Face model directory (no config.json)")
    engine = entry.get("engine", default_engine)
    if engine not in engine_kinds:
        where.fail(f"{at}.engine", f"{engine!r} is not an engine kind; choose from {', '.join(engine_kinds)}")
    if update_weights and engine != default_engine:
        where.fail(f"{at}.engine", f"the policy is served by --rollout-backend ({default_engine}); set that flag "
                                   "instead")
    model_per_engine = _positive_int(where, f"{at}.num_gpus_per_engine",
                                     entry.get("num_gpus_per_engine", default_per_engine))
    groups_key = "server_groups" if "server_groups" in entry else "engine_groups"
    groups = entry.get(groups_key)
    if not isinstance(groups, list) or not groups:
        where.fail(f"{at}.server_groups", "required: a non-empty list of server groups")
    per_engine, overrides, total = None, None, 0
    for j, g in enumerate(groups):
        gat = f"{at}.{groups_key}[{j}]"
        if not isinstance(g, dict):
            where.fail(gat, f"must be a mapping of group fields, got {type(g).__name__}")
        where.keys(gat, g, GROUP_KEYS)
        kind = g.get("worker_type")
        if kind not in WORKER_TYPES:
            where.fail(f"{gat}.worker_type", f"required: one of {', '.join(WORKER_TYPES)} (got {kind!r})")
        if kind != "regular":
            where.fail(f"{gat}.worker_type", f"{kind} is not served by this build (prefill/decode/encoder "
                                             "disaggregation and placeholder groups); use regular")
        num = _positive_int(where, f"{gat}.num_gpus", g.get("num_gpus"))
        each = _positive_int(where, f"{gat}.num_gpus_per_engine", g.get("num_gpus_per_engine", model_per_engine))
        if num % each:
            where.fail(f"{gat}.num_gpus", f"{num} is not a multiple of num_gpus_per_engine {each}")
        extra = g.get("overrides") or {}
        if not isinstance(extra, dict):
            where.fail(f"{gat}.overrides", f"must be a mapping of engine flags, got {extra!r}")
        extra = {str(k).replace("-", "_"): v for k, v in extra.items()}
        if per_engine is not None and (each, extra) != (per_engine, overrides):
            where.fail(gat, "differs from the model's first group in num_gpus_per_engine or overrides; "
                            "heterogeneous groups of one model are not served by this build")
        per_engine, overrides, total = each, extra, total + num
    for key in ("model_path", "tp_size", "tensor_parallel_size", "port", "host"):
        if key in overrides:
            where.fail(f"{at}.{groups_key}[0].overrides.{key}", "is set by slime (model_path, num_gpus_per_engine, "
                                                                "the placement); remove it")
    return ServedModel(name=name, model_path=model_path, engine=engine, num_engines=total // per_engine,
                       gpus_per_engine=per_engine, update_weights=update_weights, overrides=overrides)


def _same_path(a: str, b: str) -> bool:
    return a == b or Path(a).resolve() == Path(b).resolve()


def pass_through_key(engine: str) -> str:
    """The args attribute holding an engine kind's pass-through flags (`--vllm-*` for vLLM, else
    `--sglang-*`, which the native engine shares with SGLang)."""
    return "vllm_args" if engine == "vllm" else "sglang_args"


def model_args(args, model: ServedModel) -> argparse.Namespace:
    """The run's args as the engines of the frozen served `model` see them: its checkpoint, engine
    kind, engine count and devices, its overrides over the run's pass-through flags of its kind, its
    own router and no LoRA adapter (only the policy serves one)."""
    view = argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "_frozen"})
    key = pass_through_key(model.engine)
    setattr(view, key, {**getattr(args, key), **model.overrides})
    view.hf_checkpoint = model.model_path
    view.rollout_backend = model.engine
    view.num_engines = model.num_engines
    view.rollout_num_gpus_per_engine = model.gpus_per_engine
    view.rollout_num_gpus = model.num_gpus
    view.lora_rank = 0
    view.lora_sync = None
    view.use_rollout_routing_replay = False  # the policy's rollouts carry routed experts, not its teachers'
    view.sglang_router_ip = view.sglang_router_port = None  # an external router fronts the policy only
    return view
