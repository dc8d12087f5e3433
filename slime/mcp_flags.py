"""`--mcp-config PATH`: the MCP servers whose tools a multi-turn episode may call
(`slime.rollout.environments.mcp_tools`; docs/environments.md, "MCP tools").

The file is YAML or JSON in the `mcpServers` format of Claude Desktop / Claude Code / Cursor:

    mcpServers:
      calculator:                        # a server started as a subprocess, spoken to over stdio
        command: python
        args: [examples/mcp_tools/calculator_server.py]
        env: {CALC_PRECISION: "6"}       # added to the inherited environment
        cwd: .                           # relative to this file (default: where slime was started)
        timeout: 10                      # seconds one tool call may take (default 30)
        startup_timeout: 30              # seconds to start, initialize and list tools (default 30)
      search:                            # a running server: streamable HTTP (type: http, the default) or SSE
        url: http://127.0.0.1:8000/mcp
        type: http                       # http | streamable-http | sse
        tools: [search]                  # offer only these tools of the server (default: all)
      old:
        command: ./old-server
        disabled: true                   # listed, not started

`load_mcp_config` checks the file at parse time (one line naming the file, line and field for an
unknown field, with the closest known one; a server with both or neither of `command` and `url`;
a value of the wrong type) and `validate_mcp` puts the servers on `args.mcp_servers`. Nothing is
started here: the rollout starts the servers on the first episode.
"""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from slime.utils.errors import SlimeConfigError
from slime.utils.yaml_fields import YamlFile

FLAG = "--mcp-config"
GENERATE_PATH = "slime.rollout.environments.mcp_tools.generate"
SERVER_KEYS = ("command", "args", "env", "cwd", "url", "type", "timeout", "startup_timeout", "tools", "disabled")
TYPES = {"stdio": "stdio", "http": "streamable-http", "streamable-http": "streamable-http",
         "streamableHttp": "streamable-http", "sse": "sse"}
DEFAULT_TIMEOUT = 30.0
DEFAULT_STARTUP_TIMEOUT = 30.0
INSTALL_HINT = "pip install 'slime[environments]' (or pip install mcp)"


def add_mcp_flags(p) -> None:
    g = p.add_argument_group("MCP tools (docs/environments.md#mcp-tools)")
    g.add_argument(FLAG, default=None, metavar="PATH",
                   help="YAML/JSON file of MCP servers ({mcpServers: {name: {command, args, env} | {url}}}) whose "
                        f"tools episodes call; use with --custom-generate-function-path {GENERATE_PATH}")


@dataclass(frozen=True)
class McpServerConfig:
    """One server of the file: started as `command args` (stdio) or reached at `url`."""

    name: str
    transport: str  # stdio | streamable-http | sse
    command: str | None = None
    args: tuple[str, ...] = ()
    env: dict = field(default_factory=dict)
    cwd: str | None = None
    url: str | None = None
    timeout: float = DEFAULT_TIMEOUT
    startup_timeout: float = DEFAULT_STARTUP_TIMEOUT
    tools: tuple[str, ...] | None = None
    source: str = ""  # "FLAG FILE:LINE", for messages

    def describe(self) -> str:
        what = " ".join([self.command or "", *self.args]).strip() if self.transport == "stdio" else self.url
        return f"MCP server {self.name!r} ({self.transport}: {what}" + (f"; {self.source})" if self.source else ")")


def load_mcp_config(path: str, base_cwd: str | None = None) -> tuple[McpServerConfig, ...]:
    """The enabled servers of the `--mcp-config` file at `path` (module docstring), checked."""
    doc = YamlFile.load(FLAG, path)
    root = doc.mapping((), doc.data, "settings ({mcpServers: {name: {...}}})")
    doc.keys((), root, ("mcpServers",))
    servers = root.get("mcpServers")
    if not isinstance(servers, dict) or not servers:
        doc.fail(("mcpServers",), "required: a mapping of server names to {command, args, env} or {url}")
    here = Path(path).resolve().parent
    out = []
    for name, entry in servers.items():
        at = ("mcpServers", name)
        if not isinstance(name, str) or not name:
            doc.fail(at, f"a server name must be a non-empty string, got {name!r}")
        entry = doc.mapping(at, entry, "server fields (command, args, env or url)")
        doc.keys(at, entry, SERVER_KEYS)
        disabled = entry.get("disabled", False)
        if not isinstance(disabled, bool):
            doc.fail(at + ("disabled",), f"must be true or false, got {disabled!r}")
        server = _server(doc, at, name, entry, here, base_cwd)
        if not disabled:
            out.append(server)
    if not out:
        doc.fail(("mcpServers",), "every server is disabled")
    return tuple(out)


