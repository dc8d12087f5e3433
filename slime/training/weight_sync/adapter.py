"""`--lora-sync adapter`: the engines hold the base model once and receive only the LoRA adapter.

On each push rank 0 writes the adapter (a few megabytes) as a peft directory
(`adapter_config.json` + `adapter_model.safetensors`) under the run's weight directory (the one its
engines are told to read from, `slime.engines.auth.run_weights_dir`), then every engine swaps it in
with SGLang's calls: `/unload_lora_adapter` of the policy adapter's name (an engine that does not
hold it yet, e.g. a restarted one, answers 400, which is fine), `/load_lora_adapter` of the new
directory under the same name, `/update_weight_version`. Requests name the adapter in `lora_path`
(`slime.engines.fleet.EnginePool` adds it to every `/generate`). The previous push's directory is
removed once every engine has the new one.

The swap happens while no request runs or the engines are paused (the drivers push between
generations, `--fully-async` pauses first), so no request sees the moment without an adapter. The
engines must read the trainer's filesystem (same host, or a shared one); elsewhere use
`--lora-sync merged`.
"""

from __future__ import annotations

import shutil
import time
import uuid
from functools import partial
from pathlib import Path
from typing import Iterable

from torch import Tensor

from slime.engines.control import EngineControl, EngineError
from slime.engines.kinds import POLICY_LORA_NAME
from slime.training.weight_sync.buckets import DEFAULT_TIMEOUT, call_all, engine_pool, tensor_bytes
from slime.training.weight_sync.disk import own_directory
from slime.utils import run_dirs


class AdapterTransport:
    """Rank 0 writes the adapter and has every engine load it; the other ranks only take part in
    gathering the adapter's tensors."""

    def __init__(self, rank: int, directory: str, config: dict, *, timeout: float = DEFAULT_TIMEOUT):
        self.rank = rank
        self.directory = directory
        self.config = config
        self.timeout = timeout
        self.engines: list[EngineControl] = []
        self._served: Path | None = None  # the directory the engines hold now

    def connect(self, engine_urls: list[str]) -> None:
        self.engines = [EngineControl(url, timeout=self.timeout) for url in engine_urls]

    def push(self, named_weights: Iterable[tuple[str, Tensor]], weight_version) -> dict[str, float]:
        """Collective over the train ranks. Returns {"bytes": adapter tensor bytes, "payload_bytes": bytes of
        the files, "buckets": 1, "seconds", "num_engines"} (zero counts on the other ranks)."""
        t0 = time.perf_counter()
        tensors = dict(named_weights)
        if self.rank != 0:
            return {"bytes": 0, "payload_bytes": 0, "buckets": 0, "seconds": time.perf_counter() - t0,
                    "num_engines": 0}
        out = Path(own_directory(self.directory)) / f"lora-v{weight_version}-{uuid.uuid4().hex[:8]}"
        from slime.training.lora import write_adapter  # here: slime.training.lora imports peft

        write_adapter(out, tensors, self.config)
        with engine_pool(len(self.engines)) as pool:
            call_all(pool, [partial(self._swap, e, str(out), weight_version) for e in self.engines])
        previous, self._served = self._served, out
        if previous is not None and previous != out and len(self.engines) > 0:
            shutil.rmtree(previous, ignore_errors=True)
        return {"bytes": tensor_bytes(list(tensors.items())),
                "payload_bytes": sum(f.stat().st_size for f in out.iterdir()), "buckets": 1,
                "seconds": time.perf_counter() - t0, "num_engines": len(self.engines)}

    @staticmethod
    def _swap(engine: EngineControl, path: str, weight_version) -> None:
        try:
            engine.unload_lora_adapter(POLICY_LORA_NAME)
        except EngineError as e:
            if e.status != 400:  # 400: this engine holds no policy adapter yet
                raise
        engine.load_lora_adapter(POLICY_LORA_NAME, path)
        engine.update_weight_version(str(weight_version))

    def close(self) -> None:
        self.engines = []
        if self._served is not None:
            shutil.rmtree(self._served, ignore_errors=True)
            self._served = None
        run_dirs.release(self.directory)  # removed unless another rank of the run still holds it
