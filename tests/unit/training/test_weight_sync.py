"""Trainer -> engine weight sync over a process group (SGLang's /init_weights_update_group +
/update_weights_from_distributed), gloo on CPU: the engine ends up bitwise equal to the sender."""

from __future__ import annotations

import pytest
import torch

from slime.engines.client import EngineError, get_json, post_json
from slime.utils.weights import compare_digests, tensor_digest
from tests.helpers.native_server import native_server


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with native_server(tiny_model_dir, tmp_path_factory.mktemp("bcast") / "log.txt") as (url, proc):
        yield url, proc


def test_broadcast_weights_bitwise_equal(server, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from slime.training.weight_sync import broadcast_weights, init_broadcast_group

    url, proc = server
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    expected = {n: tensor_digest(p) for n, p in model.named_parameters()}
    assert compare_digests(expected, get_json(url, "/weights_checksum")["checksums"])  # differs before

    group = init_broadcast_group([url], backend="gloo", group_name="g1")
    try:
        stats = broadcast_weights(list(model.named_parameters()), [url], weight_version="5", buffer_size=1 << 16,
                                  group=group)
        assert stats["buckets"] > 1 and stats["bytes"] == sum(p.numel() * 4 for p in model.parameters())
        got = get_json(url, "/weights_checksum")
        assert got["weight_version"] == "5"
        assert compare_digests(expected, got["checksums"]) == []
        assert "g1" in get_json(url, "/get_server_info")["weight_update_groups"]

        # a second update over the same group; a refused bucket fails fast instead of hanging
        with torch.no_grad():
            model.model.norm.weight.mul_(2.0)
        broadcast_weights([("model.norm.weight", model.model.norm.weight)], [url], weight_version="6", group=group)
        assert get_json(url, "/weights_checksum")["checksums"]["model.norm.weight"] == tensor_digest(
            model.model.norm.weight)
        with pytest.raises(EngineError) as ei:
            broadcast_weights([("model.nope", torch.zeros(3))], [url], weight_version="7", group=group, timeout=30)
        assert ei.value.status == 400 and "model.nope" in str(ei.value)
        assert get_json(url, "/get_weight_version")["weight_version"] == "6"
    finally:
        group.close()
    assert "g1" not in get_json(url, "/get_server_info")["weight_update_groups"]
    # one-shot form: makes and closes its own group
    broadcast_weights(list(model.named_parameters()), [url], weight_version="8", backend="gloo")
    assert get_json(url, "/get_weight_version")["weight_version"] == "8"
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
        post_json(url, path, payload, timeout=30)
    assert ei.value.status == 400 and field in str(ei.value), str(ei.value)
    assert proc.poll() is None


def test_broadcast_marks_only_the_last_bucket_flush_cache(monkeypatch):
    """flush_cache is false on every bucket but the last (vLLM's adapter loads the buckets
    received so far when it sees it); each bucket's names are announced before its broadcast."""
    import slime.engines.client as client
    from slime.training.weight_sync import BroadcastGroup, broadcast_weights

    posted, sent = [], []

    class Done:
        def is_completed(self):
            return True

        def wait(self):
            pass

    class FakeGroup:
        def broadcast(self, t, root):
            sent.append(t.numel())
            return Done()

    def fake_post(url, path, payload, timeout):
        posted.append((path, payload["names"], payload["flush_cache"]))
        return {"success": True}

    monkeypatch.setattr(client, "post_json", fake_post)
    group = BroadcastGroup(FakeGroup(), ["http://e"], "g", "gloo", torch.device("cpu"))
    weights = [(f"w{i}", torch.zeros(256)) for i in range(5)]  # 1 KiB each
    stats = broadcast_weights(weights, ["http://e"], weight_version=3, buffer_size=2048, group=group)
    assert stats["buckets"] == 3 and sent == [256] * 5
    assert posted == [("/update_weights_from_distributed", ["w0", "w1"], False),
                      ("/update_weights_from_distributed", ["w2", "w3"], False),
                      ("/update_weights_from_distributed", ["w4"], True)]
    posted.clear()
    broadcast_weights(weights[:1], ["http://e"], weight_version=4, buffer_size=2048, group=group)
    assert posted == [("/update_weights_from_distributed", ["w0"], True)]
