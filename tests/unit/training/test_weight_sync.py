"""Trainer -> engine weight sync (slime/training/weight_sync/): the shared bucket loop, the
`distributed` transport over a process group (SGLang's /init_weights_update_group +
/update_weights_from_distributed, gloo on CPU: the engine ends up bitwise equal to the sender) and
its logged `tensor` fallback for a push to a subset of the engines."""

from __future__ import annotations

import logging

import pytest
import torch

from slime.engines.control import EngineControl, EngineError, Route
from slime.utils.weights import compare_digests, tensor_digest
from tests.helpers.native_server import native_server


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with native_server(tiny_model_dir, tmp_path_factory.mktemp("bcast") / "log.txt") as (url, proc):
        yield url, proc


# ---------------------------------------------------------------- the bucket loop


def _weights(*numels):
    return [(f"w{i}", torch.zeros(n)) for i, n in enumerate(numels)]  # float32: 4 bytes per element


def test_bucket_loop_marks_only_the_last_bucket_and_counts_bytes():
    from slime.training.weight_sync import push_buckets

    sent = []

    def send(bucket, last):
        sent.append(([n for n, _ in bucket], last))
        return 10 * len(bucket)  # what went over the wire for it

    counts = push_buckets(_weights(256, 256, 256, 256, 256), 2048, send)  # 1 KiB each, 2 KiB buffer
    assert sent == [(["w0", "w1"], False), (["w2", "w3"], False), (["w4"], True)]
    assert (counts.bytes, counts.payload_bytes, counts.buckets) == (5 * 1024, 50, 3)
    sent.clear()
    counts = push_buckets(_weights(256), 2048, send)
    assert sent == [(["w0"], True)] and counts.buckets == 1
    sent.clear()
    assert push_buckets([], 2048, send).buckets == 0 and sent == []


def test_bucket_loop_sends_a_tensor_larger_than_the_buffer_alone(caplog):
    from slime.training.weight_sync import push_buckets

    sent = []
    with caplog.at_level(logging.WARNING):
        counts = push_buckets(_weights(100, 1000, 100, 100), 1024,
                              lambda bucket, last: sent.append(([n for n, _ in bucket], last)) or 0)
    assert sent == [(["w0"], False), (["w1"], False), (["w2", "w3"], True)]
    assert counts.bytes == 1300 * 4 and counts.buckets == 3
    assert "weight w1 (4000 bytes) is larger than the sync buffer (1024 bytes)" in caplog.text


def test_bucket_loop_non_senders_only_iterate():
    """A rank that sends nothing still walks every weight (the gathers behind them are collective)."""
    from slime.training.weight_sync import push_buckets

    walked = []

    def named():
        for name, t in _weights(256, 256, 256):
            walked.append(name)
            yield name, t

    counts = push_buckets(named(), 2048, None)
    assert walked == ["w0", "w1", "w2"]
    assert (counts.bytes, counts.payload_bytes, counts.buckets) == (0, 0, 0)


def test_non_sending_ranks_of_every_transport_only_iterate():
    from slime.training.weight_sync import DiskTransport, DistributedTransport, TensorTransport

    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]  # never called: nothing listens there
    for transport, keys in [
        (TensorTransport(2048, rank=1), {"bytes", "payload_bytes", "buckets", "seconds", "num_engines"}),
        (DistributedTransport(2048, rank=1, num_engines=2), {"bytes", "buckets", "seconds", "num_engines"}),
        (DiskTransport(2048, rank=1, num_engines=2, directory="unused"), {"bytes", "payload_bytes", "buckets", "seconds", "num_engines"}),
        # colocated: rank 1 feeds the engines on its device (engine j on rank j x 2: none here)
        (DiskTransport(2048, rank=1, num_engines=2, gpus_per_engine=2, directory="unused"),
         {"bytes", "payload_bytes", "buckets", "seconds", "num_engines"}),
    ]:
        transport.connect(urls)
        walked = []
        stats = transport.push(((n, t) for n, t in _weights(256, 256) if not walked.append(n)), 3)
        assert walked == ["w0", "w1"]
        assert set(stats) == keys and stats["bytes"] == stats["buckets"] == 0 and stats["num_engines"] == 2
        transport.close()


