"""MCP tools (slime.rollout.environments.mcp_tools, --mcp-config): the generate function against a
scripted engine and the example's real calculator server (a stdio subprocess, and streamable HTTP on
127.0.0.1). Each episode's tokens, loss mask, log-probs and reward are compared with what the server
itself recorded (its CALC_LOG); servers that do not start or answer, slow tools and bad config files
are one clear line each."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("mcp", reason="the `mcp` package is not installed (pip install 'slime[environments]')")

from slime.rollout import api  # noqa: E402
from slime.rollout.environments import mcp_tools  # noqa: E402
from slime.rollout.multiturn import env_message_tokens  # noqa: E402
from slime.types import Sample, SampleStatus  # noqa: E402
from slime.utils.errors import SlimeConfigError  # noqa: E402
from slime.utils.hooks import load_function  # noqa: E402
from slime.utils.net import free_port  # noqa: E402
from tests.helpers.args import make_args  # noqa: E402
from tests.helpers.rollout import ScriptedFleet  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
SERVER = ROOT / "examples" / "mcp_tools" / "calculator_server.py"
GENERATE = "slime.rollout.environments.mcp_tools.generate"
QUESTION = [{"role": "user", "content": "what is 3 times 7 ?"}]
CALL = '<tool_call>{"name": "calculate", "arguments": {"expression": "3 * 7"}}</tool_call>'


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def write_config(path: Path, servers: dict) -> Path:
    path.write_text(json.dumps({"mcpServers": servers}))  # JSON is YAML: the Claude/Cursor files as they are
    return path


def stdio_server(log: Path, **extra) -> dict:
    return {"command": sys.executable, "args": [str(SERVER)], "env": {"CALC_LOG": str(log)}, **extra}


def episode(args, tok, turns):
    """Run `generate` on one sample against a scripted engine; returns (sample, engine, the tools' schemas)."""
    engines = ScriptedFleet(turns)
    api.set_context(api.RolloutContext(args, tok, engines, "http://unused"))
    prompt_ids = ids(tok, tok.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True))
    sample = Sample(prompt=QUESTION, label="21", tokens=list(prompt_ids))
    params = {"temperature": 1.0, "max_new_tokens": args.rollout_max_response_len, "sampling_seed": 7}

    async def go():
        try:
            out = await load_function(GENERATE)(args, sample, params)
            return out, (await mcp_tools.toolbox(args)).schemas
        finally:
            await mcp_tools.close_toolboxes()

    try:
        out, schemas = asyncio.run(go())
    finally:
        api.set_context(None)
    return out, engines, schemas


def check_episode_matches_server_record(args, tok, log: Path):
    eos = tok.eos_token_id
    turn1, turn2 = ids(tok, "compute 3 times 7") + [eos], ids(tok, "21") + [eos]
    s, engines, schemas = episode(args, tok, [(CALL, turn1, "stop", eos), ("21", turn2, "stop", eos)])
    record = [json.loads(line) for line in log.read_text().splitlines()]
    # the server's own record: one call, the arguments the model wrote, the result it returned
    assert record == [{"tool": "calculate", "arguments": {"expression": "3 * 7"}, "result": "21"}]
    assert [(c["server"], c["tool"], c["arguments"], c["result"], c["error"]) for c in s.metadata["mcp_calls"]] == \
        [("calc", r["tool"], r["arguments"], r["result"], False) for r in record]
    # the prompt offers the server's tool; the tiny template ignores `tools`, so in the system message
    assert [t["function"]["name"] for t in schemas] == ["calculate"]
    assert schemas[0]["function"]["parameters"]["required"] == ["expression"]
    system = mcp_tools.HERMES_TOOLS_PROMPT.format(tools=json.dumps(schemas[0]))
    prompt = ids(tok, tok.apply_chat_template([{"role": "system", "content": system}, *QUESTION], tokenize=False,
                                              add_generation_prompt=True))
    # tokens: prompt, model turn (mask 1), the recorded result as a tool message (mask 0), model turn (mask 1)
    env = env_message_tokens(tok, [{"role": "tool", "content": record[0]["result"]}])
    assert s.tokens == prompt + turn1 + env + turn2
    assert s.loss_mask == [1] * len(turn1) + [0] * len(env) + [1] * len(turn2)
    lp1 = [-0.1 * (k + 1) - 0.01 for k in range(len(turn1))]
    lp2 = [-0.1 * (k + 1) - 0.02 for k in range(len(turn2))]
    assert s.rollout_log_probs == pytest.approx(lp1 + [0.0] * len(env) + lp2)
    assert [p["input_ids"] for p in engines.payloads] == [prompt, prompt + turn1 + env]
    assert s.status == SampleStatus.COMPLETED and s.metadata["turns"] == 2 and s.metadata["tool_calls"] == 1
    # the example's reward reads the same record
    reward = load_function(str(ROOT / "examples/mcp_tools/reward.py") + ":reward")(args, s)
    assert reward == {"score": 1.0, "correct": 1.0, "tool_calls": 1.0, "turns": 2.0}


