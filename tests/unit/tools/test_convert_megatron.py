"""HF <-> megatron-core torch_dist through tools/convert_hf_to_torch_dist.py and
tools/convert_torch_dist_to_hf.py. Skipped without megatron-core (`pip install megatron-core`).

Besides the tensor round trip, a megatron-core GPTModel loaded from the torch_dist checkpoint
(megatron's own sharded loading) must give the HF model's logits: that checks the per-query-group
QKV fusion, the gate/up fusion, RoPE and the norms, which a round trip alone cannot (a wrong
fusion that is undone the same way still round-trips).
"""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]


def run_tool(name, *argv):
    return subprocess.run([sys.executable, f"tools/{name}", *map(str, argv)], cwd=ROOT, capture_output=True, text=True)


@pytest.fixture(scope="module")
def torch_dist(tiny_model_dir, tmp_path_factory):
    save = tmp_path_factory.mktemp("megatron") / "ckpt"
    proc = run_tool("convert_hf_to_torch_dist.py", "--hf-checkpoint", tiny_model_dir, "--save", save)
    assert proc.returncode == 0, proc.stderr
    return save


def test_megatron_layout(torch_dist):
    assert (torch_dist / "latest_checkpointed_iteration.txt").read_text().strip() == "0"
    ckpt = torch_dist / "iter_0000000"
    meta = json.loads((ckpt / "metadata.json").read_text())
    assert meta["sharded_backend"] == "torch_dist"
    from megatron.core import dist_checkpointing

    shapes = {k: tuple(v.global_shape) for k, v in dist_checkpointing.load_tensors_metadata(str(ckpt)).items()}
    # megatron's names, layers stacked on a leading axis; vocab padded to a multiple of 128
    assert shapes["embedding.word_embeddings.weight"] == (128, 128)
    assert shapes["decoder.layers.self_attention.linear_qkv.weight"] == (2, (2 + 2 * 1) * 64, 128)
    assert shapes["decoder.layers.self_attention.linear_qkv.layer_norm_weight"] == (2, 128)
    assert shapes["decoder.layers.mlp.linear_fc1.layer_norm_weight"] == (2, 128)
    assert shapes["decoder.layers.mlp.linear_fc2.weight"] == (2, 128, 256)
    assert shapes["decoder.final_layernorm.weight"] == (128,)
    assert "output_layer.weight" not in shapes  # tied embeddings
    common = dist_checkpointing.load_common_state_dict(str(ckpt))
    assert common["iteration"] == 0 and common["checkpoint_version"] == 3.0


def test_round_trip_gives_identical_tensors(tiny_model_dir, torch_dist, tmp_path):
    out = tmp_path / "hf"
    proc = run_tool("convert_torch_dist_to_hf.py", "--input-dir", torch_dist, "--output-dir", out,
                    "--origin-hf-dir", tiny_model_dir)
    assert proc.returncode == 0, proc.stderr
    original = load_file(Path(tiny_model_dir) / "model.safetensors")
    converted = load_file(out / "model.safetensors")
    assert sorted(original) == sorted(converted)
    for name, tensor in original.items():
        assert torch.equal(tensor, converted[name]), name
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert AutoModelForCausalLM.from_pretrained(out).config.vocab_size == len(AutoTokenizer.from_pretrained(out))


def test_iteration_dir_and_vocab_size(torch_dist, tiny_model_dir, tmp_path):
    out = tmp_path / "hf"
    proc = run_tool("convert_torch_dist_to_hf.py", "--input-dir", torch_dist / "iter_0000000", "--output-dir", out,
                    "--origin-hf-dir", tiny_model_dir, "--vocab-size", "60")
    assert proc.returncode == 0, proc.stderr
    assert load_file(out / "model.safetensors")["model.embed_tokens.weight"].shape[0] == 60
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 60


