"""LoRA adapters of the native engine (a part of `NativeEngine`), served the way SGLang names it.

`/load_lora_adapter {"lora_name", "lora_path"}` reads a peft adapter directory (what
`PeftModel.save_pretrained` writes: `adapter_config.json` + `adapter_model.safetensors`); a
`/generate` request selects it by name (`"lora_path": name`, or one name / null per prompt of a
batch). Rows of one batch may use different adapters or none.

The model is not changed: its parameter names stay the Hugging Face ones, so full-weight updates
keep working. Each targeted `nn.Linear` gets a forward hook that adds, for the rows assigned to
an adapter, `scale * (x @ A.T) @ B.T` (A = `lora_A.weight` [r, in], B = `lora_B.weight` [out, r],
`scale = lora_alpha / r`, or `lora_alpha / sqrt(r)` with `use_rslora`; no dropout). The
scheduler sets the per-row assignment just before each forward (`_lora_rows`), looking every
adapter up by name at every step: an adapter unloaded and loaded again under the same name (while
the engine is paused, say) serves the requests in flight with its new weights, and a request
whose adapter is gone ends with finish_reason abort.

Adapters live on the engine's device in its dtype; they are not parameters, so releasing and
resuming memory and full-weight updates leave them in place.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file

from slime.engines.protocol import ProtocolError, finish_abort

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_SUFFIXES = {".lora_A.weight": "A", ".lora_B.weight": "B"}
# adapter_config.json keys that, when set (truthy), change the forward in ways these hooks do not compute:
# peft's LoRA variants and the extras that train more than A and B
_UNSUPPORTED = {
    "use_dora": "DoRA adapters are not supported",
    "fan_in_fan_out": "fan_in_fan_out adapters (Conv1D layers) are not supported",
    "lora_bias": "adapters with a lora_B bias are not supported",
    "modules_to_save": "adapters with modules_to_save (fully trained extra modules) are not supported",
    "layer_replication": "layer_replication is not supported",
    "target_parameters": "target_parameters (LoRA on bare parameters) is not supported",
    "trainable_token_indices": "trainable_token_indices is not supported",
    "use_qalora": "QALoRA adapters are not supported",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
    "use_bdlora": "block-diagonal LoRA (use_bdlora) is not supported",
    "arrow_config": "Arrow routing (arrow_config) is not supported",
    "velora_config": "VeLoRA (velora_config) is not supported",
    "monteclora_config": "MonteCLoRA (monteclora_config) is not supported",
    "kasa_config": "KaSA (kasa_config) is not supported",
}


@dataclass
class LoraAdapter:
    name: str
    path: str
    base_model: str | None
    weights: dict[str, tuple[torch.Tensor, torch.Tensor, float]]  # module name -> (A, B, scale)


@dataclass
class LoraState:
    """What the hooks read: the loaded adapters and, during one forward, each adapter's rows.
    `adapters` is replaced, never changed in place, so other threads may read it without a lock."""

    adapters: dict[str, LoraAdapter] = field(default_factory=dict)
    batch: list[tuple[LoraAdapter, torch.Tensor | None]] | None = None  # None rows: every row
    hooks: dict[str, torch.utils.hooks.RemovableHandle] = field(default_factory=dict)


def _lora_hook(state: LoraState, module_name: str):
    def hook(module, args, out):
        groups = state.batch
        if not groups:
            return None
        x = args[0]
        for adapter, rows in groups:
            w = adapter.weights.get(module_name)
            if w is None:
                continue
            a, b, scale = w
            if rows is None:
                out = out + F.linear(F.linear(x, a), b) * scale
            else:
                out = out.index_add(0, rows, F.linear(F.linear(x.index_select(0, rows), a), b) * scale)
        return out

    return hook


def _refuse(path: str, message: str) -> ProtocolError:
    return ProtocolError("lora_path", f"{path}: {message}")


def _pattern_value(patterns: dict, module_name: str, default):
    """peft's rank_pattern / alpha_pattern lookup (`peft.utils.other.get_pattern_key`)."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module_name):
            return value
    return default


