"""Multi-turn tool use where the tools come from MCP servers (docs/environments.md, "MCP tools").

    --custom-generate-function-path slime.rollout.environments.mcp_tools.generate
    --mcp-config mcp.yaml              # {mcpServers: {name: {command, args, env} | {url}}}: slime.mcp_flags
    --apply-chat-template              # the tools are offered through the chat template

On the first episode the rollout process starts every server of `--mcp-config` (stdio: a
subprocess; HTTP: a connection to a running streamable-HTTP or SSE server), initializes an MCP
session with each and lists its tools; they stay up for the whole run, shared by all episodes
(a tool's state, if it keeps any, is shared too). A server that does not start, or does not answer
within its `startup_timeout`, stops the rollout with one line naming it (and its stderr's last line).

Each episode (`generate`):
- the prompt is rendered again with the tools: the chat template's `tools` (Qwen, Hermes, Llama
  3.1 templates render them); a template that ignores `tools` gets them in the system message in
  the Hermes wording (`<tools>...</tools>`, calls as `<tool_call>{"name", "arguments"}</tool_call>`);
- `slime.rollout.multiturn.run_tool_loop` alternates model turns (loss mask 1, rollout log-probs
  kept) and tool results (`tool` messages, loss mask 0), calls parsed with `parse_tool_calls`;
- every call goes to its server through the `mcp` client with the server's `timeout`; a timeout, an
  unknown tool, a tool error or a server that went away comes back to the model as one line
  (`error: ...`), and the episode goes on;
- `sample.metadata["mcp_calls"]` records each call: server, tool, arguments, result text,
  `error` (bool) and seconds; with `turns`, `tool_calls` and `last_turn` from the tool loop.

`McpToolbox` is the same machinery for custom generate functions: `box = await toolbox(args)`,
`box.schemas` (OpenAI-style function schemas), `await box.call(name, arguments)`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import tempfile
import time
import weakref
from typing import Any

from slime.mcp_flags import FLAG, INSTALL_HINT, McpServerConfig
from slime.rollout.api import context
from slime.rollout.multiturn import parse_tool_calls, run_tool_loop
from slime.types import Sample
from slime.utils.errors import SlimeConfigError

try:  # optional dependency: pip install 'slime[environments]'
    from mcp import ClientSession
    from mcp.client.sse import sse_client
    from mcp.client.stdio import StdioServerParameters, stdio_client

    try:  # mcp >= 1.24 (and 2.x)
        from mcp.client.streamable_http import streamable_http_client as _http_client
    except ImportError:  # older mcp 1.x
        from mcp.client.streamable_http import streamablehttp_client as _http_client
except ImportError:  # reported when a run asks for MCP tools (validate_mcp, toolbox)
    ClientSession = None

logger = logging.getLogger(__name__)

HERMES_TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>"
)
CLOSE_TIMEOUT = 10.0  # seconds to shut a server down


class McpError(RuntimeError):
    """A server that does not start or answer: one line naming it."""


def _leaf(e: BaseException) -> BaseException:
    """The first real error inside (nested) exception groups, which anyio task groups raise."""
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    return e


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Server:
    """One MCP server: a session held open by its own task (anyio's contexts must be entered and left
    in one task); calls come from any episode's task."""

    def __init__(self, cfg: McpServerConfig):
        self.cfg = cfg
        self.session = None
        self.tools: list[dict] = []  # the server's tools as MCP describes them (name, description, inputSchema)
        self.down: str | None = None  # why the session ended, once it has
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._errlog = tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace") \
            if cfg.transport == "stdio" else None

    def _stderr_tail(self) -> str:
        if self._errlog is None:
            return ""
        with contextlib.suppress(Exception):
            self._errlog.flush()
            self._errlog.seek(0)
            lines = [ln.strip() for ln in self._errlog.read().splitlines() if ln.strip()]
            if lines:
                return f"; its stderr ends: {_one_line(lines[-1], 200)}"
        return ""

    def _transport(self):
        cfg = self.cfg
        if cfg.transport == "stdio":
            params = StdioServerParameters(command=cfg.command, args=list(cfg.args), env=dict(cfg.env) or None,
                                           cwd=cfg.cwd)
            return stdio_client(params, errlog=self._errlog)
        if cfg.transport == "sse":
            return sse_client(cfg.url)
        return _http_client(cfg.url)

    async def _hold(self, ready: asyncio.Future) -> None:
        try:
            async with contextlib.AsyncExitStack() as stack:
                streams = await stack.enter_async_context(self._transport())
                session = await stack.enter_async_context(ClientSession(streams[0], streams[1]))
                await session.initialize()
                listed = await session.list_tools()
                self.tools = [t.model_dump(by_alias=True, mode="json", exclude_none=True) for t in listed.tools]
                self.session = session
                ready.set_result(None)
                await self._stop.wait()
        except BaseException as e:  # noqa: BLE001 (reported to whoever waits, or kept for the next call)
            reason = _one_line(f"{type(_leaf(e)).__name__}: {_leaf(e)}")
            if isinstance(e, asyncio.CancelledError) and not ready.done():
                ready.cancel()  # start() gave up waiting (startup_timeout) and says so itself
            elif not ready.done():
                ready.set_exception(McpError(f"{self.cfg.describe()} did not start: {reason}{self._stderr_tail()}"))
            elif not self._stop.is_set():
                self.down = f"{reason}{self._stderr_tail()}"
                logger.warning("%s went away: %s", self.cfg.describe(), self.down)
            if isinstance(e, asyncio.CancelledError):
                raise
        finally:
            self.session = None
            if self.down is None and self._stop.is_set():
                self.down = "closed"

    async def start(self) -> None:
        ready = asyncio.get_running_loop().create_future()
        self._task = asyncio.ensure_future(self._hold(ready))
        try:
            await asyncio.wait_for(asyncio.shield(ready), self.cfg.startup_timeout)
        except asyncio.TimeoutError:
            await self.close()
            raise McpError(f"{self.cfg.describe()} did not start: no answer to initialize/list_tools within "
                           f"{self.cfg.startup_timeout:g} s (startup_timeout){self._stderr_tail()}") from None
        except McpError:
            await self.close()
            raise

    async def call(self, name: str, arguments: dict) -> tuple[str, bool]:
        """(result text, is an error) of one tool call; never raises for the server's failures."""
        cfg = self.cfg
        if self.session is None:
            return f"error: MCP server {cfg.name!r} is not running ({self.down or 'not started'})", True
        try:
            result = await asyncio.wait_for(self.session.call_tool(name, arguments), cfg.timeout)
        except asyncio.TimeoutError:
            return f"error: tool {name!r} (MCP server {cfg.name!r}) timed out after {cfg.timeout:g} s", True
        except Exception as e:  # a protocol error (unknown tool, bad arguments) or a lost connection
            why = _one_line(str(_leaf(e)) or type(_leaf(e)).__name__)
            return f"error: tool {name!r} (MCP server {cfg.name!r}): {why}", True
        return result_text(result)

    async def close(self) -> None:
        self._stop.set()
        if self._task is not None and not self._task.done() and self.session is None:
            self._task.cancel()  # still starting: nothing to shut down gracefully
        if self._task is not None and not self._task.done():
            try:
                await asyncio.wait_for(asyncio.shield(self._task), CLOSE_TIMEOUT)
            except BaseException:  # noqa: BLE001 (stuck or failed while closing: cancel it)
                self._task.cancel()
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(self._task, CLOSE_TIMEOUT)
        if self._errlog is not None:
            self._errlog.close()
            self._errlog = None