def test_stdio_server_episode_matches_the_servers_record(tiny_model_dir, tok, tmp_path):
    log = tmp_path / "calls.jsonl"
    cfg = write_config(tmp_path / "mcp.json", {"calc": stdio_server(log)})
    args = make_args(tiny_model_dir, tmp_path, "--apply-chat-template", "--mcp-config", cfg,
                     "--custom-generate-function-path", GENERATE, "--rollout-max-response-len", 64)
    assert [(s.name, s.transport, s.timeout) for s in args.mcp_servers] == [("calc", "stdio", 30.0)]
    check_episode_matches_server_record(args, tok, log)


def _wait_for_port(port: int, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the HTTP MCP server exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"the HTTP MCP server did not listen on 127.0.0.1:{port} within {timeout} s")


def test_http_server_on_loopback_episode_matches_the_servers_record(tiny_model_dir, tok, tmp_path):
    log, port = tmp_path / "calls.jsonl", free_port()
    proc = subprocess.Popen([sys.executable, str(SERVER), "--transport", "streamable-http", "--host", "127.0.0.1",
                             "--port", str(port)], env={**__import__("os").environ, "CALC_LOG": str(log)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for_port(port, proc)
        cfg = tmp_path / "mcp.yaml"
        cfg.write_text(f"mcpServers:\n  calc:\n    url: http://127.0.0.1:{port}/mcp\n    type: http\n")
        args = make_args(tiny_model_dir, tmp_path, "--apply-chat-template", "--mcp-config", cfg,
                         "--custom-generate-function-path", GENERATE, "--rollout-max-response-len", 64)
        assert args.mcp_servers[0].transport == "streamable-http"
        check_episode_matches_server_record(args, tok, log)
    finally:
        proc.terminate()
        proc.wait(20)


SLOW_SERVER = '''
import time
try:
    from mcp.server.mcpserver import MCPServer as S
except ImportError:
    from mcp.server.fastmcp import FastMCP as S
s = S("slow")

@s.tool()
def slow(seconds: float) -> str:
    """Sleep, then say so."""
    time.sleep(seconds)
    return "slept"

s.run("stdio")
'''


def test_a_slow_tool_times_out_into_one_line_for_the_model_and_the_episode_goes_on(tiny_model_dir, tok, tmp_path):
    (tmp_path / "slow.py").write_text(SLOW_SERVER)
    cfg = write_config(tmp_path / "mcp.json", {"slow": {"command": sys.executable, "args": ["slow.py"],
                                                         "cwd": str(tmp_path), "timeout": 0.5}})
    args = make_args(tiny_model_dir, tmp_path, "--apply-chat-template", "--mcp-config", cfg,
                     "--custom-generate-function-path", GENERATE, "--rollout-max-response-len", 64)
    eos = tok.eos_token_id
    call = '<tool_call>{"name": "slow", "arguments": {"seconds": 5}}</tool_call>'
    turn = ids(tok, "compute") + [eos]
    s, _, _ = episode(args, tok, [(call, turn, "stop", eos), ("21", ids(tok, "21") + [eos], "stop", eos)])
    (rec,) = s.metadata["mcp_calls"]
    assert rec["result"] == "error: tool 'slow' (MCP server 'slow') timed out after 0.5 s" and rec["error"]
    assert rec["seconds"] < 3
    env = env_message_tokens(tok, [{"role": "tool", "content": rec["result"]}])
    assert s.loss_mask.count(0) == len(env) and s.metadata["turns"] == 2


@pytest.mark.parametrize("server, message", [
    ({"command": "no-such-mcp-server-command"},
     r"^MCP server 'bad' \(stdio: no-such-mcp-server-command; --mcp-config .*:2\) did not start: FileNotFoundError"),
    ({"command": sys.executable, "args": ["-c", "import sys; print('no api key', file=sys.stderr); sys.exit(3)"]},
     r"^MCP server 'bad' .* did not start: .*; its stderr ends: no api key$"),
    ({"command": sys.executable, "args": ["-c", "import time; time.sleep(60)"], "startup_timeout": 1},
     r"^MCP server 'bad' .* did not start: no answer to initialize/list_tools within 1 s \(startup_timeout\)$"),
    ({"url": "http://127.0.0.1:9/mcp"}, r"^MCP server 'bad' \(streamable-http: http://127.0.0.1:9/mcp; .*\) did not "
                                        r"start: ConnectError"),
])
def test_a_server_that_does_not_start_is_one_line(tiny_model_dir, tok, tmp_path, server, message):
    cfg = tmp_path / "mcp.yaml"
    cfg.write_text("mcpServers:\n  bad:\n" + "".join(f"    {k}: {json.dumps(v)}\n" for k, v in server.items()))
    args = make_args(tiny_model_dir, tmp_path, "--apply-chat-template", "--mcp-config", cfg,
                     "--custom-generate-function-path", GENERATE)
    start = time.monotonic()
    with pytest.raises(mcp_tools.McpError, match=message) as ei:
        episode(args, tok, [])
    assert "\n" not in str(ei.value) and time.monotonic() - start < 15


@pytest.mark.parametrize("body, message", [
    ("mcpServers:\n  calc:\n    comand: python\n",
     r":3: mcpServers.calc.comand: unknown field \(did you mean command\?\)"),
    ("mcpServers:\n  calc:\n    command: python\n    url: http://127.0.0.1:1/mcp\n",
     r":2: mcpServers.calc: give `command` .* or `url` .*, not both"),
    ("mcpServers:\n  calc: {args: [x]}\n", r":2: mcpServers.calc: give `command` .* one of them"),
    ("mcpServers:\n  calc:\n    command: python\n    timeout: -1\n", r":4: mcpServers.calc.timeout: must be a number "
                                                                     r"of seconds > 0, got -1"),
    ("mcpServers:\n  calc:\n    url: ftp://x/mcp\n", r":3: mcpServers.calc.url: must be an http\(s\) URL"),
    ("mcpServers:\n  calc:\n    url: http://127.0.0.1:1/mcp\n    type: websocket\n",
     r":4: mcpServers.calc.type: 'websocket' is not a transport"),
    ("servers: {}\n", r":1: servers: unknown field \(did you mean mcpServers\?\)"),
    ("mcpServers: [\n", r"not valid YAML \(line \d+\)"),
])
def test_bad_config_file_is_one_line_naming_file_line_and_field(tiny_model_dir, tmp_path, body, message):
    cfg = tmp_path / "mcp.yaml"
    cfg.write_text(body)
    with pytest.raises(SlimeConfigError, match=rf"^--mcp-config {cfg}.*{message}") as ei:
        make_args(tiny_model_dir, tmp_path, "--apply-chat-template", "--mcp-config", cfg,
                  "--custom-generate-function-path", GENERATE)
    assert "\n" not in str(ei.value)


def test_the_generate_function_needs_the_config(tiny_model_dir, tmp_path):
    with pytest.raises(SlimeConfigError, match=r"needs --mcp-config PATH"):
        make_args(tiny_model_dir, tmp_path, "--custom-generate-function-path", GENERATE)
    with pytest.raises(SlimeConfigError, match=r"^--mcp-config: file .*none.yaml does not exist$"):
        make_args(tiny_model_dir, tmp_path, "--mcp-config", tmp_path / "none.yaml")
