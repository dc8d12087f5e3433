"""What one request may send the vLLM adapter: the body cap of each route, checked before the body
is read (413 naming the cap; `slime.engines.serving.body_limits`), as the native engine's are."""

from __future__ import annotations

from pathlib import Path

from slime.engines.control import Route
from slime.engines.serving import BodyCap

GENERATION_BODY_BYTES = 256 << 20  # the native engine's most for a generation request
CONTROL_BODY_BYTES = 16 << 20  # control routes: paths, versions, group addresses, LoRA names


def body_caps(model_path: str) -> dict[str, BodyCap]:
    """Caps by route path ("" for the other routes). A weight bucket may be the whole model, pushed
    in up to 4 times the checkpoint's bytes per element (bf16 on disk, fp32 pushed: 2x; 4x leaves
    room), plus headers."""
    checkpoint_bytes = sum(f.stat().st_size for f in Path(model_path).glob("*.safetensors"))
    weights = 4 * checkpoint_bytes + (1 << 20) if checkpoint_bytes else 1 << 40
    return {Route.GENERATE.path: (GENERATION_BODY_BYTES, "the adapter's cap of a generation request"),
            Route.UPDATE_WEIGHTS_FROM_TENSOR.path: (weights, "4 x the checkpoint's safetensors bytes + 1 MiB"),
            "": (CONTROL_BODY_BYTES, "the adapter's cap of control routes")}
