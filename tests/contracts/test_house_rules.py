"""The rules of the house (../shared/DESIGN.md section 2), checked on the source itself:

- no import cycle among slime's modules, function-local imports included (a cycle is named);
- function-local imports only for the optional heavy dependencies, each with a comment, and for
  torch and transformers in the few modules that must import cheaply (CHEAP_TO_IMPORT);
- dependencies point one way: the drivers' part -> rollout / training -> engines / algorithms / data
  -> types / utils;
- an engine endpoint path is spelled only in slime/engines/, and the engine kind is decided only
  in slime/engines/kinds.py (and in argument parsing, which offers the choice).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from slime.engines.control import Route

ROOT = Path(__file__).resolve().parents[2]
SLIME = ROOT / "slime"
OPTIONAL = {"megatron", "vllm", "sglang", "wandb", "reasoning_gym", "verifiers", "openenv", "uvicorn"}
OPTIONAL_SLIME = ("slime.training.megatron.",)  # the megatron backend imports megatron-core at its top
# modules that import torch and transformers (and slime.utils.vision, which needs both) only in the
# function that uses them: every Ray actor imports the first two when it unpickles `args`
# (tests/unit/core/test_arguments.py checks that this imports neither), and every driver the third.
# The driver's imports (train.py's process) defer transformers, math-verify and the trainer's stack
# to the processes that use them (tests/unit/core/test_driver_imports.py)
CHEAP_TO_IMPORT = {"slime.data.images", "slime.script_flags", "slime.off_policy_flags",
                   "slime.argument_checks", "slime.lora_flags", "slime.utils.vision", "slime.data.source",
                   "slime.rollout.manager", "slime.rollout.rewards.llm_judge", "slime.rollout.rewards.math",
                   "slime.rollout.rewards.reward_model", "slime.training.actor", "slime.training.offload",
                   "slime.training.weight_sync.adapter", "slime.training.weight_sync.served"}
DEFERRED = {"torch", "transformers", "math_verify"}
DEFERRED_SLIME = ("slime.utils.vision", "slime.training.fsdp.backend", "slime.training.freeze", "slime.training.lora",
                  "slime.utils.checkpoint_data", "slime.utils.hf_export")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(SLIME.rglob("*.py"))}


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in ast.walk(node):
                if hasattr(sub, "lineno"):
                    lines.add(sub.lineno)
    return lines


def _imports(path: Path):
    """(imported slime module, line, local?) for every import of `path` that names a slime module."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_lines(tree)
    local_lines = {sub.lineno for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for sub in ast.walk(node) if isinstance(sub, (ast.Import, ast.ImportFrom))}
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)) or node.lineno in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module
                       for a in node.names]
        else:
            continue
        for t in targets:
            if t in MODULES:
                yield t, node.lineno, node.lineno in local_lines


GRAPH = {name: {t for t, _, _ in _imports(path) if t != name} for name, path in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    cycles = _cycles(GRAPH)
    assert not cycles, "import cycles (function-local imports included): " + "; ".join(
        " <-> ".join(c) for c in cycles)


def test_the_cycle_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_function_local_imports_only_for_optional_dependencies_with_a_comment():
    bad = []
    for name, path in MODULES.items():
        lines = path.read_text().splitlines()
        tree = ast.parse("\n".join(lines))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for sub in ast.walk(node):
                if not isinstance(sub, (ast.Import, ast.ImportFrom)):
                    continue
                mods = [a.name for a in sub.names] if isinstance(sub, ast.Import) else [sub.module or ""]
                commented = "#" in lines[sub.lineno - 1] or lines[sub.lineno - 2].strip().startswith(("#", "try:  #"))
                optional = all(m.split(".")[0] in OPTIONAL or m.startswith(OPTIONAL_SLIME) for m in mods)
                deferred = name in CHEAP_TO_IMPORT and all(m.split(".")[0] in DEFERRED or m in DEFERRED_SLIME
                                                           for m in mods)
                optional = optional or deferred
                if not optional or not commented:
                    bad.append(f"{path.relative_to(ROOT)}:{sub.lineno}: {', '.join(mods)}")
    assert not bad, "function-local imports of non-optional modules, or without a comment saying why:\n" + \
        "\n".join(bad)


# which parts may import which (a part is slime.<first name>; top-level modules are parts too)
LAYERS = {
    "slime.driver": 6, "slime.checkpoint": 5,
    "slime.rollout": 4, "slime.training": 4, "slime.ray": 4,
    "slime.arguments": 3.5, "slime.argument_checks": 3, "slime.model_flags": 2.5, "slime.lora_flags": 2.5,
    "slime.opd_flags": 2.5, "slime.moe_flags": 2.5, "slime.reward_flags": 2.5, "slime.script_flags": 2.5, "slime.config_file": 2.5,
    "slime.off_policy_flags": 2.5, "slime.eval_flags": 2.5, "slime.mcp_flags": 2.5, "slime.environment_flags": 2.5,
    "slime.engines": 2, "slime.algorithms": 2, "slime.data": 2, "slime.observability": 2, "slime.plot": 2,
    "slime.profile_flags": 2.5, "slime.timeline": 3,
    "slime.types": 1, "slime.utils": 1, "slime": 0,
}


def _part(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def test_dependencies_point_one_way():
    """A part imports only parts below it, and rollout and training never import each other (the
    driver and the Ray layer join them). slime.ray may import training (it runs the train group)."""
    bad = []
    for name, targets in GRAPH.items():
        a = _part(name)
        for t in targets:
            b = _part(t)
            if a == b:
                continue
            if LAYERS[b] >= LAYERS[a] and not (a == "slime.ray" and b in ("slime.training", "slime.rollout")):
                bad.append(f"{name} -> {t}")
    assert not bad, "imports that point up or sideways:\n" + "\n".join(sorted(bad))


def test_every_module_is_in_a_layer():
    assert {_part(m) for m in MODULES} <= set(LAYERS), {_part(m) for m in MODULES} - set(LAYERS)


PATHS = {r.path.split("{")[0].rstrip("/") for r in Route}


def _string_constants(path: Path):
    """Every string literal (f-strings by their leading literal part)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value
        elif isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
            yield node.lineno, str(node.values[0].value)


def test_endpoint_paths_are_spelled_only_in_engines():
    bad = []
    for name, path in MODULES.items():
        if name.startswith("slime.engines"):
            continue
        for line, text in _string_constants(path):
            # a literal that is (or starts with) a route's path: code that spells an endpoint (prose in
            # docstrings and help texts may name one)
            if any(re.match(re.escape(p) + r"(?![\w])", text) for p in PATHS):
                bad.append(f"{path.relative_to(ROOT)}:{line}: {text!r}")
    assert not bad, "engine endpoint paths outside slime/engines/:\n" + "\n".join(bad)


def test_the_engine_kind_is_decided_only_in_kinds():
    bad = []
    for name, path in MODULES.items():
        if name in ("slime.engines.kinds", "slime.arguments", "slime.argument_checks"):
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"rollout_backend\s*(==|!=|in\b)", line):
                bad.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not bad, "branches on the engine kind outside slime/engines/kinds.py:\n" + "\n".join(bad)


@pytest.mark.parametrize("driver", ["train.py", "train_async.py"])
def test_drivers_stay_short_and_import_no_engine(driver):
    text = (ROOT / driver).read_text()
    assert len(text.splitlines()) < 100
    assert "slime.engines" not in text
    assert not [t for t in GRAPH["slime.driver"] if t.startswith("slime.engines")]
