"""`--config run.yaml`: every flag from a YAML file, and `--print-config`.

The file is a mapping of flag names to values. A name is the flag with or without its leading
`--`, hyphens or underscores alike (`rollout-batch-size`, `rollout_batch_size`,
`--rollout-batch-size`). It becomes command-line tokens placed *before* the command line's own,
so a flag given in both places takes the command line's value (argparse keeps the last one):

- a switch (`--colocate`): `true` gives the flag, `false` or `null` leaves it out; a flag with a
  negative form (`--use-tensorboard` / `--no-use-tensorboard`) takes `false` as the negative form;
- a flag of several values (`--rollout-stop`, `--eval-prompt-data`): a list, or one value;
- `--sglang-*` / `--vllm-*` keys pass through as on the command line (`true`: the bare flag, a
  list: several values, a mapping: its JSON);
- any other value is written as argparse reads it (`str`; a mapping or nested list as JSON) and
  checked against the flag's type and choices here, so a bad value names the file and line.

Errors are one line naming the file and line: an unknown key (with the flag it probably means),
malformed YAML, a top level that is not a mapping. `dump_config` writes the flags of a parsed
command line back as such a file (`--print-config`).
"""

from __future__ import annotations

import argparse
import json

import yaml

from slime.utils.errors import SlimeConfigError
from slime.utils.flag_parsing import known_flags, similar_flag
from slime.utils.yaml_fields import read_text, yaml_problem

CONFIG_FLAG = "--config"
PRINT_FLAG = "--print-config"
COMMAND_LINE_ONLY = (CONFIG_FLAG, PRINT_FLAG, "--help")
SECRETS = ("engine_api_key", "wandb_key")  # never printed


def config_path(argv: list[str]) -> str | None:
    """The `--config PATH` of a command line (at most one), or None."""
    paths = []
    for i, tok in enumerate(argv):
        if tok == CONFIG_FLAG:
            if i + 1 == len(argv) or argv[i + 1].startswith("--"):
                raise SlimeConfigError("--config needs the path of a YAML file")
            paths.append(argv[i + 1])
        elif tok.startswith(CONFIG_FLAG + "="):
            paths.append(tok.split("=", 1)[1])
    if len(paths) > 1:
        raise SlimeConfigError(f"--config may be given once, got {len(paths)}: {' '.join(paths)}")
    return paths[0] if paths else None


def with_config(argv: list[str], parser: argparse.ArgumentParser, pass_through: tuple[str, ...]) -> list[str]:
    """`argv` with the flags of its `--config` file (if any) put in front of it."""
    path = config_path(argv)
    return argv if path is None else config_argv(path, parser, pass_through) + argv


def _line(node) -> int:
    return node.start_mark.line + 1


def config_argv(path: str, parser: argparse.ArgumentParser, pass_through: tuple[str, ...]) -> list[str]:
    """The command-line tokens the YAML file at `path` stands for."""
    loader = yaml.SafeLoader(read_text(CONFIG_FLAG, path))
    try:
        root = loader.get_single_node()
        if root is None:  # an empty file: no flags
            return []
        if not isinstance(root, yaml.MappingNode):
            kind = "a list" if isinstance(root, yaml.SequenceNode) else "a single value"
            raise SlimeConfigError(f"{path}:{_line(root)}: the top level must be a mapping of flag names to "
                                   f"values, got {kind}")
        out: list[str] = []
        seen: dict[str, int] = {}
        for key_node, value_node in root.value:
            where = f"{path}:{_line(key_node)}"
            key = loader.construct_object(key_node, deep=True)
            if not isinstance(key, str) or not key.lstrip("-"):
                raise SlimeConfigError(f"{where}: key {key!r} is not a flag name")
            flag = "--" + key.lstrip("-").replace("_", "-")
            if flag in seen:
                raise SlimeConfigError(f"{where}: {flag} is given twice (first on line {seen[flag]})")
            seen[flag] = _line(key_node)
            value = loader.construct_document(value_node)
            out += _flag_argv(flag, key, value, where, parser, pass_through)
        return out
    except yaml.YAMLError as e:
        line, why = yaml_problem(e)
        at = f":{line}" if line is not None else ""
        raise SlimeConfigError(f"{path}{at}: malformed YAML ({why})") from None
    finally:
        loader.dispose()


