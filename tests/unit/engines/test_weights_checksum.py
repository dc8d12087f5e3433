import torch
from transformers import AutoModelForCausalLM

from slime.engines.native.engine import NativeEngine
from slime.utils.weights import compare_digests, tensor_digest


def test_engine_checksums_track_weight_updates(tiny_model_dir):
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    expected = {n: tensor_digest(p) for n, p in reference.named_parameters()}
    engine = NativeEngine(tiny_model_dir).start()
    try:
        assert compare_digests(expected, engine.weights_checksum()) == []
        name = "model.norm.weight"
        engine.update_weights({name: reference.get_parameter(name).detach() + 1e-3}, weight_version="1")
        assert compare_digests(expected, engine.weights_checksum()) == [name]
    finally:
        engine.shutdown()


def test_digest_sees_dtype_shape_and_one_bit():
    t = torch.arange(6, dtype=torch.float32)
    assert tensor_digest(t) == tensor_digest(t.clone())
    assert tensor_digest(t) != tensor_digest(t.reshape(2, 3))
    assert tensor_digest(t) != tensor_digest(t.double())
    u = t.clone()
    u.view(torch.int32)[3] ^= 1  # flip the lowest mantissa bit
    assert tensor_digest(t) != tensor_digest(u)


def test_check_engine_weights_over_http(tiny_model_dir, tmp_path):
    import pytest
    from safetensors.torch import save

    from slime.engines.control import EngineControl
    from slime.training.weight_sync import check_engine_weights
    from tests.helpers.native_server import native_server

    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    named = list(reference.named_parameters())
    with native_server(tiny_model_dir, tmp_path / "engine.log") as (url, _):
        assert check_engine_weights(named, [url]) == len(named)
        EngineControl(url).update_weights_from_tensor(save({"model.norm.weight": torch.zeros(128)}), "1")
        with pytest.raises(RuntimeError, match=r"serves weights that differ from the trainer's: \['model.norm.weight'\] \(1 of"):
            check_engine_weights(named, [url])
        assert check_engine_weights(named, [url], check=False) == len(named)  # non-checking ranks only hash
