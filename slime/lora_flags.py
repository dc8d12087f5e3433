"""LoRA flags (`--lora-rank` and friends) and their start-up checks (docs/lora.md).

LoRA trains low-rank adapters on top of a frozen base model (peft's `LoraConfig` on the fsdp
backend). `validate_lora(args)` runs at parse time, before anything starts, and gives one line for
each bad input: a rank below 1, a `--target-modules` name that matches no linear layer of the model
(the line lists the model's linear layer names), an adapter directory that is not peft's LoRA format
or does not fit `--hf-checkpoint`'s model. It derives:

- `args.lora_rank`, `args.lora_alpha`, `args.target_modules`: from the flags, or from the adapter's
  `adapter_config.json` with `--lora-adapter-path` (a flag given with another value is an error);
- `args.lora_sync`: `adapter` (the engines hold the base once and receive only the adapter) when the
  engine kind serves LoRA adapters (and, with `--fully-async`, can swap one under paused requests:
  the native engine), else `merged` (full merged weights); `--lora-sync` overrides.

The model's module names are read from a model built on the `meta` device (no memory, no weights).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from slime.utils.errors import SlimeConfigError

LORA_SYNC_MODES = ("auto", "merged", "adapter")
ALL_LINEAR = "all-linear"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def add_lora_flags(p) -> None:
    g = p.add_argument_group("LoRA (docs/lora.md)")
    g.add_argument("--lora-rank", type=int, default=None,
                   help="train rank-r LoRA adapters on a frozen base (peft) instead of every parameter")
    g.add_argument("--lora-alpha", type=float, default=None,
                   help="LoRA scaling numerator: the update is (alpha / rank) * B A (default 2 x rank)")
    g.add_argument("--lora-dropout", type=float, default=0.0, help="dropout on the adapters' input while training")
    g.add_argument("--target-modules", nargs="+", default=None,
                   help=f"the linear layers that get adapters, by module name (q_proj v_proj ...) or "
                        f"'{ALL_LINEAR}' (every linear layer but the output layer; the default)")
    g.add_argument("--lora-adapter-path", default=None,
                   help="start from this peft LoRA adapter directory (adapter_config.json + "
                        "adapter_model.safetensors); rank, alpha and target modules come from it")
    g.add_argument("--lora-sync", choices=LORA_SYNC_MODES, default="auto",
                   help="how weights reach the engines: adapter (only the adapter tensors; the engines "
                        "hold the base once), merged (base + adapter merged into full weights, for engines "
                        "without LoRA), auto (adapter where the engine kind serves LoRA)")


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise SlimeConfigError(message)


def validate_lora(args, kind) -> None:
    """The LoRA flags (see the module docstring). `kind`: the run's engine kind
    (`slime.engines.kinds.EngineKind`), whether it serves adapters and swaps them under a pause."""
    args.lora = args.lora_rank is not None or args.lora_adapter_path is not None
    args.lora_use_rslora, args.lora_adapter_base = False, None
    if not args.lora:
        others = [f for f, v in (("--lora-alpha", args.lora_alpha), ("--target-modules", args.target_modules))
                  if v is not None]
        others += ["--lora-dropout"] if args.lora_dropout else []
        others += ["--lora-sync"] if args.lora_sync != "auto" else []
        _require(not others, f"{others[0]} needs --lora-rank R (or --lora-adapter-path DIR)" if others else "")
        args.lora_sync = None
        return
    _require(args.ref_load is None, "--ref-load with LoRA: the KL reference is the base with the adapter switched "
                                    "off (no second model); leave --ref-load out")
    _require(args.train_backend == "fsdp",
             "--lora-rank: LoRA is built on the fsdp backend (peft); --train-backend megatron does not train "
             "adapters yet")
    if args.lora_adapter_path is not None:
        _from_adapter(args)
    _require(args.lora_rank >= 1, f"--lora-rank must be >= 1 (the adapters' rank; leave the flag out to train "
                                  f"every parameter), got {args.lora_rank}")
    if args.lora_alpha is None:
        args.lora_alpha = 2.0 * args.lora_rank
    _require(args.lora_alpha > 0, f"--lora-alpha must be > 0, got {args.lora_alpha}")
    _require(0 <= args.lora_dropout < 1, f"--lora-dropout must be in [0, 1), got {args.lora_dropout}")
    args.target_modules = list(args.target_modules or [ALL_LINEAR])
    _require(ALL_LINEAR not in args.target_modules or len(args.target_modules) == 1,
             f"--target-modules: '{ALL_LINEAR}' stands alone (got {' '.join(args.target_modules)})")
    _check_targets(args)
    # --fully-async swaps weights under paused requests, which SGLang and vLLM cannot do with an adapter
    adapter_ok = kind.serves_lora_adapters and (kind.swaps_lora_under_pause or not args.fully_async)
    if args.lora_sync == "auto":
        args.lora_sync = "adapter" if adapter_ok else "merged"
    elif args.lora_sync == "adapter":
        _require(adapter_ok, f"--lora-sync adapter: --rollout-backend {args.rollout_backend} "
                             + ("cannot swap an adapter under paused requests (--fully-async)"
                                if kind.serves_lora_adapters else "does not serve LoRA adapters")
                             + "; use --lora-sync merged")


def _from_adapter(args) -> None:
    """Rank, alpha and targets from a peft adapter directory; a flag given with another value is an error."""
    path = Path(args.lora_adapter_path)
    cfg_file = path / ADAPTER_CONFIG
    _require(cfg_file.is_file(), f"--lora-adapter-path {path}: no {ADAPTER_CONFIG} (a directory written by peft's "
                                 f"save_pretrained)")
    _require((path / ADAPTER_WEIGHTS).is_file(), f"--lora-adapter-path {path}: no {ADAPTER_WEIGHTS}")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise SlimeConfigError(f"--lora-adapter-path {cfg_file}: not JSON ({e})") from None
    _require(cfg.get("peft_type") == "LORA", f"--lora-adapter-path {cfg_file}: peft_type is "
                                             f"{cfg.get('peft_type')!r}, not 'LORA'")
    for key, ok in (("use_dora", False), ("fan_in_fan_out", False)):
        _require(not cfg.get(key), f"--lora-adapter-path {cfg_file}: {key} true is not supported")
    _require(cfg.get("bias", "none") == "none", f"--lora-adapter-path {cfg_file}: bias {cfg.get('bias')!r} is not "
                                                f"supported (only 'none')")
    _require(not cfg.get("modules_to_save"), f"--lora-adapter-path {cfg_file}: modules_to_save "
                                             f"{cfg.get('modules_to_save')} is not supported (adapters only)")
    targets = cfg.get("target_modules")
    targets = [targets] if isinstance(targets, str) else sorted(targets or [])
    for flag, given, value in (("--lora-rank", args.lora_rank, int(cfg.get("r", 0))),
                               ("--lora-alpha", args.lora_alpha, float(cfg.get("lora_alpha", 0))),
                               ("--target-modules", sorted(args.target_modules) if args.target_modules else None,
                                targets)):
        _require(given is None or given == value, f"{flag} {given} differs from the adapter's {value} "
                                                  f"({cfg_file}); leave the flag out to use the adapter's")
    args.lora_rank, args.lora_alpha = int(cfg.get("r", 0)), float(cfg.get("lora_alpha", 0))
    args.target_modules = targets
    args.lora_use_rslora = bool(cfg.get("use_rslora"))
    args.lora_adapter_base = cfg.get("base_model_name_or_path")


def meta_model(hf_checkpoint: str):
    """The checkpoint's causal LM built on the meta device (module names and shapes, no weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM  # here: only a LoRA run's checks need them

    config = AutoConfig.from_pretrained(hf_checkpoint)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def linear_layers(model) -> dict[str, torch.nn.Linear]:
    """{module name: layer} of every nn.Linear but the output layer (peft's 'all-linear')."""
    head = model.get_output_embeddings()
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head}


