"""The tools of the tool-use example: a calculator and a sandboxed Python interpreter.

- `calculate(expression)`: +, -, *, /, ** (small exponents), parentheses, and the words plus,
  minus, times, divided by; evaluated over the syntax tree, never with `eval`. The size of every
  product and power is bounded from the operands' bit lengths before it is computed (at most
  MAX_DIGITS digits), as are literals and nesting depth.
- `run_python(code)`: runs the model's `code` with `python -I` in a bubblewrap sandbox (`sandbox.py`:
  no network, a read-only view of /usr and the Python installation, no $HOME or repository, a private
  /tmp and working directory, new processes refused, rlimits on memory, CPU time, file size and
  threads, stdout cut at `max_output` bytes, a wall-clock timeout, the process tree killed on return,
  timeout and cancellation); returns its stdout or an `error: ...` line. Without a working `bwrap` it
  refuses (one error line) unless the unsafe switch is set: SLIME_TOOL_SANDBOX=unsafe in the
  environment or `sandbox="unsafe"` (`python_sandbox: unsafe` in the example's config); then it runs
  unsandboxed, as the training user, with the rlimits, timeout and output cap only.
"""

from __future__ import annotations

import ast
import math
import operator
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sandbox as _sandbox

_WORDS = [(r"\bdivided by\b", "/"), (r"\bplus\b", "+"), (r"\bminus\b", "-"), (r"\btimes\b", "*")]
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_DIGITS = 300  # the most digits of any number the calculator reads or computes
MAX_DEPTH = 32  # the deepest nesting of operations
_MAX_BITS = math.ceil(MAX_DIGITS * math.log2(10))
# an arithmetic expression in text: numbers joined by operators or operator words
EXPRESSION = re.compile(r"\(?\s*-?\d+(?:\.\d+)?(?:\s*(?:[-+*/()]|\*\*|plus|minus|times|divided by)\s*\(?\s*-?\d+"
                        r"(?:\.\d+)?\s*\)?)+")


class TooLarge(ValueError):
    pass


def _bits(x) -> float:
    """log2 of |x| rounded up (0 for |x| < 1): a bound on the size of the number."""
    if isinstance(x, int):
        return abs(x).bit_length()
    return max(math.frexp(x)[1], 0) if math.isfinite(x) else math.inf


def _check_size(op, left, right) -> None:
    """Refuse a product or power whose result would have more than MAX_DIGITS digits, before computing it."""
    if isinstance(op, ast.Mult):
        bits = _bits(left) + _bits(right)
    elif isinstance(op, ast.Pow):
        if abs(right) > 32:
            raise ValueError("exponent too large")
        bits = _bits(left) * max(right, 0)
    else:  # + - / add at most one bit to a bounded operand
        return
    if bits > _MAX_BITS:
        raise TooLarge


def _value(node, depth: int = 0):
    if depth > MAX_DEPTH:
        raise TooLarge("nesting")
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        if _bits(node.value) > _MAX_BITS:
            raise TooLarge
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left, depth + 1), _value(node.right, depth + 1)
        _check_size(node.op, left, right)
        result = _BINARY[type(node.op)](left, right)
        if isinstance(result, complex):
            raise ValueError("complex result")
        if isinstance(result, float) and not math.isfinite(result) or _bits(result) > _MAX_BITS:
            raise TooLarge
        return result
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand, depth + 1))
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
    except TooLarge as e:
        if str(e) == "nesting":
            return f"error: expression nested too deeply (more than {MAX_DEPTH} levels)"
        return f"error: number too large (more than {MAX_DIGITS} digits)"
    except (SyntaxError, ValueError, TypeError, OverflowError) as e:
        return f"error: cannot evaluate {expression!r} ({type(e).__name__})"


def last_expression(text: str) -> str:
    """The last arithmetic expression written in `text` ('' if none)."""
    found = EXPRESSION.findall(text)
    return found[-1].strip() if found else ""


SANDBOX_ENV = "SLIME_TOOL_SANDBOX"  # =unsafe: run the Python tool without a sandbox when there is none


def sandbox_refusal(sandbox: str | None = None) -> str | None:
    """The one-line error of a Python tool that may not run (no sandbox, no unsafe switch), or None.
    `sandbox`: None or "bwrap" (require the sandbox) or "unsafe" (allow running without one); the
    environment's SLIME_TOOL_SANDBOX=unsafe allows it too."""
    modes = (sandbox, os.environ.get(SANDBOX_ENV) or None)
    for mode in modes:
        if mode not in (None, "bwrap", "unsafe"):
            raise ValueError(f"python sandbox must be 'bwrap' or 'unsafe', got {mode!r}")
    why = _sandbox.unavailable()
    if why is None or "unsafe" in modes:
        return None
    return (f"error: no sandbox for the python tool: {why}; install bubblewrap ({_sandbox.INSTALL_HINT}) "
            f"or set {SANDBOX_ENV}=unsafe (python_sandbox: unsafe in the config) to run it unsandboxed")


async def run_python(code: str, *, timeout: float = 5.0, memory_mb: int = 256, cpu_seconds: int = 2,
                     max_output: int = 1000, file_mb: int = 16, sandbox: str | None = None) -> str:
    """Run `code` in the sandbox; its stdout (cut to `max_output` bytes), or `error: ...` (no sandbox, exit
    status and stderr's last line, timeout). See the module docstring for `sandbox`."""
    refusal = sandbox_refusal(sandbox)
    if refusal:
        return refusal
    isolated = _sandbox.unavailable() is None
    limits = _sandbox.Limits(timeout=timeout, memory_mb=memory_mb, cpu_seconds=cpu_seconds, file_mb=file_mb,
                             max_output=max_output)
    result = await _sandbox.run(_sandbox.python_argv(code, limits.threads if isolated else 0), limits,
                                sandbox=isolated)
    out_text = result.stdout.decode("utf-8", "replace")
    if result.truncated:
        return out_text.strip() or "(no output)"
    if result.returncode is None:
        return f"error: timed out after {timeout:g} s"
    if result.returncode != 0:
        tail = result.stderr.decode("utf-8", "replace").strip().splitlines()[-1:] or [""]
        code_ = result.returncode
        reason = f"killed by signal {-code_}" if code_ < 0 else f"exit status {code_}"
        return f"error: {reason}: {tail[0][:200]}"
    return out_text.strip() or "(no output)"