def test_colocated_disk_ranks_feed_the_engines_on_their_device():
    from slime.training.weight_sync import DiskTransport

    urls = ["http://e0", "http://e1", "http://e2"]
    mine = {}
    for rank in range(6):
        t = DiskTransport(1024, rank, num_engines=3, gpus_per_engine=2, directory="unused")
        t.connect(urls)
        mine[rank] = [e.base_url for e in t.engines]
    assert mine == {0: ["http://e0"], 1: [], 2: ["http://e1"], 3: [], 4: ["http://e2"], 5: []}
    t = DiskTransport(1024, 0, num_engines=3, gpus_per_engine=2, directory="unused")
    t.connect(urls[1:])  # a subset (a restarted engine): rank 0 feeds it
    assert [e.base_url for e in t.engines] == ["http://e1", "http://e2"]


# ---------------------------------------------------------------- the distributed transport


def test_broadcast_weights_bitwise_equal(server, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from slime.training.weight_sync import DistributedTransport

    url, proc = server
    engine = EngineControl(url)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    expected = {n: tensor_digest(p) for n, p in model.named_parameters()}
    assert compare_digests(expected, engine.weights_checksum())  # differs before

    transport = DistributedTransport(1 << 16, rank=0, num_engines=1, backend="gloo")
    transport.connect([url])
    try:
        stats = transport.push(list(model.named_parameters()), "5")
        assert stats["buckets"] > 1 and stats["bytes"] == sum(p.numel() * 4 for p in model.parameters())
        assert engine.weight_version() == "5"
        assert compare_digests(expected, engine.weights_checksum()) == []
        group = transport.group
        assert group.group_name in engine.server_info()["weight_update_groups"]

        # a second update over the same group; a refused bucket fails fast instead of hanging
        with torch.no_grad():
            model.model.norm.weight.mul_(2.0)
        transport.push([("model.norm.weight", model.model.norm.weight)], "6")
        assert transport.group is group
        assert engine.weights_checksum()["model.norm.weight"] == tensor_digest(model.model.norm.weight)
        transport.timeout = 30
        with pytest.raises(EngineError) as ei:
            transport.push([("model.nope", torch.zeros(3))], "7")
        assert ei.value.status == 400 and "model.nope" in str(ei.value)
        assert engine.weight_version() == "6"
        assert transport.group is None  # a failed push drops the group...
        assert group.group_name not in engine.server_info()["weight_update_groups"]
        # ... and the next push makes a new one
        transport.push(list(model.named_parameters()), "8")
        assert engine.weight_version() == "8"
        assert transport.group.group_name in engine.server_info()["weight_update_groups"]
    finally:
        transport.close()
    assert engine.server_info()["weight_update_groups"] == []
    assert proc.poll() is None


@pytest.mark.parametrize("path,payload,field", [
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                                    "world_size": 2, "backend": "mpi"}, "backend"),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 70000, "rank_offset": 1,
                                    "world_size": 2}, "master_port"),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 0,
                                    "world_size": 2}, "rank_offset"),
    ("/init_weights_update_group", {"master_port": 1, "rank_offset": 1, "world_size": 2}, "master_address"),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                                    "world_size": 2, "backend": "nccl"}, "backend"),
    ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"], "shapes": [[2]],
                                          "group_name": "nope"}, "group_name"),
    ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["complex32"], "shapes": [[2]]}, "dtypes[0]"),
    ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"], "shapes": [[-1]]}, "shapes[0]"),
    ("/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": []}, "names"),
    ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"]}, "shapes"),
    ("/destroy_weights_update_group", {"group_name": "never"}, "group_name"),
])
def test_bad_distributed_requests_are_400(server, path, payload, field):
    url, proc = server
    with pytest.raises(EngineError) as ei:
        EngineControl(url, timeout=30).request("POST", path, json=payload)
    assert ei.value.status == 400 and field in str(ei.value), str(ei.value)
    assert proc.poll() is None


class _Done:
    def is_completed(self):
        return True

    def wait(self):
        pass