def test_not_a_checkpoint_is_one_clear_line(tiny_model_dir, tmp_path):
    proc = run_tool("convert_torch_dist_to_hf.py", "--input-dir", tmp_path, "--output-dir", tmp_path / "o",
                    "--origin-hf-dir", tiny_model_dir)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"slime: error: --input-dir {tmp_path}: not a torch_dist checkpoint (no metadata.json) "
        "and no latest_checkpointed_iteration.txt in it")


# The forward check runs in its own process: it sets up a process group and, because megatron-core's
# forward assumes CUDA in device/RNG bookkeeping (RotaryEmbedding.get_emb moves inv_freq to
# torch.cuda.current_device(); attention dropout forks the CUDA RNG tracker even at p=0), it uses the
# shims in slime/training/megatron/shims.py. None of that touches the arithmetic. One process checks
# every model kind in turn (each in its own one-process group): a process that imports megatron-core
# and transformers costs about 15 CPU-seconds before it does anything.
FORWARD = textwrap.dedent("""
    import contextlib, importlib.util, json, sys
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from slime.training.megatron import convert as mc, moe
    from slime.training.megatron.shims import use_cpu_rng_tracker

    spec = importlib.util.spec_from_file_location("to_td", "tools/convert_hf_to_torch_dist.py")
    to_td = importlib.util.module_from_spec(spec); spec.loader.exec_module(to_td)
    spec = importlib.util.spec_from_file_location("to_hf", "tools/convert_torch_dist_to_hf.py")
    to_hf = importlib.util.module_from_spec(spec); spec.loader.exec_module(to_hf)
    use_cpu_rng_tracker()
    for hf_dir, save, back in json.loads(sys.argv[1]):
        ckpt = to_td.convert(hf_dir, save)
        config = AutoConfig.from_pretrained(hf_dir)
        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        ids = torch.tensor([[1, 5, 9, 2, 7, 3, 11, 4]])
        with torch.no_grad():
            expected = hf(ids).logits
        rows = mc.checkpoint_tensor_shapes(ckpt)["embedding.word_embeddings.weight"][0][0]
        with mc.single_process_parallel_state(), mc.cpu_only_cuda_shims():
            model = (moe if moe.is_moe(config) else mc).build_gpt_model(config, rows, torch.float32).eval()
            mc.load_torch_dist(model, ckpt)
            s = ids.shape[1]
            mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]  # True = masked
            with torch.no_grad():
                got = model(ids, torch.arange(s)[None], attention_mask=mask)
        got = got[..., : config.vocab_size]
        # and back to HF with tools/convert_torch_dist_to_hf.py's convert (its command line: the tests above)
        to_hf.convert(save, back, hf_dir)
        print(json.dumps({"hf_dir": hf_dir, "shape": list(got.shape),
                          "max_abs_diff": (got - expected).abs().max().item(),
                          "close": torch.allclose(got, expected, atol=1e-4, rtol=0)}), flush=True)
""")