def _check_targets(args) -> None:
    model = meta_model(args.hf_checkpoint)
    layers = linear_layers(model)
    leaf_names = sorted({n.rsplit(".", 1)[-1] for n in layers})
    if args.target_modules != [ALL_LINEAR]:
        for t in args.target_modules:
            _require(any(n == t or n.endswith("." + t) for n in layers),
                     f"--target-modules {t}: no linear layer of {args.hf_checkpoint} has that name; its linear "
                     f"layers are {' '.join(leaf_names)} (or give {ALL_LINEAR})")
    if args.lora_adapter_path is not None:
        _check_adapter_shapes(args, layers)


def _check_adapter_shapes(args, layers: dict) -> None:
    """Every tensor of the adapter belongs to a linear layer of the model and fits its shape."""
    path = Path(args.lora_adapter_path) / ADAPTER_WEIGHTS
    base = f" (the adapter was trained on {args.lora_adapter_base})" if args.lora_adapter_base else ""
    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
            shape = tuple(f.get_slice(key).get_shape())
            module, _, part = key.removeprefix(PEFT_PREFIX).rpartition(".lora_")
            layer = layers.get(module)
            _require(key.startswith(PEFT_PREFIX) and part in ("A.weight", "B.weight") and layer is not None,
                     f"--lora-adapter-path {path}: {key} is not a LoRA weight of a linear layer of "
                     f"--hf-checkpoint {args.hf_checkpoint}{base}")
            want = (args.lora_rank, layer.in_features) if part == "A.weight" else (layer.out_features, args.lora_rank)
            _require(shape == want, f"--lora-adapter-path {path}: {key} has shape {list(shape)}, but "
                                    f"--hf-checkpoint {args.hf_checkpoint}'s {module} needs {list(want)}{base}")