def read_adapter(name: str, path: str, modules: dict[str, torch.nn.Module], device: torch.device,
                 dtype: torch.dtype) -> LoraAdapter:
    """Read and check a peft LoRA directory against the model's modules; ProtocolError('lora_path')
    naming the problem when it cannot be served exactly."""
    d = Path(path)
    if not d.is_dir():
        raise _refuse(path, "is not a directory")
    cfg_file = d / CONFIG_FILE
    if not cfg_file.is_file():
        raise _refuse(path, f"has no {CONFIG_FILE} (not a peft adapter directory)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _refuse(path, f"{CONFIG_FILE} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise _refuse(path, f"{CONFIG_FILE} must hold a JSON object")
    if cfg.get("peft_type") != "LORA":
        raise _refuse(path, f"{CONFIG_FILE}: peft_type is {cfg.get('peft_type')!r}; only 'LORA' adapters are served")
    for key, why in _UNSUPPORTED.items():
        if cfg.get(key):
            raise _refuse(path, f"{CONFIG_FILE}: {key} is {cfg[key]!r}; {why}")
    if cfg.get("bias", "none") != "none":
        raise _refuse(path, f"{CONFIG_FILE}: bias is {cfg['bias']!r}; adapters that train biases are not supported "
                            "(bias must be 'none')")
    init = cfg.get("init_lora_weights")
    if isinstance(init, str) and init.startswith("mica"):
        raise _refuse(path, f"{CONFIG_FILE}: init_lora_weights is {init!r}; the MiCA variant is not supported")
    base = cfg.get("base_model_name_or_path")
    r_cfg, alpha_cfg = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(r_cfg, int) or isinstance(r_cfg, bool) or r_cfg < 1:
        raise _refuse(path, f"{CONFIG_FILE}: r must be a positive integer, got {r_cfg!r}")
    if not isinstance(alpha_cfg, (int, float)) or isinstance(alpha_cfg, bool):
        raise _refuse(path, f"{CONFIG_FILE}: lora_alpha must be a number, got {alpha_cfg!r}")
    rslora = bool(cfg.get("use_rslora", False))

    wfile = d / WEIGHTS_FILE
    if not wfile.is_file():
        found = sorted(p.name for p in d.glob("adapter_model.*"))
        hint = f" (found {', '.join(found)}: save with safe_serialization=True)" if found else ""
        raise _refuse(path, f"has no {WEIGHTS_FILE}; only safetensors adapter files are loaded{hint}")
    try:
        tensors = load_file(str(wfile))
    except (SafetensorError, OSError) as e:
        raise _refuse(path, f"{WEIGHTS_FILE} is not a safetensors file: {e}") from None

    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        kind = next((k for s, k in _SUFFIXES.items() if key.endswith(s)), None)
        if kind is None or not key.startswith(_PREFIX):
            raise _refuse(path, f"tensor {key!r} is not a LoRA weight this engine serves (only "
                                f"'{_PREFIX}<module>.lora_A.weight' / '.lora_B.weight' of nn.Linear modules)")
        mod = key[len(_PREFIX):-len(".lora_A.weight")]
        pairs.setdefault(mod, {})[kind] = t
    if not pairs:
        raise _refuse(path, f"{WEIGHTS_FILE} holds no LoRA weights")

    weights = {}
    for mod, ab in sorted(pairs.items()):
        missing = [f"lora_{k}" for k in "AB" if k not in ab]
        if missing:
            raise _refuse(path, f"module {mod!r} has no {' / '.join(missing)} weight")
        module = modules.get(mod)
        if module is None:
            raise _refuse(path, f"module {mod!r} is not in the model (adapter made for {base!r})")
        if not isinstance(module, torch.nn.Linear):
            raise _refuse(path, f"module {mod!r} is a {type(module).__name__}, not an nn.Linear")
        a, b = ab["A"], ab["B"]
        r = _pattern_value(cfg.get("rank_pattern"), mod, r_cfg)
        if (a.dim() != 2 or b.dim() != 2 or a.shape[0] != r or b.shape[1] != r
                or a.shape[1] != module.in_features or b.shape[0] != module.out_features):
            raise _refuse(path, f"module {mod!r}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit "
                                f"its nn.Linear(in={module.in_features}, out={module.out_features}) at rank {r} "
                                f"(adapter made for {base!r})")
        if not (a.is_floating_point() and b.is_floating_point()):
            raise _refuse(path, f"module {mod!r}: LoRA weights must be floating point, got {a.dtype} / {b.dtype}")
        alpha = _pattern_value(cfg.get("alpha_pattern"), mod, alpha_cfg)
        scale = float(alpha) / (math.sqrt(r) if rslora else r)
        weights[mod] = (a.to(device=device, dtype=dtype).contiguous(), b.to(device=device, dtype=dtype).contiguous(),
                        scale)
    return LoraAdapter(name=name, path=str(path), base_model=base, weights=weights)


class EngineLora:
    """Mixed into `NativeEngine`; uses its model, device, dtype and `_exclusive` lock."""

    _lora: LoraState

    def lora_adapters(self) -> dict[str, str]:
        """{name: path} of the loaded adapters."""
        return {n: a.path for n, a in self._lora.adapters.items()}

    def load_lora_adapter(self, name: str, path: str) -> dict[str, str]:
        """Load a peft LoRA directory as `name` (between scheduler steps). A name already loaded is
        refused (unload it first). Returns the loaded adapters."""
        self._check_new_lora_name(name)
        adapter = read_adapter(name, path, dict(self.model.named_modules()), self.device, self.dtype)
        with self._exclusive():
            self._check_new_lora_name(name)
            self._lora.adapters = {**self._lora.adapters, name: adapter}
            self._sync_lora_hooks()
        return self.lora_adapters()

    def unload_lora_adapter(self, name: str) -> dict[str, str]:
        """Forget the adapter `name` (between steps): requests still using it end with finish_reason
        abort at the next step unless an adapter of that name is loaded again first."""
        with self._exclusive():
            if name not in self._lora.adapters:
                raise ProtocolError("lora_name", f"no adapter named {name!r} is loaded "
                                                 f"(loaded: {self._loaded_names()})")
            self._lora.adapters = {n: a for n, a in self._lora.adapters.items() if n != name}
            self._sync_lora_hooks()
        return self.lora_adapters()

    def check_lora(self, name: str | None, field: str = "lora_path") -> None:
        """ProtocolError unless `name` is None (the base model) or a loaded adapter."""
        if name is not None and name not in self._lora.adapters:
            raise ProtocolError(field, f"adapter {name!r} is not loaded (loaded: {self._loaded_names()})")

    def _loaded_names(self) -> str:
        return ", ".join(sorted(self._lora.adapters)) or "none"

    def _check_new_lora_name(self, name: str) -> None:
        old = self._lora.adapters.get(name)
        if old is not None:
            raise ProtocolError("lora_name", f"an adapter named {name!r} is already loaded (from {old.path}); "
                                             "unload it first")

    def _sync_lora_hooks(self) -> None:
        """One hook on every module some loaded adapter targets, none elsewhere."""
        wanted = {m for a in self._lora.adapters.values() for m in a.weights}
        for m in list(self._lora.hooks):
            if m not in wanted:
                self._lora.hooks.pop(m).remove()
        modules = dict(self.model.named_modules())
        for m in wanted - set(self._lora.hooks):
            self._lora.hooks[m] = modules[m].register_forward_hook(_lora_hook(self._lora, m))

    # ---- scheduler side (worker thread, under the step lock)
    def _lora_missing(self, reqs) -> list:
        """The requests whose adapter is no longer loaded, each given finish_reason abort."""
        gone = [r for r in reqs if r.lora_name is not None and r.lora_name not in self._lora.adapters]
        for r in gone:
            r.finish = finish_abort(f"LoRA adapter {r.lora_name!r} is no longer loaded")
        return gone

    @contextlib.contextmanager
    def _lora_rows(self, names: list[str | None]):
        """During the forward of a batch whose row i uses adapter `names[i]` (None: the base model)."""
        rows: dict[str, list[int]] = {}
        for i, n in enumerate(names):
            if n is not None:
                rows.setdefault(n, []).append(i)
        if not rows:
            yield
            return
        batch = []
        for n, idx in rows.items():
            sel = None if len(idx) == len(names) else torch.tensor(idx, dtype=torch.long, device=self.device)
            batch.append((self._lora.adapters[n], sel))
        self._lora.batch = batch
        try:
            yield
        finally:
            self._lora.batch = None