def _flag_argv(flag, key, value, where, parser, pass_through) -> list[str]:
    if flag in COMMAND_LINE_ONLY:
        raise SlimeConfigError(f"{where}: {flag} cannot be set in a config file (give it on the command line)")
    if flag.startswith(pass_through):
        return _pass_through_argv(flag, value, where)
    action = parser._option_string_actions.get(flag)
    if action is None:
        close = similar_flag(flag, known_flags(parser))
        raise SlimeConfigError(f"{where}: unknown key {key!r}" + (f" (did you mean {close}?)" if close else ""))
    if value is None:
        return []
    if action.nargs == 0:  # a switch
        if not isinstance(value, bool):
            raise SlimeConfigError(f"{where}: {flag} is a switch: give true or false, got {value!r}")
        if isinstance(action, argparse.BooleanOptionalAction):
            return [flag] if value else [next(s for s in action.option_strings if s != flag)]
        return [flag] if value else []
    many = action.nargs in ("+", "*") or (isinstance(action.nargs, int) and action.nargs > 1)
    if isinstance(value, list) and not many:
        raise SlimeConfigError(f"{where}: {flag} takes one value, got a list")
    items = [_text(v, flag, where) for v in (value if isinstance(value, list) else [value])]
    if not items and action.nargs != "*":
        raise SlimeConfigError(f"{where}: {flag} needs at least one value, got an empty list")
    for item in items:
        _check_value(action, flag, item, where)
    return [flag, *items] if many else [f"{flag}={items[0]}"]


def _text(value, flag: str, where: str) -> str:
    if isinstance(value, bool):
        raise SlimeConfigError(f"{where}: {flag} takes a value, not {str(value).lower()} (quote it to mean the "
                               f"word)")
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(value)


def _check_value(action: argparse.Action, flag: str, text: str, where: str) -> None:
    """What argparse would refuse, refused here with the file and line."""
    value = text
    if callable(action.type):
        try:
            value = action.type(text)
        except argparse.ArgumentTypeError as e:
            raise SlimeConfigError(f"{where}: {flag}: {e}") from None
        except (TypeError, ValueError):
            name = getattr(action.type, "__name__", "")
            raise SlimeConfigError(f"{where}: {flag}: invalid {name} value {text!r}") from None
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise SlimeConfigError(f"{where}: {flag}: invalid choice {text!r} (choose from {choices})")


def _pass_through_argv(flag: str, value, where: str) -> list[str]:
    if value is None or value is False:
        return []
    if value is True:
        return [flag]
    if isinstance(value, list):
        items = [json.dumps(v) if isinstance(v, (bool, dict, list)) else str(v) for v in value]
        if not items or any(i.startswith("--") for i in items):
            raise SlimeConfigError(f"{where}: {flag} needs a non-empty list of values (none starting with --)")
        return [flag, *items]
    return [f"{flag}={json.dumps(value) if isinstance(value, dict) else value}"]


def _yaml(value) -> str:
    """`value` as one line of YAML (flow style)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 30, allow_unicode=True, sort_keys=False)
    return text.strip().removesuffix("\n...").strip()


def _shown(action: argparse.Action, value):
    """A flag's value as the config file writes it (a switch: whether it is given)."""
    if action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction):
        return value is not None and value == action.const
    return value


def dump_config(parser: argparse.ArgumentParser, given: dict, resolved, pass_through: tuple[str, ...]) -> str:
    """The flags of a parsed command line (`given`: the namespace before validation, defaults
    included) as a `--config` file, in the parser's order; where validation derived another value
    (`resolved`), a comment says which. Secrets are left out and named in a comment."""
    primary: dict[str, argparse.Action] = {}  # one flag per destination (not --gradient-checkpointing)
    for a in parser._actions:
        if not a.option_strings or a.dest == "help":
            continue
        if a.dest not in primary or (primary[a.dest].nargs == 0 and a.nargs != 0):
            primary[a.dest] = a
    lines = ["# slime --print-config: run it with `--config FILE` (flags on the command line override it)"]
    secrets = []
    for dest, action in primary.items():
        flag = action.option_strings[0]
        if flag in COMMAND_LINE_ONLY:
            continue
        if dest in SECRETS:
            secrets += [flag] if given.get(dest) is not None else []
            continue
        value = _shown(action, given.get(dest))
        line = f"{flag[2:]}: {_yaml(value)}"
        after = _shown(action, getattr(resolved, dest, value))
        if after != value and after is not None:  # (None: the flag does not apply, e.g. --lora-sync without LoRA)
            line += f"  # resolved: {_yaml(after)}"
        lines.append(line)
    for prefix in pass_through:
        for key, value in given.get(prefix.strip("-") + "_args", {}).items():
            lines.append(f"{prefix[2:]}{key.replace('_', '-')}: {_yaml(value)}")
    if secrets:
        lines.append(f"# not printed (secrets): {', '.join(secrets)}")
    return "\n".join(lines) + "\n"
