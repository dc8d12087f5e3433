"""slime-style model presets (`scripts/models/*.sh`): each preset's `MODEL_ARGS` agrees with the
Hugging Face config.json it names, as judged by `slime.model_flags.architecture_mismatches`.

The config fields below are copied from each repository's config.json (only the fields that bear
on the architecture flags). Every preset file must have an entry here, so a new preset cannot land
without its config.
"""

from __future__ import annotations

import copy
import pathlib
import subprocess

import pytest

transformers = pytest.importorskip("transformers")

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
PRESET_DIR = REPO_ROOT / "scripts" / "models"


def _qwen25(layers, hidden, ffn, heads, kv, eps, vocab, tied):
    return {"model_type": "qwen2", "hidden_act": "silu", "num_hidden_layers": layers, "hidden_size": hidden,
            "intermediate_size": ffn, "num_attention_heads": heads, "num_key_value_heads": kv,
            "rms_norm_eps": eps, "rope_theta": 1000000.0, "vocab_size": vocab, "tie_word_embeddings": tied}


def _qwen3(layers, hidden, ffn, heads, kv, tied):
    return {"model_type": "qwen3", "hidden_act": "silu", "num_hidden_layers": layers, "hidden_size": hidden,
            "intermediate_size": ffn, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": 128,
            "attention_bias": False, "rms_norm_eps": 1e-06, "rope_theta": 1000000, "max_position_embeddings": 40960,
            "vocab_size": 151936, "tie_word_embeddings": tied}


def _qwen3_moe(layers, hidden, ffn, moe_ffn, heads, kv, experts, topk):
    return {"model_type": "qwen3_moe", "hidden_act": "silu", "num_hidden_layers": layers, "hidden_size": hidden,
            "intermediate_size": ffn, "moe_intermediate_size": moe_ffn, "num_attention_heads": heads,
            "num_key_value_heads": kv, "head_dim": 128, "attention_bias": False, "num_experts": experts,
            "num_experts_per_tok": topk, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
            "vocab_size": 151936, "tie_word_embeddings": False}


