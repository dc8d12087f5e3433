"""Prompt datasets: JSONL or Parquet rows -> tokenized prompts.

A row's prompt (under `--input-key`) is a string or a list of chat messages
(`{"role": ..., "content": ...}`); with `--apply-chat-template` it is rendered by
the tokenizer's chat template (a string becomes one user message), with the template variables of
`--apply-chat-template-kwargs` (e.g. `{"enable_thinking": false}`). The label
(`--label-key`) and metadata (`--metadata-key`, a dict) travel with the sample.
With `--multimodal-keys '{"image": COLUMN}'` a row's images (slime.data.images) go into the
prompt's image slots. Every error names the file and the line (JSONL) or row (Parquet) and the field.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import pyarrow.parquet as pq

from slime.data.images import RowImages
from slime.utils.errors import DataError

logger = logging.getLogger(__name__)


@dataclass
class Prompt:
    prompt: str | list[dict[str, Any]]  # as written in the data file
    input_ids: list[int]  # the tokenized prompt the engine continues
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    where: str = ""  # "file:line" for messages
    images: list[str] | None = None  # --multimodal-keys: the image sources, in slot order


def read_rows(path: Path) -> Iterator[tuple[str, dict]]:
    """Yield (location, row) pairs; location is `file:line` (JSONL) or `file row N` (Parquet)."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        try:
            table = pq.read_table(path)
        except Exception as e:
            raise DataError(f"{path}: cannot read Parquet file ({e})") from None
        for i, row in enumerate(table.to_pylist()):
            yield f"{path} row {i}", row
        return
    if suffix not in (".jsonl", ".json", ".ndjson"):
        raise DataError(f"{path}: unsupported prompt file type {suffix!r} (use .jsonl or .parquet)")
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
            yield where, row


def split_slice(spec: str) -> tuple[Path, slice]:
    """`data.jsonl@[10:100]` -> (Path("data.jsonl"), slice(10, 100)); a plain path -> all rows."""
    path, at, rest = spec.rpartition("@")
    if not at or not (rest.startswith("[") and rest.endswith("]")):
        return Path(spec), slice(None)
    bounds = rest[1:-1].split(":")
    try:
        if len(bounds) != 2:
            raise ValueError
        start, end = (int(b) if b.strip() else None for b in bounds)
    except ValueError:
        raise DataError(f"{spec}: bad row slice {rest!r} (use path@[start:end], e.g. data.jsonl@[0:100])") from None
    return Path(path), slice(start, end)


def count_rows(path: str | Path) -> int:
    """Number of rows in a prompt file (after its `@[start:end]` slice), without tokenizing."""
    path, rows = split_slice(str(path))
    if path.suffix.lower() == ".parquet":
        n = pq.ParquetFile(path).metadata.num_rows
    else:
        with open(path, encoding="utf-8") as f:
            n = sum(1 for line in f if line.strip())
    return len(range(n)[rows])


def check_messages(where: str, key: str, messages: list) -> None:
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise DataError(
                f"{where}: field {key!r} message {i} must be an object with string 'role' and 'content', got {m!r}"
            )


def render_prompt(tokenizer, prompt: str | list[dict], apply_chat_template: bool, tools: list | None = None,
                  chat_template_kwargs: dict | None = None) -> str:
    """The text the model continues: the chat template's rendering (with the row's tool schemas,
    `--tool-key`, when it has them, and the variables of `--apply-chat-template-kwargs`), or the raw string."""
    if apply_chat_template:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        kwargs = {**(chat_template_kwargs or {}), **({"tools": tools} if tools else {})}
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    assert isinstance(prompt, str)
    return prompt


