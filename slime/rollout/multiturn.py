"""Multi-turn episodes: model turns and environment turns appended to one Sample.

The response of a multi-turn Sample is everything after the prompt: the model's tokens (loss
mask 1, rollout log-probs kept) interleaved with tool results, user turns and chat-template glue
(loss mask 0). Nothing is re-tokenized: each model turn continues from the exact token ids the
sample holds, and environment text is tokenized on its own and appended.

- `env_message_tokens(tokenizer, messages, turn_ended)`: the token ids of chat messages (tool
  results, a user turn) appended after a model turn, followed by the generation prompt of the
  next assistant turn, as the tokenizer's chat template writes them.
- `env_image_tokens(tokenizer, processor, messages, images)`: the same for messages holding images
  (`{"type": "image"}` parts), each image slot expanded to its image's token count; append them with
  `sample.append_env_tokens(ids, images=images)` (docs/vlm.md#multi-turn-images).
- `parse_tool_calls(text)`: tool calls in the Hermes/Qwen/SmolLM2 format
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
- `run_tool_loop(args, sample, sampling_params, tools, ...)`: the generic loop: generate, run the
  tool calls, append their results, repeat until the model answers without a call, `--max-turns`
  model turns, or `--rollout-max-response-len` response tokens.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
from dataclasses import dataclass
from typing import Any, Callable

from slime.observability.spans import sample_span
from slime.rollout.api import context, continue_sample
from slime.types import Sample, SampleStatus

_BASE = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]


def env_message_tokens(tokenizer, messages: list[dict[str, Any]], turn_ended: bool = True,
                       add_generation_prompt: bool = True, chat_template_kwargs: dict | None = None) -> list[int]:
    """Token ids that follow a model turn when `messages` are appended to the chat.

    The chat template renders a fixed two-turn conversation with and without `messages`; the
    text after the assistant turn's end-of-turn token (the tokenizer's EOS, e.g. `<|im_end|>`) is
    what the environment adds. When the model's turn did not end with that token (it stopped on a
    stop string or a tool-call close tag), `turn_ended=False` puts the token first.
    `chat_template_kwargs`: template variables, as `--apply-chat-template-kwargs` gives the prompt's.
    """
    eos = tokenizer.eos_token
    if eos is None:
        raise ValueError("env_message_tokens needs a tokenizer with an eos_token that ends a chat turn")
    kwargs = chat_template_kwargs or {}
    base = tokenizer.apply_chat_template(_BASE, tokenize=False, **kwargs)
    full = tokenizer.apply_chat_template(_BASE + list(messages), tokenize=False,
                                         add_generation_prompt=add_generation_prompt, **kwargs)
    cut = base.rfind(eos)
    if cut < 0 or not full.startswith(base[: cut + len(eos)]):
        raise ValueError("the chat template does not end an assistant turn with the EOS token; "
                         "build the environment tokens by hand with sample.append_env_tokens")
    text = full[cut + len(eos):]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids if turn_ended else [tokenizer.convert_tokens_to_ids(eos)] + ids


def env_image_tokens(tokenizer, processor, messages: list[dict[str, Any]], images: list[str],
                     turn_ended: bool = True, chat_template_kwargs: dict | None = None) -> list[int]:
    """`env_message_tokens` of messages whose content holds image parts (`{"type": "image"}`, one per
    source of `images`, in order), each image's slot expanded to the image's token count as the data
    loader expands a prompt's (`processor`: the model's slime.utils.vision.VisionProcessor)."""
    ids = env_message_tokens(tokenizer, messages, turn_ended, chat_template_kwargs=chat_template_kwargs)
    counts = processor.tokens_per_image(processor.pixel_inputs(images)["image_grid_thw"])
    pad = processor.image_token_id
    if ids.count(pad) != len(counts):
        raise ValueError(f"the messages render {ids.count(pad)} image slots for {len(counts)} images")
    out, k = [], 0
    for t in ids:
        if t == pad:
            out += [pad] * counts[k]
            k += 1
        else:
            out.append(t)
    return out


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    error: str | None = None  # why the call could not be parsed (the model is told so)


_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every `<tool_call>{...}</tool_call>` in `text`, in order. A block that is not a JSON object
    with a string `name` (and an object `arguments`, default {}) becomes a call with `error` set."""
    calls = []
    for body in _TOOL_CALL.findall(text):
        try:
            obj = json.loads(body)
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                raise ValueError('expected {"name": ..., "arguments": {...}}')
            args = obj.get("arguments", {})
            if isinstance(args, str):
                args = json.loads(args)
            if not isinstance(args, dict):
                raise ValueError("arguments must be an object")
            calls.append(ToolCall(obj["name"], args))
        except (ValueError, json.JSONDecodeError) as e:
            calls.append(ToolCall("", {}, error=f"malformed tool call: {e}"))
    return calls


