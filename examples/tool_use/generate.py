"""Tool use with a calculator (and optionally a sandboxed Python tool): a custom generate function.

    --custom-generate-function-path examples/tool_use/generate.py:generate
    --custom-rm-path examples/tool_use/reward.py:reward --reward-key score
    --custom-config-path examples/tool_use/config_tiny.yaml      (or config_hermes.yaml)

Each episode is `slime.rollout.multiturn.run_tool_loop`: the model's turns are trained on (loss mask
1), the tool results and chat-template glue between them are not (mask 0), nothing is re-tokenized.

The tool-call syntax is the `call_format` key of the --custom-config-path YAML:

- `hermes` (real models: SmolLM2, Qwen): `<tool_call>{"name": "calculator", "arguments":
  {"expression": "12 * 7"}}</tool_call>` (and `python` with `{"code": ...}` when `python_tool: true`);
  results come back as `tool` messages.
- `plain` (the tiny test model's word-level vocabulary has no JSON): the model writes the word
  `compute`, optionally followed by an expression; its turn ends at that word (a stop string) or at
  EOS. The calculator evaluates the expression after `compute`, or, when there is none, the last
  arithmetic expression of the question (a calculator's "evaluate what is on the screen"). The result
  comes back as a user message `result <value>`.

Other keys: `max_tool_calls_turns` (model turns, default --max-turns), `tool_timeout` (seconds);
`python_tool`, `python_timeout`, `python_memory_mb`, `python_sandbox` (`unsafe`: allow the Python tool
to run without the bubblewrap sandbox when there is none; by default generate refuses, see tools.py).
The episode's answer is the first number of the model's last turn; `reward.py` scores it and logs
how many tool calls succeeded (`rollout/reward/tool_calls`).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from slime.rollout.api import context
from slime.rollout.multiturn import ToolCall, parse_tool_calls, run_tool_loop
from tools import calculate, last_expression, run_python, sandbox_refusal

PLAIN_CALL = "compute"


def parse_plain(text: str) -> list[ToolCall]:
    """`compute [expression]` -> one calculator call (expression '' when none follows the word)."""
    _, found, rest = text.partition(PLAIN_CALL)
    if not found:
        return []
    return [ToolCall("calculator", {"expression": rest.strip()})]


def plain_messages(calls, results):
    return [{"role": "user", "content": f"result {r}"} for r in results]


async def generate(args, sample, sampling_params):
    fmt = getattr(args, "call_format", "hermes")
    if fmt not in ("hermes", "plain"):
        raise ValueError(f"call_format must be 'hermes' or 'plain', got {fmt!r}")
    tokenizer = context().tokenizer
    question = tokenizer.decode(sample.tokens, skip_special_tokens=True)
    ok = []  # tool calls that returned a value, not an error

    def calculator(expression: str = "") -> str:
        if not str(expression).strip() and fmt == "plain":
            expression = last_expression(question)
        result = calculate(expression)
        ok.append(not result.startswith("error"))
        return result

    tools = {"calculator": calculator}
    if getattr(args, "python_tool", False):
        sandbox = getattr(args, "python_sandbox", None)
        refusal = sandbox_refusal(sandbox)  # no sandbox and no unsafe switch: stop here, not in every episode
        if refusal:
            raise RuntimeError(refusal)

        async def python(code: str) -> str:
            result = await run_python(code, timeout=float(getattr(args, "python_timeout", 5.0)),
                                      memory_mb=int(getattr(args, "python_memory_mb", 256)), sandbox=sandbox)
            ok.append(not result.startswith("error"))
            return result

        tools["python"] = python
    params = dict(sampling_params)
    if fmt == "plain":
        params.update(stop=list(params.get("stop") or []) + [PLAIN_CALL], no_stop_trim=True)
        sample = await run_tool_loop(args, sample, params, tools, tokenizer=tokenizer, parse=parse_plain,
                                     tool_messages=plain_messages, max_turns=getattr(args, "tool_max_turns", None),
                                     tool_timeout=float(getattr(args, "tool_timeout", 10.0)))
    else:
        sample = await run_tool_loop(args, sample, params, tools, tokenizer=tokenizer, parse=parse_tool_calls,
                                     max_turns=getattr(args, "tool_max_turns", None),
                                     tool_timeout=float(getattr(args, "tool_timeout", 30.0)))
    parse = parse_plain if fmt == "plain" else parse_tool_calls
    sample.metadata.update(tool_ok=sum(ok), answered=not parse(sample.metadata["last_turn"]))
    return sample
