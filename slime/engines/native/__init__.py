"""The embedded native inference engine (pure PyTorch, CPU and GPU).

`NativeEngine` is the model + continuous-batching scheduler; `create_app` serves it over
SGLang's native HTTP protocol; `python -m slime.engines.native` runs it standalone.
Importing this package does not import torch (the submodules do).
"""

from __future__ import annotations

__all__ = ["NativeEngine", "GenerationResult", "create_app"]


def __getattr__(name):
    if name in ("NativeEngine", "GenerationResult"):
        from slime.engines.native import engine

        return getattr(engine, name)
    if name == "create_app":
        from slime.engines.native.server import create_app

        return create_app
    raise AttributeError(name)
