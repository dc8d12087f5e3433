"""The tools of the tool-use example: a calculator and a sandboxed Python interpreter.

- `calculate(expression)`: +, -, *, /, ** (small exponents), parentheses, and the words plus,
  minus, times, divided by; evaluated over the syntax tree, never with `eval`.
- `run_python(code)`: runs `code` in a separate `python -I` process with an address-space limit
  (RLIMIT_AS), a CPU-time limit (RLIMIT_CPU), no core dumps, a wall-clock timeout and an empty
  temporary working directory; returns its stdout (or the error), cut to `max_output` characters.
  This is a resource sandbox, not a security boundary: run untrusted models' code in a container.
"""

from __future__ import annotations

import ast
import asyncio
import operator
import os
import re
import sys
import tempfile

_WORDS = [(r"\bdivided by\b", "/"), (r"\bplus\b", "+"), (r"\bminus\b", "-"), (r"\btimes\b", "*")]
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
# an arithmetic expression in text: numbers joined by operators or operator words
EXPRESSION = re.compile(r"\(?\s*-?\d+(?:\.\d+)?(?:\s*(?:[-+*/()]|\*\*|plus|minus|times|divided by)\s*\(?\s*-?\d+"
                        r"(?:\.\d+)?\s*\)?)+")


def _value(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 32:
            raise ValueError("exponent too large")
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    raise ValueError(f"unsupported syntax: {ast.dump(node)[:60]}")


def format_number(x) -> str:
    if isinstance(x, float) and x.is_integer():
        x = int(x)
    return str(round(x, 6) if isinstance(x, float) else x)


def calculate(expression: str) -> str:
    """The value of an arithmetic expression, or an `error: ...` line."""
    text = str(expression).strip()
    for pattern, symbol in _WORDS:
        text = re.sub(pattern, symbol, text)
    text = text.replace("×", "*").replace("÷", "/").rstrip("=?. ")
    if not text:
        return "error: empty expression"
    if len(text) > 200:
        return "error: expression too long"
    try:
        return format_number(_value(ast.parse(text, mode="eval").body))
    except ZeroDivisionError:
        return "error: division by zero"
    except (SyntaxError, ValueError, TypeError, OverflowError) as e:
        return f"error: cannot evaluate {expression!r} ({type(e).__name__})"


def last_expression(text: str) -> str:
    """The last arithmetic expression written in `text` ('' if none)."""
    found = EXPRESSION.findall(text)
    return found[-1].strip() if found else ""


def _limits(memory_bytes: int, cpu_seconds: int):
    def apply():
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        os.setsid()

    return apply


async def run_python(code: str, *, timeout: float = 5.0, memory_mb: int = 256, cpu_seconds: int = 2,
                     max_output: int = 1000) -> str:
    """Run `code` in a resource-limited subprocess; its stdout, or `error: ...` (exit status, stderr tail,
    timeout). The process group is killed on timeout."""
    with tempfile.TemporaryDirectory(prefix="slime_py_") as cwd:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-c", str(code), cwd=cwd, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env={"PATH": "/usr/bin:/bin", "PYTHONIOENCODING": "utf-8"},
            preexec_fn=_limits(memory_mb << 20, cpu_seconds))
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout)
        except asyncio.TimeoutError:
            try:
                os.killpg(proc.pid, 9)
            except ProcessLookupError:
                pass
            await proc.wait()
            return f"error: timed out after {timeout:g} s"
    out_text = out.decode("utf-8", "replace")
    if proc.returncode != 0:
        tail = err.decode("utf-8", "replace").strip().splitlines()[-1:] or [""]
        reason = f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exit status {proc.returncode}"
        return f"error: {reason}: {tail[0][:200]}"
    return out_text[:max_output].strip() or "(no output)"
