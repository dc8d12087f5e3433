"""The quickstart's `--dtype auto`: bf16 where the machine runs bf16 matmuls natively (a GPU, AMX,
AVX512_BF16), fp32 elsewhere; `--dtype fp32|bf16` overrides it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "examples"))

import quickstart  # noqa: E402


@pytest.mark.parametrize("cuda, amx, avx512_bf16, flags, why", [
    (False, False, False, [], "this CPU has no native bf16"),
    (False, False, True, ["--bf16"], "AVX512_BF16 runs bf16 natively"),
    (False, True, True, ["--bf16"], "AMX runs bf16 natively"),
    (True, False, False, ["--bf16"], "a CUDA GPU runs bf16 natively"),
])
def test_auto_picks_bf16_where_it_is_native(monkeypatch, cuda, amx, avx512_bf16, flags, why):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    got, line = quickstart.choose_dtype("auto")
    assert got == flags and why in line
    assert line.startswith("dtype: bf16" if flags else "dtype: fp32")
    # an explicit choice wins on every machine
    assert quickstart.choose_dtype("fp32") == ([], "dtype: fp32")
    assert quickstart.choose_dtype("bf16") == (["--bf16"], "dtype: bf16")


def test_the_private_torch_probes_still_exist():
    """`native_bf16` asks torch.cpu's private AMX / AVX512_BF16 probes: a torch upgrade that drops them
    fails here, not in a user's quickstart."""
    assert quickstart.native_bf16() in (None, "a CUDA GPU", "AMX", "AVX512_BF16")


def test_a_wrong_dtype_is_one_line():
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "quickstart.py"), "--output-dir", "unused",
                           "--dtype", "fp16"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2
    assert "argument --dtype: invalid choice: 'fp16'" in proc.stderr and "fp32" in proc.stderr
