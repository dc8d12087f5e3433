"""Weight and memory management of the native engine (a part of `NativeEngine`).

In-place updates by Hugging Face parameter name from tensors, a Hugging Face
directory or a broadcast over a weights-update process group; checksums; and
release/resume of memory for colocated training. Every method runs between
scheduler steps (under `NativeEngine._exclusive`).
"""

from __future__ import annotations

import ctypes
import gc
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from slime.engines.native.weight_group import destroy_group, new_group
from slime.engines.protocol import ProtocolError
from slime.utils import run_dirs
from slime.utils.weights import tensor_digest


class EngineWeights:
    """Mixed into `NativeEngine`; uses its model, device, lock and statistics."""

    def _check_tensors(self, tensors: dict[str, torch.Tensor], skip_unknown_suffixes=()) -> list[tuple]:
        pairs = []
        for name, t in tensors.items():
            p = self._params_by_name.get(name)
            if p is None:
                if any(name.endswith(s) for s in skip_unknown_suffixes):
                    continue
                raise ProtocolError(name, "unknown parameter name (not in the model's state dict)")
            if tuple(t.shape) != tuple(p.shape):
                raise ProtocolError(name, f"shape mismatch: got {tuple(t.shape)}, model has {tuple(p.shape)}")
            if not (t.is_floating_point() or not p.is_floating_point()):
                raise ProtocolError(name, f"dtype mismatch: got {t.dtype}, model has {p.dtype}")
            pairs.append((p, t))
        return pairs

    def update_weights(self, tensors: dict[str, torch.Tensor], weight_version: str | None = None) -> str:
        """Copy tensors (by Hugging Face parameter name) into the model in place, between
        scheduler steps. All names/shapes are checked before anything is copied."""
        return self._copy_in(tensors, weight_version)

    def weights_checksum(self) -> dict[str, str]:
        """{parameter name: sha256 of its bytes} for every parameter (tied ones once), between steps."""
        self._check_weights_resident()
        with self._exclusive():
            return {name: tensor_digest(p) for name, p in self.model.named_parameters()}

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> str:
        """Load every *.safetensors file of a Hugging Face directory in place."""
        path = Path(model_path)
        if not path.is_dir():
            raise ProtocolError("model_path", f"{model_path!r} is not a directory")
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ProtocolError("model_path", f"no *.safetensors files in {model_path!r}")
        tensors: dict[str, torch.Tensor] = {}
        for f in files:
            tensors.update(load_file(str(f)))
        version = self._copy_in(tensors, weight_version, skip_unknown_suffixes=("rotary_emb.inv_freq",))
        self.model_path = str(model_path)
        return version

    def _copy_in(self, tensors: dict[str, torch.Tensor], weight_version: str | None,
                 skip_unknown_suffixes: tuple[str, ...] = ()) -> str:
        """Check every name and shape first, then copy all tensors in place between scheduler
        steps and set the weight version. Returns the (new) weight version."""
        self._check_weights_resident()
        pairs = self._check_tensors(tensors, skip_unknown_suffixes)
        with self._exclusive():
            self._check_weights_resident()
            with torch.no_grad():
                for p, t in pairs:
                    p.copy_(t.to(device=p.device, dtype=p.dtype))
            if weight_version is not None:
                self.weight_version = str(weight_version)
            self._stats["weight_updates"] += 1
        return self.weight_version

    def update_weight_version(self, new_version: str, abort_all_requests: bool = False) -> str:
        """Set the version the engine reports (SGLang's /update_weight_version), between steps;
        `abort_all_requests` first ends every request with finish_reason abort."""
        if abort_all_requests:
            self.abort(abort_all=True)
        with self._exclusive():
            self.weight_version = str(new_version)
        return self.weight_version

    def _check_weights_resident(self) -> None:
        if "weights" in self._released:
            raise ProtocolError("weights", "the weights are released; call /resume_memory_occupation first")

    # ---- weights from a process group (SGLang's /init_weights_update_group protocol)
    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str = "gloo",
                                  timeout_s: float = 600.0, bind_address: str | None = None) -> None:
        """Join a weight-broadcast group as rank `rank_offset` (the trainer is rank 0).

        Blocks until every rank has joined (the trainer joins concurrently). The group is
        private to the trainer and the engines, built the way SGLang's engines build it
        (`slime.engines.native.weight_group`), without torch.distributed's default group."""
        if group_name in self._groups:
            raise ProtocolError("group_name", f"a weight update group named {group_name!r} already exists")
        if backend == "nccl" and self.device.type != "cuda":
            raise ProtocolError("backend", "nccl needs a CUDA device; use gloo on CPU")
        pg, store = new_group(master_address, master_port, rank_offset, world_size, group_name, backend, timeout_s,
                              device=self.device, bind_address=bind_address)
        self._groups[group_name] = (pg, rank_offset, world_size, backend, store)

    def destroy_weights_update_group(self, group_name: str) -> bool:
        entry = self._groups.pop(group_name, None)
        if entry is not None:
            destroy_group(entry[0])
        return entry is not None

    def update_weights_from_distributed(self, names: list[str], dtypes: list[torch.dtype], shapes: list[list[int]],
                                        group_name: str = "weight_update_group",
                                        weight_version: str | None = None) -> str:
        """Receive one broadcast per name from rank 0 of `group_name`, then copy them in place.

        Every tensor is received even when a name or shape does not match the model, so the
        trainer's broadcasts always complete; the mismatch is reported afterwards (ProtocolError)
        and nothing is copied."""
        entry = self._groups.get(group_name)
        if entry is None:
            raise ProtocolError("group_name", f"no weight update group named {group_name!r}; "
                                              "call /init_weights_update_group first")
        pg, _, _, backend, _ = entry
        dev = self.device if backend == "nccl" else torch.device("cpu")
        received = {}
        for name, dtype, shape in zip(names, dtypes, shapes):
            t = torch.empty(tuple(shape), dtype=dtype, device=dev)
            pg.broadcast(t, 0).wait()
            received[name] = t
        return self._copy_in(received, weight_version)

    # ---- colocated training: give memory back while the trainer runs
    def release_memory_occupation(self, tags: list[str] | None = None) -> list[str]:
        """Free the KV cache and/or move the weights off the device ("kv_cache", "weights";
        default both). Generation stops until `resume_memory_occupation`: requests queue.
        On CPU the weights are written to a private temp dir and their RAM is freed; on GPU
        they move to host memory. Refused (ProtocolError) while requests are running."""
        tags = ["kv_cache", "weights"] if not tags else list(tags)
        with self._cv:
            self._released.update(tags)  # the scheduler admits nothing from here on
        with self._exclusive():
            with self._cv:
                busy = len(self._running)
            if busy:
                with self._cv:
                    self._released.difference_update(tags)
                    self._cv.notify_all()
                raise ProtocolError("tags", f"{busy} requests are running; abort them or let them finish before "
                                            "releasing memory")
            self._kv = self._last_tokens = None
            self._kv_tokens = 0
            if "weights" in tags and self._weights_stash is None:
                self._weights_stash = self._stash_weights()
        _trim_heap()
        return sorted(self._released)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> list[str]:
        tags = ["kv_cache", "weights"] if not tags else list(tags)
        with self._exclusive():
            if "weights" in tags and self._weights_stash is not None:
                self._restore_weights(self._weights_stash)
                self._weights_stash = None
            with self._cv:
                self._released.difference_update(tags)
                self._cv.notify_all()
        return sorted(self._released)

    def _stash_weights(self):
        params = dict(self.model.named_parameters())  # tied weights once
        if self.device.type == "cuda":
            stash = {n: p.detach().to("cpu", copy=True) for n, p in params.items()}
            for p in params.values():
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            torch.cuda.empty_cache()
            return ("host", stash)
        tmp = run_dirs.private_dir("slime-native-released-")
        path = os.path.join(tmp, "weights.safetensors")
        save_file({n: p.detach().contiguous() for n, p in params.items()}, path)
        for p in params.values():
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        return ("disk", path)

    def _restore_weights(self, stash) -> None:
        kind, data = stash
        params = dict(self.model.named_parameters())
        if kind == "host":
            for n, p in params.items():
                p.data = data[n].to(self.device)
            return

        with safe_open(data, framework="pt") as f:
            for n, p in params.items():
                t = f.get_tensor(n)
                p.data = torch.empty(t.shape, dtype=t.dtype, device=self.device).copy_(t)

        run_dirs.release(os.path.dirname(data))


def _trim_heap() -> None:
    """Give freed heap pages back to the OS (glibc keeps them otherwise)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
