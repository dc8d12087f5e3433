"""Reading a YAML settings file that a flag names, with one-line errors naming the file, the line and
the field: `--sglang-config`, `--eval-config`, `--mcp-config` (and any such file to come).

    doc = YamlFile.load("--eval-config", path)          # missing file / bad YAML: one line
    doc.data                                             # plain Python (dicts, lists, scalars)
    doc.keys(("eval", "datasets", 0), entry, KNOWN)      # an unknown key: "did you mean ...?"
    doc.fail(("eval", "datasets", 0, "temperature"), "must be >= 0, got -1")

A field is a tuple of keys and list indices; it is written `eval.datasets[0].temperature`, and the
message names the line where that field (or the closest enclosing one) is in the file:
`--eval-config evals.yaml:7: eval.datasets[0].temperature: must be >= 0, got -1`.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Iterable, NoReturn

import yaml

from slime.utils.errors import SlimeConfigError

Field = tuple


def field_name(field: Field) -> str:
    """`("eval", "datasets", 0, "top_p")` -> `eval.datasets[0].top_p`; `()` -> `(top level)`."""
    out = ""
    for part in field:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def suggestion(key, known: Iterable[str]) -> str:
    """` (did you mean X?)` for the known name closest to `key`, else `; known: a, b, c`."""
    known = list(known)
    close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else f"; known: {', '.join(known)}"


def _lines(node, field: Field, out: dict) -> None:
    out[field] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            key = k.value if isinstance(k, yaml.ScalarNode) else None
            if key is not None:
                out[field + (key,)] = k.start_mark.line + 1
                _lines(v, field + (key,), out)
                out[field + (key,)] = k.start_mark.line + 1  # the key's line, not its value's
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _lines(item, field + (i,), out)


def yaml_problem(e: yaml.YAMLError) -> tuple[int | None, str]:
    """The line (1-based; None where the parser gives none) and the reason of a YAML parse error."""
    if isinstance(e, yaml.MarkedYAMLError):
        mark = e.problem_mark or e.context_mark
        return (mark.line + 1 if mark is not None else None), f"{e.problem or e.context}"
    return None, str(e).splitlines()[0]


def read_text(flag: str, path: str) -> str:
    """The text of the file `flag` names; a missing or unreadable file is one line."""
    file = Path(path)
    if not file.is_file():
        raise SlimeConfigError(f"{flag}: file {path} does not exist")
    try:
        return file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise SlimeConfigError(f"{flag}: cannot read {path} ({e})") from None


class YamlFile:
    """A parsed YAML file and the line of each of its fields."""

    def __init__(self, flag: str, path: str, data, lines: dict):
        self.flag, self.path, self.data, self._lines = flag, str(path), data, lines

    @classmethod
    def load(cls, flag: str, path: str) -> "YamlFile":
        """Read `path` (named by `flag`); a missing or unreadable file, or malformed YAML, is one line."""
        loader = yaml.SafeLoader(read_text(flag, path))
        try:
            node = loader.get_single_node()
            data = loader.construct_document(node) if node is not None else None
        except yaml.YAMLError as e:
            line, why = yaml_problem(e)
            at = f" (line {line})" if line is not None else ""
            raise SlimeConfigError(f"{flag} {path}: not valid YAML{at}: {why}") from None
        finally:
            loader.dispose()
        lines: dict = {}
        if node is not None:
            _lines(node, (), lines)
        return cls(flag, path, data, lines)

    def line(self, field: Field) -> int | None:
        """The line of `field`, or of the closest enclosing field the file has."""
        field = tuple(field)
        while field and field not in self._lines:
            field = field[:-1]
        return self._lines.get(field)

    def where(self, field: Field = ()) -> str:
        line = self.line(field)
        return f"{self.flag} {self.path}" + (f":{line}" if line is not None else "")

    def fail(self, field: Field, message: str) -> NoReturn:
        raise SlimeConfigError(f"{self.where(field)}: {field_name(field)}: {message}")

    def keys(self, field: Field, entry: dict, known: Iterable[str]) -> None:
        """Every key of the mapping `entry` (at `field`) is one of `known`, or a one-line error."""
        known = tuple(known)
        for key in entry:
            if key not in known:
                self.fail(tuple(field) + (key,), "unknown field" + suggestion(key, known))

    def mapping(self, field: Field, value, what: str) -> dict:
        if not isinstance(value, dict):
            self.fail(field, f"must be a mapping of {what}, got {_kind(value)}")
        return value


def _kind(value) -> str:
    if value is None:
        return "nothing"
    if isinstance(value, list):
        return "a list"
    return f"{type(value).__name__} {value!r}"