def _tiny_hf(kind, path):
    """Tiny random HF models with 4 query heads over 2 KV groups, so the per-group QKV order matters."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    cls, cfg = {
        "llama_untied": (LlamaForCausalLM, LlamaConfig(tie_word_embeddings=False, rms_norm_eps=1e-5, **common)),
        "qwen2": (Qwen2ForCausalLM, Qwen2Config(tie_word_embeddings=True, rms_norm_eps=1e-6, **common)),
        "qwen3": (Qwen3ForCausalLM, Qwen3Config(tie_word_embeddings=False, rms_norm_eps=1e-6, **common)),
    }[kind]
    torch.manual_seed(1)
    model = cls(cfg).to(torch.float32)
    with torch.no_grad():  # make norms and biases non-trivial so a misplaced one shows up
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return path


def _tiny_moe_hf(family, path):
    """A tiny random MoE (4 experts, top-2; qwen2_moe with a gated shared expert): each expert random
    on its own, so a misplaced expert or a wrong gate/up split shows up in the logits."""
    from slime.utils.tiny_model import build_tiny_moe_model

    return build_tiny_moe_model(path, seed=0, family=family)


KINDS = ["tiny_llama", "llama_untied", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe"]


def test_megatron_forward_matches_hf(tiny_model_dir, tmp_path):
    """For each kind of model: megatron's GPTModel loaded from the converted checkpoint gives the HF
    model's logits, and the checkpoint converts back to identical HF tensors."""
    dirs = {}
    for kind in KINDS:
        if kind.endswith("_moe"):
            dirs[kind] = str(_tiny_moe_hf(kind, tmp_path / kind / "hf"))
        else:
            dirs[kind] = tiny_model_dir if kind == "tiny_llama" else str(_tiny_hf(kind, tmp_path / kind / "hf"))
    jobs = [[dirs[k], str(tmp_path / k / "td"), str(tmp_path / k / "back")] for k in KINDS]
    proc = subprocess.run([sys.executable, "-c", FORWARD, json.dumps(jobs)], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"hf_dir"')]
    assert [r["hf_dir"] for r in results] == [dirs[k] for k in KINDS]
    for kind, result in zip(KINDS, results):
        assert result["close"], (kind, result)
        # and back to HF (through the tool's convert): identical tensors
        back = tmp_path / kind / "back"
        original, converted = load_file(Path(dirs[kind]) / "model.safetensors"), load_file(back / "model.safetensors")
        assert sorted(original) == sorted(converted), kind
        for name, tensor in original.items():
            assert torch.equal(tensor, converted[name]), (kind, name)


def test_moe_experts_are_stacked_under_megatron_names(tmp_path):
    """Every expert of a layer in one sharded tensor (global expert ids: any expert-parallel size loads
    it), the router and Qwen2-MoE's shared expert and its gate beside them."""
    hf_dir = _tiny_moe_hf("qwen2_moe", tmp_path / "hf")
    proc = run_tool("convert_hf_to_torch_dist.py", "--hf-checkpoint", hf_dir, "--save", tmp_path / "td")
    assert proc.returncode == 0, proc.stderr[-3000:]
    from megatron.core import dist_checkpointing

    meta = dist_checkpointing.load_tensors_metadata(str(tmp_path / "td" / "iter_0000000"))
    shapes = {k: tuple(v.global_shape) for k, v in meta.items() if ".mlp." in k}
    config = json.loads((Path(hf_dir) / "config.json").read_text())
    layers, experts, hidden = config["num_hidden_layers"], config["num_experts"], config["hidden_size"]
    ffn, shared = config["moe_intermediate_size"], config["shared_expert_intermediate_size"]
    assert shapes == {
        "decoder.layers.mlp.linear_fc1.layer_norm_weight": (layers, hidden),
        "decoder.layers.mlp.router.weight": (layers, experts, hidden),
        "decoder.layers.mlp.experts.experts.linear_fc1.weight": (layers, experts, 2 * ffn, hidden),
        "decoder.layers.mlp.experts.experts.linear_fc2.weight": (layers, experts, hidden, ffn),
        "decoder.layers.mlp.shared_experts.linear_fc1.weight": (layers, 2 * shared, hidden),
        "decoder.layers.mlp.shared_experts.linear_fc2.weight": (layers, hidden, shared),
        "decoder.layers.mlp.shared_experts.gate_weight": (layers, 1, hidden),
    }


def test_a_model_type_neither_dense_nor_moe_is_one_clear_line(tiny_model_dir, tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    config = json.loads((Path(tiny_model_dir) / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    proc = run_tool("convert_hf_to_torch_dist.py", "--hf-checkpoint", hf, "--save", tmp_path / "td")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "slime: error: model_type 'gpt2' is not supported (supported: llama, qwen2, qwen3, qwen3_moe, qwen2_moe, "
        "mixtral)")