def result_text(result) -> tuple[str, bool]:
    """An MCP `CallToolResult` as (text for the model, is an error): text blocks joined by newlines,
    other blocks named (`[image]`), the structured result as JSON when there is no text."""
    d = result.model_dump(by_alias=True, mode="json", exclude_none=True)
    parts = []
    for block in d.get("content") or []:
        kind = block.get("type")
        if kind == "text":
            parts.append(block.get("text", ""))
        elif kind == "resource" and isinstance(block.get("resource"), dict) and "text" in block["resource"]:
            parts.append(block["resource"]["text"])
        else:
            parts.append(f"[{kind}]")
    if not parts and d.get("structuredContent") is not None:
        parts.append(json.dumps(d["structuredContent"]))
    text = "\n".join(parts)
    is_error = bool(d.get("isError"))
    return (f"error: {text}" if is_error and not text.startswith("error") else text), is_error


def function_schema(tool: dict) -> dict:
    """An MCP tool (name, description, inputSchema) as the chat templates' function schema."""
    return {"type": "function", "function": {
        "name": tool["name"], "description": tool.get("description", ""),
        "parameters": tool.get("inputSchema") or {"type": "object", "properties": {}}}}


class McpToolbox:
    """The tools of every server of `--mcp-config`, by name."""

    def __init__(self, servers: list[_Server]):
        self.servers = servers
        self.owner: dict[str, _Server] = {}
        for s in servers:
            names = [t["name"] for t in s.tools]
            if s.cfg.tools is not None:
                missing = sorted(set(s.cfg.tools) - set(names))
                if missing:
                    raise McpError(f"{s.cfg.describe()} has no tool {', '.join(map(repr, missing))} (`tools`); "
                                   f"it offers {', '.join(names) or 'none'}")
                names = [n for n in names if n in s.cfg.tools]
            for n in names:
                if n in self.owner:
                    raise McpError(f"tool {n!r} is offered by MCP servers {self.owner[n].cfg.name!r} and "
                                   f"{s.cfg.name!r}; list it under one server's `tools` only ({FLAG})")
                self.owner[n] = s
        self.schemas = [function_schema(t) for s in servers for t in s.tools if self.owner.get(t["name"]) is s]
        self.timeout = max(s.cfg.timeout for s in servers)

    @classmethod
    async def open(cls, configs: tuple[McpServerConfig, ...]) -> "McpToolbox":
        """Start every server (concurrently); one that fails closes the others and raises its line."""
        if ClientSession is None:
            raise SlimeConfigError(f"{FLAG} needs the `mcp` package, which is not installed: {INSTALL_HINT}")
        servers = [_Server(c) for c in configs]
        results = await asyncio.gather(*(s.start() for s in servers), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        try:
            if failed:
                raise failed[0]
            return cls(servers)
        except BaseException:
            await asyncio.gather(*(s.close() for s in servers), return_exceptions=True)
            raise

    async def call(self, name: str, arguments: dict) -> tuple[str, bool, str | None]:
        """(result text, is an error, server name) of one call; an unknown tool is an error for the model."""
        server = self.owner.get(name)
        if server is None:
            return f"error: unknown tool {name!r} (tools: {', '.join(sorted(self.owner))})", True, None
        text, err = await server.call(name, arguments)
        return text, err, server.cfg.name

    def tool_functions(self, records: list[dict]) -> dict[str, Any]:
        """{tool name: async fn(**arguments) -> text} for `run_tool_loop`, each call appended to `records`."""
        def make(name: str):
            async def fn(**arguments):
                start = time.perf_counter()
                text, err, server = await self.call(name, arguments)
                records.append({"server": server, "tool": name, "arguments": arguments, "result": text,
                                "error": err, "seconds": round(time.perf_counter() - start, 4)})
                return text
            return fn
        return {name: make(name) for name in self.owner}

    async def aclose(self) -> None:
        await asyncio.gather(*(s.close() for s in self.servers), return_exceptions=True)


_BOXES: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict]" = weakref.WeakKeyDictionary()