def _llama3(layers, hidden, ffn, heads, kv, factor, tied, head_dim=None):
    cfg = {"model_type": "llama", "hidden_act": "silu", "num_hidden_layers": layers, "hidden_size": hidden,
           "intermediate_size": ffn, "num_attention_heads": heads, "num_key_value_heads": kv,
           "attention_bias": False, "mlp_bias": False, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
           "rope_scaling": {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
           "max_position_embeddings": 131072, "vocab_size": 128256, "tie_word_embeddings": tied}
    if head_dim is not None:  # the Llama 3.2 configs spell head_dim out, the 3.1 ones do not
        cfg["head_dim"] = head_dim
    return cfg


def _glm4(layers, hidden, ffn, heads, kv, bias):
    return {"model_type": "glm4", "hidden_act": "silu", "num_hidden_layers": layers, "hidden_size": hidden,
            "intermediate_size": ffn, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": 128,
            "attention_bias": bias, "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
            "max_position_embeddings": 32768, "vocab_size": 151552, "tie_word_embeddings": False}


# preset file -> (Hugging Face repo id, config.json fields)
PRESETS: dict[str, tuple[str, dict]] = {
    "qwen2.5-0.5B.sh": ("Qwen/Qwen2.5-0.5B", _qwen25(24, 896, 4864, 14, 2, 1e-06, 151936, True)),
    "qwen2.5-1.5B.sh": ("Qwen/Qwen2.5-1.5B", _qwen25(28, 1536, 8960, 12, 2, 1e-06, 151936, True)),
    "qwen2.5-3B.sh": ("Qwen/Qwen2.5-3B", _qwen25(36, 2048, 11008, 16, 2, 1e-06, 151936, True)),
    "qwen2.5-7B.sh": ("Qwen/Qwen2.5-7B", _qwen25(28, 3584, 18944, 28, 4, 1e-06, 152064, False)),
    "qwen2.5-14B.sh": ("Qwen/Qwen2.5-14B", _qwen25(48, 5120, 13824, 40, 8, 1e-05, 152064, False)),
    "qwen2.5-32B.sh": ("Qwen/Qwen2.5-32B", _qwen25(64, 5120, 27648, 40, 8, 1e-05, 152064, False)),
    "qwen3-0.6B.sh": ("Qwen/Qwen3-0.6B", _qwen3(28, 1024, 3072, 16, 8, True)),
    "qwen3-1.7B.sh": ("Qwen/Qwen3-1.7B", _qwen3(28, 2048, 6144, 16, 8, True)),
    "qwen3-4B.sh": ("Qwen/Qwen3-4B", _qwen3(36, 2560, 9728, 32, 8, True)),
    "qwen3-8B.sh": ("Qwen/Qwen3-8B", _qwen3(36, 4096, 12288, 32, 8, False)),
    "qwen3-14B.sh": ("Qwen/Qwen3-14B", _qwen3(40, 5120, 17408, 40, 8, False)),
    "qwen3-32B.sh": ("Qwen/Qwen3-32B", _qwen3(64, 5120, 25600, 64, 8, False)),
    "qwen3-30B-A3B.sh": ("Qwen/Qwen3-30B-A3B", _qwen3_moe(48, 2048, 6144, 768, 32, 4, 128, 8)),
    "qwen3-235B-A22B.sh": ("Qwen/Qwen3-235B-A22B", _qwen3_moe(94, 4096, 12288, 1536, 64, 4, 128, 8)),
    "llama3.1-8B-Instruct.sh": ("meta-llama/Llama-3.1-8B-Instruct", _llama3(32, 4096, 14336, 32, 8, 8.0, False)),
    "llama3.1-70B-Instruct.sh": ("meta-llama/Llama-3.1-70B-Instruct", _llama3(80, 8192, 28672, 64, 8, 8.0, False)),
    "llama3.2-1B-Instruct.sh": ("meta-llama/Llama-3.2-1B-Instruct",
                                _llama3(16, 2048, 8192, 32, 8, 32.0, True, head_dim=64)),
    "llama3.2-3B-Instruct.sh": ("meta-llama/Llama-3.2-3B-Instruct",
                                _llama3(28, 3072, 8192, 24, 8, 32.0, True, head_dim=128)),
    "glm4-9B.sh": ("THUDM/GLM-4-9B-0414", _glm4(40, 4096, 13696, 32, 2, True)),
    "glm4-32B.sh": ("THUDM/GLM-4-32B-0414", _glm4(61, 6144, 23040, 48, 2, False)),
}

# one preset per family: (preset, config field, new value, the flag the single mismatch must name)
MUTATIONS = [
    ("qwen2.5-7B.sh", "num_hidden_layers", 29, "--num-layers"),
    ("qwen2.5-32B.sh", "tie_word_embeddings", True, "--untie-embeddings-and-output-weights"),
    ("qwen3-4B.sh", "head_dim", 80, "--kv-channels"),
    ("qwen3-30B-A3B.sh", "moe_intermediate_size", 1536, "--moe-ffn-hidden-size"),
    ("llama3.1-8B-Instruct.sh", "num_key_value_heads", 4, "--num-query-groups"),
    ("llama3.2-3B-Instruct.sh", "rope_scaling", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
     "--rotary-scaling-factor"),
    ("glm4-9B.sh", "partial_rotary_factor", 1.0, "--rotary-percent"),
]


def preset_argv(name: str) -> list[str]:
    script = f'set -e; source "scripts/models/{name}"; printf "%s\\n" "${{MODEL_ARGS[@]}}"'
    out = subprocess.run(["bash", "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert out.stderr == "", out.stderr
    return out.stdout.splitlines()


def parsed(name: str):
    from slime.arguments import parse_flags

    return parse_flags([*preset_argv(name), "--hf-checkpoint", "unused", "--rollout-batch-size", "1"])


def hf_config(fields: dict):
    return transformers.AutoConfig.for_model(**copy.deepcopy(fields))


def test_every_preset_has_config_data():
    on_disk = {p.name for p in PRESET_DIR.glob("*.sh")}
    assert on_disk, f"no presets under {PRESET_DIR}"
    assert on_disk - PRESETS.keys() == set(), "presets without config.json data in this test"
    assert PRESETS.keys() - on_disk == set(), "config data for presets that do not exist"


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_cites_its_repo(name):
    repo, _ = PRESETS[name]
    first = (PRESET_DIR / name).read_text().splitlines()[0]
    assert first.startswith("#") and repo in first, f"{name} must cite {repo} in its first line"


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_matches_its_config(name):
    from slime.model_flags import architecture_mismatches

    argv = preset_argv(name)
    assert argv and all(a.strip() == a and a for a in argv), argv
    _, fields = PRESETS[name]
    assert architecture_mismatches(parsed(name), hf_config(fields)) == []


@pytest.mark.parametrize("name,field,value,flag", MUTATIONS, ids=[f"{m[0]}:{m[1]}" for m in MUTATIONS])
def test_one_changed_config_value_is_one_mismatch(name, field, value, flag):
    from slime.model_flags import architecture_mismatches

    _, fields = PRESETS[name]
    assert fields[field] != value
    changed = {**copy.deepcopy(fields), field: value}
    mismatches = architecture_mismatches(parsed(name), hf_config(changed))
    assert len(mismatches) == 1, mismatches
    assert flag in mismatches[0], mismatches
