"""Trainer -> engines weight sync: one `WeightTransport` per train rank, chosen once per run.

`make_transport(args, rank)` picks the transport of `--update-weights-mode` (resolved at parse
time by the engine kind, `slime.engines.kinds`):

- `distributed.DistributedTransport` (`distributed`, the default without --colocate): buckets
  announced over HTTP and broadcast over a process group rank 0 shares with the engines; a push
  to a subset of the engines goes by `tensor` (logged);
- `disk.DiskTransport` (`disk`, the default with --colocate and the native engine): buckets as
  safetensors files in /dev/shm, loaded by path, colocated ranks feeding their own engines;
- `tensor.TensorTransport` (`tensor`): safetensors bytes in the request body;
- `adapter.AdapterTransport` (`--lora-sync adapter`, whatever the mode): only the LoRA adapter, as a
  peft directory each engine loads with `/load_lora_adapter`.

All of them push through the one bucket loop (`buckets.push_buckets`: buckets of at most
`--update-weight-buffer-size` tensor bytes, the last one marked) and talk to engines only through
`slime.engines.control.EngineControl`. `check_engine_weights` is `--check-weight-update-equal`.

A push is collective over the train ranks: every rank iterates the named weights (the full
tensors are gathered from shards), only the sending rank(s) talk to engines.
"""

from __future__ import annotations

from typing import Callable, Iterable, Protocol

from torch import Tensor

from slime.engines.auth import run_weights_dir
from slime.engines.kinds import engine_kind
from slime.training.weight_sync.adapter import AdapterTransport
from slime.training.weight_sync.buckets import BucketCounts, iter_buckets, push_buckets
from slime.training.weight_sync.check import check_engine_weights
from slime.training.weight_sync.disk import DiskTransport
from slime.training.weight_sync.distributed import BroadcastGroup, DistributedTransport, init_broadcast_group
from slime.training.weight_sync.tensor import TensorTransport, serialize_bucket

__all__ = [
    "AdapterTransport", "BroadcastGroup", "BucketCounts", "DiskTransport", "DistributedTransport", "TensorTransport", "TRANSPORTS",
    "WeightTransport", "check_engine_weights", "init_broadcast_group", "iter_buckets", "make_transport",
    "push_buckets", "serialize_bucket",
]


class WeightTransport(Protocol):
    """How one train rank's weights reach the engines."""

    def connect(self, engine_urls: list[str]) -> None:
        """The engines the next push goes to (all of the run's, or the restarted ones)."""

    def push(self, named_weights: Iterable[tuple[str, Tensor]], weight_version) -> dict[str, float]:
        """Send every (HF name, full tensor); the engines then serve `weight_version`. Collective.
        Returns {"bytes", "buckets", "seconds", "num_engines"} (+ "payload_bytes" where bytes are
        serialized), zero counts on the ranks that send nothing."""

    def close(self) -> None:
        """Release what the transport holds (the broadcast group)."""


def _tensor(args, rank: int) -> TensorTransport:
    return TensorTransport(args.update_weight_buffer_size, rank)


def _distributed(args, rank: int) -> DistributedTransport:
    kind = engine_kind(args)
    return DistributedTransport(args.update_weight_buffer_size, rank, num_engines=args.num_engines,
                                ranks_per_engine=kind.weight_group_ranks(args), sessions=kind.weight_update_sessions)


def _disk(args, rank: int) -> DiskTransport:
    return DiskTransport(args.update_weight_buffer_size, rank, num_engines=args.num_engines,
                         gpus_per_engine=args.rollout_num_gpus_per_engine if args.colocate else None,
                         directory=run_weights_dir(args.engine_api_key))


TRANSPORTS: dict[str, Callable[..., WeightTransport]] = {
    "tensor": _tensor, "distributed": _distributed, "disk": _disk,
}


def make_transport(args, rank: int, adapter_config: dict | None = None) -> WeightTransport:
    """This rank's transport for `args.update_weights_mode` (already resolved by the parser), or the
    LoRA adapter's (`adapter_config`: its peft config) with `--lora-sync adapter`."""
    if adapter_config is not None:
        return AdapterTransport(rank, run_weights_dir(args.engine_api_key), adapter_config)
    return TRANSPORTS[args.update_weights_mode](args, rank)
