"""SFT data (`--loss-type sft_loss`): chat conversations -> Samples whose loss mask covers the assistant turns.

A row of `--prompt-data` holds a list of chat messages under `--input-key` (system, user,
assistant, tool, ... in any order, at least one assistant message, not first). The
conversation is rendered with the tokenizer's chat template *incrementally*: the text
before each assistant turn (with the generation prompt) and after it, then after every
other message. Each rendering must extend the previous one; only the new text is
tokenized, so earlier turns are never re-tokenized differently, and the tokens of each
assistant turn are exactly the template's text for it (its content plus the end-of-turn
tokens). The loss mask is 1 on those tokens and 0 on everything else (system, user and
tool turns, role headers).

The sample's "prompt" is everything before the first assistant token; the "response" is
the rest of the conversation (later user/tool turns included, with mask 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slime.data.dataset import check_messages, read_rows
from slime.types import Sample, SampleStatus
from slime.utils.errors import DataError


@dataclass
class Conversation:
    messages: list[dict[str, Any]]
    tokens: list[int]
    loss_mask: list[int]  # one entry per token of `tokens`
    metadata: dict[str, Any] = field(default_factory=dict)
    where: str = ""

    @property
    def prompt_length(self) -> int:
        """Tokens before the first assistant (mask-1) token."""
        return self.loss_mask.index(1)


def tokenize_conversation(tokenizer, messages: list[dict[str, Any]], where: str = "") -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of a conversation; the mask is 1 exactly on assistant-turn tokens.

    See the module docstring. Raises DataError (naming `where`) when the chat template does
    not render the conversation's prefixes as prefixes of each other (e.g. a template that
    rewrites earlier assistant turns), or when there is no assistant message to learn from.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{where}: --loss-type sft_loss renders conversations with the tokenizer's chat template, "
                        "and this tokenizer has none")
    roles = [m["role"] for m in messages]
    if "assistant" not in roles:
        raise DataError(f"{where}: the conversation has no assistant message to train on")
    if roles[0] == "assistant":
        raise DataError(f"{where}: the conversation starts with an assistant message (nothing to condition on)")

    tokens: list[int] = []
    mask: list[int] = []
    rendered = ""

    def extend(k: int, generation_prompt: bool, value: int) -> None:
        nonlocal rendered
        text = tokenizer.apply_chat_template(messages[:k], tokenize=False, add_generation_prompt=generation_prompt)
        if not text.startswith(rendered):
            raise DataError(f"{where}: the chat template is not prefix-stable (the rendering of the first {k} "
                            "messages does not extend the rendering before it), so the turns cannot be masked "
                            "without re-tokenizing; use a template that keeps earlier turns unchanged")
        delta = text[len(rendered):]
        ids = tokenizer(delta, add_special_tokens=False)["input_ids"] if delta else []
        tokens.extend(ids)
        mask.extend([value] * len(ids))
        rendered = text

    for i, role in enumerate(roles):
        if role == "assistant":
            extend(i, True, 0)  # the turn header ("<|im_start|>assistant\n")
            extend(i + 1, False, 1)  # the content and the end-of-turn tokens
        else:
            extend(i + 1, False, 0)
    if 1 not in mask:
        raise DataError(f"{where}: the assistant messages render to no tokens")
    if mask[0] == 1:
        raise DataError(f"{where}: no token precedes the first assistant token")
    return tokens, mask


def load_conversations(path: str | Path, tokenizer, input_key: str, metadata_key: str | None = "metadata"
                       ) -> list[Conversation]:
    """Read and tokenize every row of a JSONL/Parquet file of chat conversations."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: SFT data file does not exist")
    out = []
    for where, row in read_rows(path):
        if input_key not in row:
            raise DataError(f"{where}: missing field {input_key!r} (--input-key); row has {sorted(row)}")
        messages = row[input_key]
        if not isinstance(messages, list):
            raise DataError(f"{where}: field {input_key!r} must be a list of chat messages for --loss-type sft_loss")
        check_messages(where, input_key, messages)
        metadata = (row.get(metadata_key) if metadata_key else None) or {}
        tokens, mask = tokenize_conversation(tokenizer, messages, where)
        out.append(Conversation(messages=messages, tokens=tokens, loss_mask=mask, metadata=metadata, where=where))
    if not out:
        raise DataError(f"{path}: no conversations")
    return out


def conversation_sample(c: Conversation) -> Sample:
    """A conversation as a Sample: the tokens before the first assistant token are the prompt, the rest
    the response, masked to the assistant turns; no reward (index and group index are set per rollout)."""
    p = c.prompt_length
    return Sample(prompt=c.messages, metadata=dict(c.metadata), tokens=list(c.tokens), response_length=len(c.tokens) - p,
                  loss_mask=list(c.loss_mask[p:]), status=SampleStatus.COMPLETED)