def row_fields(where: str, row: dict, input_key: str, label_key: str | None, metadata_key: str | None,
               apply_chat_template: bool, tool_key: str | None) -> tuple[Any, Any, dict, list | None]:
    """(prompt, label, metadata, tool schemas) of one row, checked: a DataError names the place
    (`file:line`), the field and its flag."""
    if input_key not in row:
        raise DataError(f"{where}: missing field {input_key!r} (--input-key); row has {sorted(row)}")
    prompt = row[input_key]
    if isinstance(prompt, list):
        check_messages(where, input_key, prompt)
        if not apply_chat_template:
            raise DataError(f"{where}: field {input_key!r} is a list of chat messages; pass --apply-chat-template")
    elif not isinstance(prompt, str):
        raise DataError(f"{where}: field {input_key!r} must be a string or a list of chat messages")
    label = None
    if label_key is not None:
        if label_key not in row:
            raise DataError(f"{where}: missing field {label_key!r} (--label-key); row has {sorted(row)}")
        label = row[label_key]
    metadata = row.get(metadata_key) if metadata_key else None
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict):
        raise DataError(f"{where}: field {metadata_key!r} (--metadata-key) must be an object")
    tools = None
    if tool_key is not None and row.get(tool_key) is not None:
        tools = row[tool_key]
        if not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise DataError(f"{where}: field {tool_key!r} (--tool-key) must be a list of tool schemas (objects)")
        if not apply_chat_template:
            raise DataError(f"{where}: field {tool_key!r} (--tool-key) needs --apply-chat-template")
        metadata = {**metadata, "tools": tools}
    return prompt, label, metadata, tools


def check_prompt_file(spec: str, input_key: str, label_key: str | None, metadata_key: str | None,
                      apply_chat_template: bool, tool_key: str | None) -> None:
    """Every row of a prompt file (and `@[start:end]` slice) read and checked as `load_prompts`
    checks it, without a tokenizer: bad data fails at start-up, before Ray or an engine starts."""
    path, rows = split_slice(str(spec))
    if not path.is_file():
        raise DataError(f"{path}: prompt file does not exist")
    for where, row in list(read_rows(path))[rows]:
        row_fields(where, row, input_key, label_key, metadata_key, apply_chat_template, tool_key)


def load_prompts(
    path: str | Path,
    tokenizer,
    input_key: str,
    label_key: str | None = None,
    metadata_key: str | None = "metadata",
    apply_chat_template: bool = False,
    max_prompt_len: int | None = None,
    tool_key: str | None = None,
    chat_template_kwargs: dict | None = None,
    multimodal_keys: dict | None = None,
) -> list[Prompt]:
    """Read and tokenize every row; prompts over `max_prompt_len` tokens are dropped with a counted warning.

    `path` may end in a row slice, `data.jsonl@[start:end]` (Python slice bounds, either may be
    omitted or negative), to use part of a file. A row's `tool_key` field (a list of tool schemas)
    goes to the chat template and into the sample's metadata as `tools`; `chat_template_kwargs`
    (`--apply-chat-template-kwargs`) are the chat template's keyword arguments. `multimodal_keys`
    (`--multimodal-keys`, {"image": column}): the row's images go into the prompt (slime.data.images).
    """
    path, rows = split_slice(str(path))
    if not path.is_file():
        raise DataError(f"{path}: prompt file does not exist")
    row_images = RowImages(tokenizer, multimodal_keys, path) if multimodal_keys else None
    prompts: list[Prompt] = []
    too_long = 0
    for where, row in list(read_rows(path))[rows]:
        prompt, label, metadata, tools = row_fields(where, row, input_key, label_key, metadata_key,
                                                    apply_chat_template, tool_key)
        images = row_images.sources(where, row) if row_images else None
        shown = row_images.place(where, prompt, len(images), apply_chat_template) if images else prompt
        text = render_prompt(tokenizer, shown, apply_chat_template, tools, chat_template_kwargs)
        if images:
            input_ids = row_images.encode(where, text, images)
        else:
            input_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if not input_ids:
            raise DataError(f"{where}: field {input_key!r} is empty after tokenization")
        if max_prompt_len is not None and len(input_ids) > max_prompt_len:
            too_long += 1
            continue
        prompts.append(Prompt(prompt=prompt, input_ids=input_ids, label=label, metadata=metadata, where=where,
                              images=images or None))
    if too_long:
        logger.warning("%s: dropped %d prompts longer than --rollout-max-prompt-len %s", path, too_long, max_prompt_len)
    if not prompts:
        raise DataError(f"{path}: no usable prompts" + (f" ({too_long} over --rollout-max-prompt-len)" if too_long else ""))
    return prompts
