"""A small MCP server: a calculator, over stdio (default) or HTTP on 127.0.0.1.

    python examples/mcp_tools/calculator_server.py                                  # stdio (what mcp.yaml starts)
    python examples/mcp_tools/calculator_server.py --transport streamable-http --port 8765   # http://127.0.0.1:8765/mcp
    python examples/mcp_tools/calculator_server.py --transport sse --port 8765               # http://127.0.0.1:8765/sse

One tool, `calculate(expression)`: +, -, *, /, ** and parentheses (the tool-use example's calculator:
the syntax tree is walked, nothing is `eval`ed, sizes are bounded). With `CALC_LOG=FILE` in its
environment the server appends every call to FILE as a JSON line `{"tool", "arguments", "result"}`:
the environment's own record of the episode (the tests compare it with the samples).

Works with `mcp` 1.x (`FastMCP`) and 2.x (`MCPServer`). HTTP binds 127.0.0.1 only unless `--host` says
otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tool_use"))

from tools import calculate as _calculate  # noqa: E402  (examples/tool_use/tools.py)

try:  # mcp >= 2
    from mcp.server.mcpserver import MCPServer as _Server

    MCP2 = True
except ImportError:  # mcp 1.x
    from mcp.server.fastmcp import FastMCP as _Server

    MCP2 = False

server = _Server("calculator")


def _log(tool: str, arguments: dict, result: str) -> None:
    path = os.environ.get("CALC_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"tool": tool, "arguments": arguments, "result": result}) + "\n")


@server.tool()
def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression (+, -, *, /, ** and parentheses) and return the number."""
    result = _calculate(expression)
    _log("calculate", {"expression": expression}, result)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--transport", choices=("stdio", "streamable-http", "sse"), default="stdio")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8765)
    a = p.parse_args()
    if a.transport == "stdio":
        server.run("stdio")
    elif MCP2:
        server.run(a.transport, host=a.host, port=a.port)
    else:
        server.settings.host, server.settings.port = a.host, a.port
        server.run(a.transport)


if __name__ == "__main__":
    main()
