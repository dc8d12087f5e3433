"""Colocated memory handoff: the trainer's offload/onload (bitwise, RSS measured), the weight-push
modes against a real native engine (tensor, distributed broadcast, /dev/shm by path), and the
mode each run shape gets."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from slime.training.offload import Offloader, backend_tensors, rss_bytes, trim_heap

MB = 1 << 20


def _args(model, data, *extra):
    from slime.arguments import parse_args

    argv = ["train.py", "--hf-checkpoint", str(model), "--prompt-data", str(data), "--input-key", "prompt",
            "--label-key", "label", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
            "--global-batch-size", "4", "--num-rollout", "1", *extra]
    old = sys.argv
    sys.argv = argv
    try:
        return parse_args()
    finally:
        sys.argv = old


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    import json

    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"1+{i}=", "label": str(1 + i)}) + "\n" for i in range(8)))
    return path


def test_offloader_frees_rss_and_restores_bits(tmp_path):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4 << 20)) for _ in range(6)]  # 6 x 16 MiB
    opt = torch.optim.AdamW(params, lr=1e-2)
    sum(p.sum() for p in params).backward()
    opt.step()  # creates exp_avg / exp_avg_sq (2 x 96 MiB)
    opt.zero_grad(set_to_none=True)
    tensors = params + [v for st in opt.state.values() for v in st.values()]
    before = [t.detach().clone() for t in tensors]
    expected = sum(t.numel() * t.element_size() for t in tensors if t.dim() > 0)
    trim_heap()
    rss0 = rss_bytes()

    off = Offloader(str(tmp_path))
    stats = off.offload(tensors)
    rss1 = rss_bytes()
    assert off.is_offloaded and stats["bytes"] >= expected
    assert all(t.untyped_storage().nbytes() == 0 for t in params)
    assert rss0 - rss1 > 0.9 * expected, (rss0 / MB, rss1 / MB, expected / MB)  # really gone from RAM
    assert off.offload(tensors)["bytes"] == 0  # idempotent

    back = off.onload()
    rss2 = rss_bytes()
    assert back["bytes"] == stats["bytes"] and not off.is_offloaded
    assert rss2 - rss1 > 0.9 * expected
    for t, b in zip(tensors, before):
        assert torch.equal(t.detach(), b)
    assert not list(tmp_path.iterdir())  # the spill file is removed
    # the optimizer still owns the same tensors and keeps stepping
    sum(p.sum() for p in params).backward()
    opt.step()
    assert all(torch.isfinite(p).all() for p in params)


def test_offload_frees_only_the_training_devices_storages(tmp_path, caplog):
    """On a GPU the reference model and --optimizer-cpu-offload's state live in pinned host memory
    (not resizable): they are already off the device, so offloading for the engines leaves them
    where they are instead of warning that they "stay resident" (seen on an H100)."""
    host = [torch.randn(1024), torch.randn(2048)]
    off = Offloader(str(tmp_path))
    with caplog.at_level("WARNING"):
        stats = off.offload(host, torch.device("cuda"))  # a GPU run: these host tensors are not on its device
    assert stats["bytes"] == 0 and stats["kept_bytes"] == 0 and "stay resident" not in caplog.text
    assert all(t.untyped_storage().nbytes() == t.numel() * 4 for t in host)
    off.onload()
    stats = Offloader(str(tmp_path)).offload(host, torch.device("cpu"))  # a CPU run: the host is the device
    assert stats["bytes"] == (1024 + 2048) * 4 and all(t.untyped_storage().nbytes() == 0 for t in host)


@pytest.mark.parametrize("backend", [[], pytest.param(["--train-backend", "megatron", "--bf16"], marks=pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"))], ids=["fsdp", "megatron_bf16"])
def test_train_actor_offload_round_trip(tiny_model_dir, data_file, monkeypatch, tmp_path, backend):
    """A real fsdp-backend rank (world size 1: the plain module; two sharded ranks are in
    test_fsdp_trainer.py), and a megatron rank with --bf16 (its fp32 main copies too): offload frees
    params + optimizer + the mmap'd reference model, @resident methods still work while offloaded,
    onload is bitwise."""
    from slime.training.actor import TrainActor

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    args = _args(tiny_model_dir, data_file, "--colocate", "--use-kl-loss", "--kl-loss-coef", "0.01", *backend)
    from slime.utils.net import free_port

    actor = TrainActor(args, 0, 1, master_port=free_port("127.0.0.1"))
    actor.init()
    try:
        be = actor.backend
        # one optimizer step so there is optimizer state to offload
        be.model.zero_grad()
        from slime.training.backend import MicroBatch

        mb = MicroBatch([[1, 5, 6, 7, 8]], [3])
        be.train_step([mb], lambda k, lp, ent: -lp.sum())
        from slime.training.offload import _local

        tensors = backend_tensors(be)
        before = [_local(t).detach().clone() for t in tensors]
        n_weights = len(list(be.named_weights()))  # HF names (megatron fuses some of its parameters)
        assert any(isinstance(v, torch.Tensor) and v.dim() > 0 for st in be.optimizer.state.values()
                   for v in st.values())  # exp_avg / exp_avg_sq exist
        n_bytes = sum(_local(t).untyped_storage().nbytes() for t in tensors)

        stats = actor.offload()
        assert actor._offloader.is_offloaded
        assert 0.9 * n_bytes <= stats["bytes"] <= n_bytes
        assert be.ref_model is not None
        assert all(p.untyped_storage().nbytes() == 0 for p in be.ref_model.parameters())
        assert all(_local(p).untyped_storage().nbytes() == 0 for p in be.model.parameters())
        if backend:
            assert be.main_params.tensors() and all(t.untyped_storage().nbytes() == 0
                                                    for t in be.main_params.tensors())
        # a @resident call while offloaded onloads for the call and offloads again
        assert actor.check_weights([]) == n_weights
        assert actor._offloader.is_offloaded

        back = actor.onload()
        assert back["bytes"] == stats["bytes"] and not actor._offloader.is_offloaded
        for t, b in zip(backend_tensors(be), before):
            assert torch.equal(_local(t).detach(), b)
        # and training goes on from the restored state
        assert torch.isfinite(torch.tensor(be.train_step([mb], lambda k, lp, ent: -lp.sum())))
    finally:
        actor.shutdown()


@pytest.mark.parametrize("shape,expected", [
    ((False, "native"), "distributed"), ((True, "native"), "disk"), ((False, "sglang"), "distributed"),
    ((True, "sglang"), None), ((False, "vllm"), "distributed"), ((True, "vllm"), "tensor"),
])
def test_auto_mode_per_run_shape(shape, expected):
    """What `auto` means per run shape, resolved once at parse time by the engine kind (the trainer's
    transport is then chosen from the resolved mode). SGLang takes weights by broadcast only, so a
    colocated SGLang run (None) is refused with the message that says why."""
    from slime.engines.kinds import KINDS
    from slime.utils.errors import SlimeConfigError

    colocate, backend = shape
    kind = KINDS[backend]
    if expected is None:
        with pytest.raises(SlimeConfigError, match="colocated SGLang .* is not implemented, so drop --colocate"):
            kind.resolve_update_weights_mode("auto", colocate)
    else:
        assert kind.resolve_update_weights_mode("auto", colocate) == expected
    if backend == "sglang":
        with pytest.raises(SlimeConfigError, match="--rollout-backend sglang takes weights by broadcast"):
            kind.resolve_update_weights_mode("tensor", colocate)
    else:
        assert kind.resolve_update_weights_mode("tensor", colocate) == "tensor"


def test_flags_resolve_and_refuse(tiny_model_dir, data_file):
    from slime.utils.errors import SlimeConfigError

    assert _args(tiny_model_dir, data_file).update_weights_mode == "distributed"
    assert _args(tiny_model_dir, data_file, "--colocate").update_weights_mode == "disk"
    assert _args(tiny_model_dir, data_file, "--update-weights-mode", "tensor").update_weights_mode == "tensor"
    with pytest.raises(SlimeConfigError, match="--update-weights-mode disk needs --rollout-backend native"):
        _args(tiny_model_dir, data_file, "--update-weights-mode", "disk", "--rollout-backend", "vllm")


@pytest.mark.parametrize("mode", ["tensor", "distributed", "disk"])
def test_push_modes_reach_a_native_engine(tiny_model_dir, data_file, mode, tmp_path):
    """Each mode puts new weights into a running native engine, bucket by bucket, checked by the
    engine's checksums; the distributed group is made once and reused, and made again when the
    engine no longer has it (a restart)."""
    from transformers import AutoModelForCausalLM

    from slime.engines.control import EngineControl
    from slime.engines.kinds import engine_kind
    from slime.training.weight_sync import make_transport
    from slime.utils.net import LOOPBACK
    from slime.utils.weights import tensor_digest
    from tests.helpers.native_server import native_server

    args = _args(tiny_model_dir, data_file, "--update-weights-mode", mode, "--update-weight-buffer-size", "256KiB")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    transport = make_transport(args, rank=0)
    assert type(transport).__name__ == {"tensor": "TensorTransport", "distributed": "DistributedTransport",
                                        "disk": "DiskTransport"}[mode]
    # started with the run's access flags, as the launcher starts it (its weight directory, loopback)
    access = engine_kind(args).access_flags(args, [LOOPBACK])
    with native_server(tiny_model_dir, tmp_path / "engine.log", *access) as (url, _proc):
        engine = EngineControl(url)
        first_group = None
        try:
            for version in (1, 2, 3):
                if mode == "distributed" and version == 3:  # as if the engine had been restarted
                    engine.destroy_weights_update_group(transport.group.group_name)
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(0.01 * version)
                transport.connect([url])
                stats = transport.push(list(model.named_parameters()), version)
                assert stats["bytes"] == total
                assert stats["buckets"] >= total // (256 << 10) >= 4  # several bounded buckets
                served = engine.weights_checksum()
                assert served == {n: tensor_digest(p) for n, p in model.named_parameters()}
                assert engine.weight_version() == str(version)
                if mode == "distributed":  # made once and reused; rebuilt when the engine lost it
                    group = transport.group
                    assert group is not None and (version == 1 or (group is first_group) == (version == 2))
                    first_group = group if version == 1 else first_group
        finally:
            transport.close()