async def toolbox(args) -> McpToolbox:
    """The run's toolbox on the running loop, started by the first caller (the others wait for it);
    a start that failed fails every later call the same way."""
    boxes = _BOXES.setdefault(asyncio.get_running_loop(), {})
    key = args.mcp_config
    if key not in boxes:
        boxes[key] = asyncio.ensure_future(McpToolbox.open(args.mcp_servers))
    return await asyncio.shield(boxes[key])


async def close_toolboxes() -> None:
    """Close the toolboxes of the running loop (their stdio servers exit); tests and shutdown."""
    boxes = _BOXES.pop(asyncio.get_running_loop(), {})
    for task in boxes.values():
        if task.done() and not task.cancelled() and task.exception() is None:
            await task.result().aclose()


def prompt_with_tools(args, prompt, tokenizer, schemas: list[dict]) -> list[int]:
    """The prompt's token ids with the tools offered: through the chat template's `tools`, or, when
    the template ignores them, a system message in the Hermes wording (module docstring)."""
    if not args.apply_chat_template:
        raise SlimeConfigError("slime.rollout.environments.mcp_tools.generate needs --apply-chat-template (the "
                               "tools are offered through the chat template)")
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    kwargs = dict(args.apply_chat_template_kwargs or {})
    plain = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, tools=schemas,
                                         **kwargs)
    if text == plain:  # the template does not render tools
        described = HERMES_TOOLS_PROMPT.format(tools="\n".join(json.dumps(s) for s in schemas))
        if messages and messages[0].get("role") == "system":
            messages = [{**messages[0], "content": f"{messages[0]['content']}\n\n{described}"}, *messages[1:]]
        else:
            messages = [{"role": "system", "content": described}, *messages]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


async def generate(args, sample: Sample, sampling_params: dict) -> Sample:
    """One episode with the MCP servers' tools (module docstring); `--custom-generate-function-path`."""
    if not getattr(args, "mcp_servers", None):
        raise SlimeConfigError(f"slime.rollout.environments.mcp_tools.generate needs {FLAG} PATH")
    box = await toolbox(args)
    tokenizer = context().tokenizer
    if sample.response_length == 0:  # (a partial rollout's resumed sample already has them)
        sample.tokens = prompt_with_tools(args, sample.prompt, tokenizer, box.schemas)
    records: list[dict] = []
    sample = await run_tool_loop(args, sample, sampling_params, box.tool_functions(records), tokenizer=tokenizer,
                                 parse=parse_tool_calls, tool_timeout=box.timeout + 5.0)
    sample.metadata["mcp_calls"] = records
    return sample