class _FakeGroup:
    def __init__(self, sent):
        self.sent = sent

    def broadcast(self, t, root):
        self.sent.append(t.numel())
        return _Done()


def _fake_engines(monkeypatch, posted):
    """Every EngineControl call answers success; weight announcements are recorded."""
    def fake_request(self, method, path, *, json=None, data=None, params=None):
        if path == Route.UPDATE_WEIGHTS_FROM_DISTRIBUTED.path:
            posted.append((path, json["names"], json["flush_cache"]))
        elif path == Route.UPDATE_WEIGHTS_FROM_TENSOR.path:
            posted.append((path, params["flush_cache"]))
        return {"success": True}

    monkeypatch.setattr(EngineControl, "request", fake_request)


def test_broadcast_marks_only_the_last_bucket_flush_cache(monkeypatch):
    """flush_cache is false on every bucket but the last (vLLM's adapter loads the buckets
    received so far when it sees it); each bucket's names are announced before its broadcast."""
    from slime.training.weight_sync import BroadcastGroup, DistributedTransport

    posted, sent = [], []
    _fake_engines(monkeypatch, posted)
    transport = DistributedTransport(2048, rank=0, num_engines=1)
    transport.connect(["http://e"])
    transport.group = BroadcastGroup(_FakeGroup(sent), ["http://e"], "g", "gloo", torch.device("cpu"))
    weights = [(f"w{i}", torch.zeros(256)) for i in range(5)]  # 1 KiB each
    stats = transport.push(weights, 3)
    assert stats["buckets"] == 3 and sent == [256] * 5
    assert posted == [("/update_weights_from_distributed", ["w0", "w1"], False),
                      ("/update_weights_from_distributed", ["w2", "w3"], False),
                      ("/update_weights_from_distributed", ["w4"], True)]
    posted.clear()
    transport.push(weights[:1], 4)
    assert posted == [("/update_weights_from_distributed", ["w0"], True)]
    transport.group = None  # the fake group has nothing to tear down


def test_push_to_a_subset_of_the_engines_goes_by_tensor_and_says_so(monkeypatch, caplog):
    """A push to fewer engines than the run has (one restarted under --use-fault-tolerance) cannot use
    the broadcast group, which spans them all: it goes by the `tensor` transport, with a warning
    naming the engines; the stale group is dropped and the next full push builds a new one."""
    from slime.training.weight_sync import BroadcastGroup, DistributedTransport

    posted, sent = [], []
    _fake_engines(monkeypatch, posted)
    closed = []
    monkeypatch.setattr(BroadcastGroup, "close", lambda self: closed.append(self.group_name))
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]  # fake engines: EngineControl.request is patched
    transport = DistributedTransport(2048, rank=0, num_engines=2)
    transport.connect(urls)
    transport.group = BroadcastGroup(_FakeGroup(sent), urls, "g", "gloo", torch.device("cpu"))
    weights = [(f"w{i}", torch.zeros(256)) for i in range(3)]
    with caplog.at_level(logging.WARNING, logger="slime.training.weight_sync.distributed"):
        transport.connect(["http://127.0.0.1:2"])
        stats = transport.push(weights, 5)
    assert "pushing weights to ['http://127.0.0.1:2'] by tensor instead of the broadcast group" in caplog.text
    assert "a subset of the 2 engines" in caplog.text
    assert posted == [("/update_weights_from_tensor", False), ("/update_weights_from_tensor", True)]
    assert sent == [] and stats["num_engines"] == 1 and "payload_bytes" in stats
    assert closed == ["g"] and transport.group is None
    # a full push again: by broadcast, over a new group
    made = []

    def fake_init(urls, **kw):
        made.append((list(urls), kw["tp_size"]))
        return BroadcastGroup(_FakeGroup(sent), urls, kw["group_name"], "gloo", torch.device("cpu"))

    monkeypatch.setattr("slime.training.weight_sync.distributed.init_broadcast_group", fake_init)
    caplog.clear()
    posted.clear()
    transport.connect(urls)
    transport.push(weights, 6)
    assert made == [(urls, 1)] and "by tensor" not in caplog.text
    assert [p[0] for p in posted] == ["/update_weights_from_distributed"] * 4 and sent == [256] * 3
