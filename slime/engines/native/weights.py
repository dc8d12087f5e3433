"""Weight and memory management of the native engine (a part of `NativeEngine`).

In-place updates by Hugging Face parameter name from tensors, a Hugging Face
directory or a broadcast over a weights-update process group; checksums; and
release/resume of memory for colocated training. Every method runs between
scheduler steps (under `NativeEngine._exclusive`).
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from slime.engines.control import Route
from slime.engines.native.weight_group import destroy_group, new_group
from slime.engines.protocol import ProtocolError
from slime.utils import run_dirs
from slime.utils.weights import tensor_digest

MAX_ELEMENT_BYTES = 8  # the widest dtype a weight update may send (float64 / int64)


class EngineWeights:
    """Mixed into `NativeEngine`; uses its model, device, lock and statistics."""

    def _check_meta(self, name: str, shape, is_float: bool, dtype, field: str | None = None) -> torch.Tensor | None:
        """The parameter `name` an incoming tensor of `shape` / `dtype` is copied into; ProtocolError
        (naming `field`, default the name) when the model has no such parameter, or it has
        another shape, or a floating parameter would get integers."""
        p = self._params_by_name.get(name)
        who = "" if field is None else f"{name!r}: "
        field = name if field is None else field
        if p is None:
            raise ProtocolError(field, f"{who}unknown parameter name (not in the model's state dict)")
        if tuple(shape) != tuple(p.shape):
            raise ProtocolError(field, f"{who}shape mismatch: got {tuple(shape)}, model has {tuple(p.shape)}")
        if not (is_float or not p.is_floating_point()):
            raise ProtocolError(field, f"{who}dtype mismatch: got {dtype}, model has {p.dtype}")
        return p

    def _check_tensors(self, tensors: dict[str, torch.Tensor], skip_unknown_suffixes=()) -> list[tuple]:
        pairs = []
        for name, t in tensors.items():
            if name not in self._params_by_name and any(name.endswith(s) for s in skip_unknown_suffixes):
                continue
            pairs.append((self._check_meta(name, t.shape, t.is_floating_point(), t.dtype), t))
        return pairs

    def check_safetensors_header(self, header: dict[str, tuple[str, list[int]]],
                                 skip_unknown_suffixes: tuple[str, ...] = ()) -> None:
        """Check the tensors a safetensors header announces against the model, before any is loaded."""
        self._check_weights_resident()
        for name, (dtype, shape) in header.items():
            if name not in self._params_by_name and any(name.endswith(s) for s in skip_unknown_suffixes):
                continue
            self._check_meta(name, shape, dtype.startswith(("F", "BF")), dtype)

    def check_distributed(self, names: list[str], dtypes: list[torch.dtype], shapes: list[list[int]]) -> None:
        """Check what `/update_weights_from_distributed` announces against the model before anything
        is received (a shape the model does not have is never allocated)."""
        self._check_weights_resident()
        for i, (name, dtype, shape) in enumerate(zip(names, dtypes, shapes)):
            self._check_meta(name, shape, dtype.is_floating_point, dtype, field=f"names[{i}]")

    def weight_body_bytes(self) -> int:
        """The most bytes a legal `/update_weights_from_tensor` body takes: every parameter (tied
        ones under each name) at MAX_ELEMENT_BYTES an element, plus the safetensors header."""
        data = sum(p.numel() for p in self._params_by_name.values()) * MAX_ELEMENT_BYTES
        return data + 8 + (1 << 20) + self.parameter_names_bytes()

    def parameter_names_bytes(self) -> int:
        """Room for every parameter's name with its dtype and shape in a JSON body or a header."""
        return sum(len(n) + 128 for n in self._params_by_name)

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
        skip = ("rotary_emb.inv_freq",)
        for f in files:  # every file's header is checked before any file is loaded
            self.check_safetensors_header(safetensors_file_header(f), skip)
        tensors: dict[str, torch.Tensor] = {}
        for f in files:
            try:
                tensors.update(load_file(str(f)))
            except Exception as e:  # noqa: BLE001 - a file the header check passed but safetensors refuses
                raise ProtocolError("model_path", f"{Route.UPDATE_WEIGHTS_FROM_DISK.path}: {f} is not a safetensors file "
                                                  f"({type(e).__name__}: {e})") from None
        version = self._copy_in(tensors, weight_version, skip_unknown_suffixes=skip)
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

        Names, dtypes and shapes are checked against the model first (`check_distributed`): a
        mismatch is a ProtocolError before anything is received (the trainer's end sees the refusal
        and stops broadcasting), and nothing is copied."""
        entry = self._groups.get(group_name)
        if entry is None:
            raise ProtocolError("group_name", f"no weight update group named {group_name!r}; "
                                              "call /init_weights_update_group first")
        self.check_distributed(names, dtypes, shapes)
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


def safetensors_header(data: bytes, field: str, what: str, size: int | None = None) -> dict[str, tuple[str, list]]:
    """{name: (dtype, shape)} from the start of a safetensors payload (`data`: at least its header;
    `size`: the payload's whole length, default len(data)). ProtocolError(field, ...) when it is
    truncated or not safetensors; `what` is the message's subject with its verb ("the bytes ... are")."""
    size = len(data) if size is None else size
    if size < 8:
        raise ProtocolError(field, f"{what} truncated: {size} bytes, fewer than the 8 of the header's length")
    hlen = int.from_bytes(bytes(data[:8]), "little")
    if hlen > size - 8:
        raise ProtocolError(field, f"{what} truncated: the header says it is {hlen} bytes, {size - 8} follow")
    try:
        header = json.loads(bytes(data[8:8 + hlen]))
    except (ValueError, RecursionError):
        raise ProtocolError(field, f"{what} not safetensors: the header is not JSON") from None
    if not isinstance(header, dict):
        raise ProtocolError(field, f"{what} not safetensors: the header is not a JSON object")
    out, end = {}, 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, stop) = entry["dtype"], entry["shape"], entry["data_offsets"]
            ok = (isinstance(dtype, str) and isinstance(shape, list)
                  and all(isinstance(x, int) and x >= 0 for x in [*shape, begin, stop]) and begin <= stop)
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise ProtocolError(field, f"{what} not safetensors: the header's entry {name!r} is malformed")
        out[name] = (dtype, shape)
        end = max(end, stop)
    if end > size - 8 - hlen:
        raise ProtocolError(field, f"{what} truncated: the header places tensor data up to byte {end}, "
                                   f"{size - 8 - hlen} bytes of it arrived")
    return out


def safetensors_file_header(path: Path) -> dict[str, tuple[str, list]]:
    """`safetensors_header` of a file (reads only its header)."""
    what = f"{Route.UPDATE_WEIGHTS_FROM_DISK.path}: {path} is"
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        hlen = int.from_bytes(head, "little") if len(head) == 8 else 0
        if len(head) == 8 and hlen <= size - 8:
            head += f.read(hlen)
    return safetensors_header(head, "model_path", what, size=size)


def _trim_heap() -> None:
    """Give freed heap pages back to the OS (glibc keeps them otherwise)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