def _server(doc: YamlFile, at: tuple, name: str, e: dict, here: Path, base_cwd: str | None) -> McpServerConfig:
    command, url = e.get("command"), e.get("url")
    if (command is None) == (url is None):
        doc.fail(at, "give `command` (a server started over stdio) or `url` (a running HTTP server), "
                     + ("not both" if command is not None else "one of them"))
    kind = e.get("type", "stdio" if command is not None else "http")
    if kind not in TYPES:
        doc.fail(at + ("type",), f"{kind!r} is not a transport; choose from stdio, http, sse")
    transport = TYPES[kind]
    if (transport == "stdio") != (command is not None):
        doc.fail(at + ("type",), f"{kind} needs " + ("`command`" if transport == "stdio" else "`url`"))
    fields: dict = {"name": name, "transport": transport, "source": doc.where(at)}
    if command is not None:
        if not isinstance(command, str) or not command.strip():
            doc.fail(at + ("command",), f"must be a non-empty string, got {command!r}")
        args = e.get("args", [])
        if not isinstance(args, list) or not all(isinstance(a, (str, int, float)) and not isinstance(a, bool)
                                                 for a in args):
            doc.fail(at + ("args",), f"must be a list of strings, got {args!r}")
        env = e.get("env") or {}
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, (str, int, float))
                                                and not isinstance(v, bool) for k, v in env.items()):
            doc.fail(at + ("env",), f"must be a mapping of variable names to strings, got {env!r}")
        cwd = e.get("cwd")
        if cwd is not None and not isinstance(cwd, str):
            doc.fail(at + ("cwd",), f"must be a directory path, got {cwd!r}")
        cwd = str((here / cwd).resolve()) if cwd is not None else (base_cwd or os.getcwd())
        if not Path(cwd).is_dir():
            doc.fail(at + ("cwd",), f"directory {cwd} does not exist")
        fields.update(command=command, args=tuple(str(a) for a in args), env={k: str(v) for k, v in env.items()},
                      cwd=cwd)
    else:
        for key in ("args", "env", "cwd"):
            if key in e:
                doc.fail(at + (key,), "is for a server started with `command`; this one has a `url`")
        parsed = urlparse(url) if isinstance(url, str) else None
        if parsed is None or parsed.scheme not in ("http", "https") or not parsed.hostname:
            doc.fail(at + ("url",), f"must be an http(s) URL such as http://127.0.0.1:8000/mcp, got {url!r}")
        fields["url"] = url
    for key, default in (("timeout", DEFAULT_TIMEOUT), ("startup_timeout", DEFAULT_STARTUP_TIMEOUT)):
        value = e.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            doc.fail(at + (key,), f"must be a number of seconds > 0, got {value!r}")
        fields[key] = float(value)
    tools = e.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not tools or not all(isinstance(t, str) and t for t in tools):
            doc.fail(at + ("tools",), f"must be a non-empty list of tool names, got {tools!r}")
        fields["tools"] = tuple(tools)
    return McpServerConfig(**fields)


def validate_mcp(args) -> None:
    """`args.mcp_servers` from --mcp-config (checked, nothing started); the MCP generate function needs it."""
    uses_generate = (args.custom_generate_function_path or "").replace("/", ".").replace(".py:", ".") \
        .endswith("rollout.environments.mcp_tools.generate")
    if args.mcp_config is None:
        if uses_generate:
            raise SlimeConfigError(f"--custom-generate-function-path {args.custom_generate_function_path} needs "
                                   f"{FLAG} PATH (the MCP servers whose tools the episodes call)")
        args.mcp_servers = ()
        return
    if importlib.util.find_spec("mcp") is None:
        raise SlimeConfigError(f"{FLAG} needs the `mcp` package, which is not installed: {INSTALL_HINT}")
    args.mcp_servers = load_mcp_config(args.mcp_config)