async def call_tool(tools: dict[str, Callable], call: ToolCall, timeout: float) -> str:
    """Run one tool call (sync tools run in a thread) and return its result as text; an unknown tool,
    a bad argument, an exception or a timeout becomes an error message for the model."""
    if call.error:
        return call.error
    fn = tools.get(call.name)
    if fn is None:
        return f"error: unknown tool {call.name!r} (tools: {', '.join(sorted(tools))})"
    try:
        if inspect.iscoroutinefunction(fn):
            result = await asyncio.wait_for(fn(**call.arguments), timeout)
        else:
            result = await asyncio.wait_for(asyncio.to_thread(fn, **call.arguments), timeout)
    except asyncio.TimeoutError:
        return f"error: tool {call.name!r} timed out after {timeout:g} s"
    except Exception as e:
        return f"error: {type(e).__name__}: {e}"
    return result if isinstance(result, str) else json.dumps(result)


async def run_tool_loop(args, sample: Sample, sampling_params: dict, tools: dict[str, Callable], *,
                        tokenizer=None, parse: Callable[[str], list[ToolCall]] = parse_tool_calls,
                        tool_messages: Callable[[list[ToolCall], list[str]], list[dict]] | None = None,
                        max_turns: int | None = None, tool_timeout: float = 30.0) -> Sample:
    """Alternate model turns and tool results on `sample` until the model answers without a tool
    call, or `max_turns` (default --max-turns) model turns, or --rollout-max-response-len response
    tokens (the sample is then TRUNCATED). `tool_messages(calls, results)` turns results into chat
    messages (default: one `{"role": "tool", "content": result}` each). Sets `sample.response`
    to the decoded response (tool results included) and `sample.metadata["turns"]`, `["tool_calls"]`
    and `["last_turn"]` (the text of the final model turn, where the answer usually is)."""
    tokenizer = tokenizer if tokenizer is not None else context().tokenizer
    max_turns = max_turns or args.max_turns
    budget = sampling_params.get("max_new_tokens", args.rollout_max_response_len)
    tool_messages = tool_messages or (lambda calls, results: [{"role": "tool", "content": r} for r in results])
    turns = n_calls = 0
    while turns < max_turns:
        left = budget - sample.response_length
        if left <= 0:
            sample.status = SampleStatus.TRUNCATED
            break
        params = {**sampling_params, "max_new_tokens": left}
        if params.get("sampling_seed") is not None:  # a fresh seed per turn, or every turn draws the same noise
            params["sampling_seed"] = int(params["sampling_seed"]) + turns
        out = await continue_sample(sample, params)
        turns += 1
        calls = parse(out.text)
        if out.finish_reason != "stop" or not calls or turns == max_turns:
            break
        results = []
        for c in calls:  # each call a `tool` span of the sample's timeline
            with sample_span(sample, "tool", name=c.name or "malformed"):
                results.append(await call_tool(tools, c, tool_timeout))
        n_calls += len(calls)
        ended = bool(out.output_ids) and out.output_ids[-1] == tokenizer.eos_token_id
        with sample_span(sample, "env", name="tool results"):
            ids = env_message_tokens(tokenizer, tool_messages(calls, results), turn_ended=ended,
                                     chat_template_kwargs=args.apply_chat_template_kwargs)
        if sample.response_length + len(ids) >= budget:
            sample.status = SampleStatus.TRUNCATED
            break
        sample.append_env_tokens(ids)
    sample.response = tokenizer.decode(sample.response_tokens, skip_special_tokens=False)
    sample.metadata = {**sample.metadata, "turns": turns, "tool_calls": n_calls, "last_turn": out.text}
    return sample
