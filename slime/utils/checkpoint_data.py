"""Checkpoints are data, not code: every file slime loads from a checkpoint is read without running
code a pickle could carry.

- `.pt` files (RNG states, the megatron backend's shards) load with `torch.load(weights_only=True)`:
  tensors and plain containers of numbers and strings only.
- torch distributed checkpoints (`train_state/`, DCP) pickle their `.metadata` and their non-tensor
  entries; `dcp_load` and `dcp_to_dict` read the metadata with an unpickler that builds only DCP's
  own metadata records (and torch dtypes, sizes, layouts, paths), and the entries with
  `weights_only=True`.

A file that holds anything else is refused with one line naming it (`CheckpointRefused`).
"""

from __future__ import annotations

import io
import pathlib
import pickle
import random
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict  # dcp_to_torch_save's loader

from slime.utils.errors import SlimeError


class CheckpointRefused(SlimeError):
    """A checkpoint file holds something other than tensors and plain data."""


def _refused(path, e: Exception) -> CheckpointRefused:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    # torch.load's message starts with advice; the line that names the offending global says why
    why = next((line for line in lines if "global" in line.lower()), lines[0] if lines else type(e).__name__)
    return CheckpointRefused(f"{path}: refused: it holds Python objects other than tensors and plain data ({why}); "
                             "slime's checkpoints never do, so it was not written by slime or was altered")


def load_tensors_file(path: str | Path, map_location=None) -> Any:
    """A `.pt` file of tensors and plain containers (`torch.load(weights_only=True)`)."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise _refused(path, e) from None


def _metadata_globals() -> dict[tuple[str, str], Any]:
    allowed = {("torch", "Size"): torch.Size, ("pathlib", "PosixPath"): pathlib.PosixPath,
               ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
               ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
               ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo}
    for name in dir(torch):  # dtypes, layouts, memory formats: values, not callables that run code
        value = getattr(torch, name, None)
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            allowed["torch", name] = value
    for name, value in vars(dcp_metadata).items():  # DCP's metadata records (dataclasses, enums)
        if isinstance(value, type) and value.__module__ == dcp_metadata.__name__:
            allowed[dcp_metadata.__name__, name] = value
    return allowed


_METADATA_GLOBALS = _metadata_globals()


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            return _METADATA_GLOBALS[module, name]
        except KeyError:
            raise pickle.UnpicklingError(f"global '{module}.{name}' is not a DCP metadata record") from None


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader, with the `.metadata` pickle limited to DCP's metadata records. A refusal
    is also kept in `refusal` (DCP wraps what its reader raises)."""

    refusal: CheckpointRefused | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f).load()
            except pickle.UnpicklingError as e:
                self.refusal = _refused(path, e)
                raise self.refusal from None
        if not isinstance(metadata, dcp_metadata.Metadata):
            self.refusal = _refused(path, TypeError(f"a {type(metadata).__name__}, not DCP metadata"))
            raise self.refusal
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _WeightsOnlyBytes:
    """A load planner whose non-tensor entries (optimizer hyper-parameters, steps) load weights-only
    (DefaultLoadPlanner.load_bytes, with torch.load's weights_only=True)."""

    refusal: CheckpointRefused | None = None

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            self.refusal = _refused(f"{self.checkpoint_dir}: DCP entry {read_item.dest_index.fqn!r}", e)
            raise self.refusal from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class SafeLoadPlanner(_WeightsOnlyBytes, DefaultLoadPlanner):
    pass


class _SafeEmptyStateDictLoadPlanner(_WeightsOnlyBytes, _EmptyStateDictLoadPlanner):
    pass


def _load(state_dict: dict, path: str | Path, planner, load) -> None:
    reader = SafeFileSystemReader(str(path))
    planner.checkpoint_dir = str(path)
    try:
        load(state_dict, storage_reader=reader, planner=planner)
    except BaseException:
        refusal = reader.refusal or planner.refusal
        if refusal is not None:  # one line, not DCP's wrapping of it
            raise refusal from None
        raise


def dcp_load(state_dict: dict, path: str | Path) -> None:
    """`torch.distributed.checkpoint.load` of `state_dict` (in place) from the directory `path`."""
    _load(state_dict, path, SafeLoadPlanner(), dcp.load)


def dcp_to_dict(path: str | Path) -> dict:
    """Everything in the DCP directory `path`, as full tensors and plain data, in this process (no
    process group); what torch's dcp_to_torch_save reads, without its unrestricted pickles."""
    state: dict = {}
    _load(state, path, _SafeEmptyStateDictLoadPlanner(), partial(_load_state_dict, no_dist=True))
    return state


def rng_states() -> dict:
    """Python, NumPy and torch (CPU and CUDA) random states, for exact resume, as tensors and plain
    numbers (a file of them loads with torch.load's weights_only=True)."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    states = {"python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
              "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                        "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
              "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict) -> None:
    py, npy = states["python"], states["numpy"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss"]))
    np.random.set_state((npy["kind"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"],
                         npy["cached_gaussian"]))
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
