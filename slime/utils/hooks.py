"""Load user extension functions given by dotted path (`--custom-*-path`, `--dynamic-sampling-filter-path`).

A path is `package.module.function` (importable from `sys.path`, e.g. the working
directory or `PYTHONPATH`) or `path/to/file.py:function`. Every failure is a
`SlimeConfigError` whose message names the flag and the path. Signatures of every
hook are documented in docs/algorithms.md.

Original slime's own built-ins (`slime.rollout.filter_hub...`, `slime.rollout.sft_rollout...`, as
its launch scripts pass them) resolve through the alias table of `slime.utils.slime_paths` first.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import sys
from pathlib import Path
from typing import Callable

from slime.utils import slime_paths
from slime.utils.errors import SlimeConfigError

logger = logging.getLogger(__name__)


def _import_file(path: Path, flag: str, spec_text: str):
    name = f"_slime_hook_{abs(hash(str(path.resolve())))}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SlimeConfigError(f"{flag} {spec_text}: cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise SlimeConfigError(f"{flag} {spec_text}: importing {path} failed: {type(e).__name__}: {e}") from e
    return module


@functools.lru_cache(maxsize=None)
def load_function(path: str, flag: str = "--custom-function-path") -> Callable:
    """Return the callable at `path`; `flag` names the option in error messages. Cached per path."""
    if not path or not isinstance(path, str):
        raise SlimeConfigError(f"{flag}: empty function path")
    alias = slime_paths.resolve(path, flag)
    if alias is not None:
        target, entry = alias
        logger.info("%s %s: original slime's path, resolved to %s", flag, path, target)
        if entry.note:
            logger.warning("%s %s: %s", flag, path, entry.note)
        return load_function(target, flag)
    if ":" in path:
        file_part, _, attr = path.rpartition(":")
        file = Path(file_part)
        if not file.is_file():
            raise SlimeConfigError(f"{flag} {path}: file {file_part} does not exist")
        module = _import_file(file, flag, path)
    else:
        module_name, _, attr = path.rpartition(".")
        if not module_name:
            raise SlimeConfigError(f"{flag} {path}: expected a dotted path module.function or file.py:function")
        try:
            module = importlib.import_module(module_name)
        except Exception as e:
            hint = (" (an original slime path with no equivalent here: see docs/coming_from_slime.md)"
                    if isinstance(e, ModuleNotFoundError) and (e.name or "").startswith("slime.") else "")
            raise SlimeConfigError(f"{flag} {path}: cannot import module {module_name!r}: "
                                   f"{type(e).__name__}: {e}{hint}") from e
    fn = getattr(module, attr, None)
    if fn is None:
        raise SlimeConfigError(f"{flag} {path}: module has no attribute {attr!r}")
    if not callable(fn):
        raise SlimeConfigError(f"{flag} {path}: {attr!r} is not callable")
    return fn
