"""Build a tiny random Llama-style model (or a tiny mixture-of-experts one) and a small word-level
tokenizer.

No model hub is needed: the tokenizer is built with `tokenizers` from a fixed
vocabulary and the model from a config. Used by `examples/quickstart.py --tiny`
and by the tests. head_dim is 64 so that engines with a minimum head size
(vLLM) can serve it too. `build_tiny_moe_model` writes a Qwen3-MoE, Qwen2-MoE or
Mixtral of the same size (2 MoE layers of 4 experts, top-2) with the same tokenizer.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]

# ChatML, the format SmolLM2 and Qwen use.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# A small word-level vocabulary: a random model over it emits digits often enough
# that toy tasks give GRPO signal from the first rollout.
WORDS = (
    "user assistant system the answer is what of plus minus times and a to in repeat digit number "
    "question solve compute sum copy say output reply with only final result equals parity odd even "
    "yes no hello world test"
).split()
SYMBOLS = list("0123456789+-*/=?:.,()!")


def build_tokenizer():
    vocab = {t: i for i, t in enumerate(["<unk>"] + SPECIAL_TOKENS + WORDS + SYMBOLS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # split on whitespace and around punctuation, so "7?" is two tokens; decode joins with spaces
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        bos_token="<|endoftext|>",
        pad_token="<|pad|>",
        unk_token="<unk>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(
    output_dir: str | Path,
    seed: int = 0,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    intermediate_size: int = 256,
) -> Path:
    """Write a tiny random LlamaForCausalLM plus tokenizer to `output_dir` and return it."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(output_dir, safe_serialization=True)
    tokenizer.save_pretrained(output_dir)
    return output_dir


MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")


def build_tiny_moe_model(output_dir: str | Path, seed: int = 0, family: str = "qwen3_moe",
                         num_key_value_heads: int = 1, num_hidden_layers: int = 2) -> Path:
    """Write a tiny random mixture-of-experts model (`family`: one of `MOE_FAMILIES`) plus the tiny
    tokenizer to `output_dir` and return it: `num_hidden_layers` layers, each an MoE layer of 4 experts
    routing every token to 2 of them; 2 attention heads sharing `num_key_value_heads` key/value heads
    (2: splits over 2 tensor-parallel ranks)."""
    if family not in MOE_FAMILIES:
        raise ValueError(f"family must be one of {MOE_FAMILIES}, got {family!r}")
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    common = dict(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=num_hidden_layers,
        num_attention_heads=2, num_key_value_heads=num_key_value_heads, num_experts_per_tok=2,
        max_position_embeddings=512,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if family == "qwen3_moe":
        config = Qwen3MoeConfig(**common, head_dim=64, moe_intermediate_size=64, num_experts=4,
                                decoder_sparse_step=1, norm_topk_prob=True)
        cls = Qwen3MoeForCausalLM
    elif family == "qwen2_moe":
        config = Qwen2MoeConfig(**common, moe_intermediate_size=64, shared_expert_intermediate_size=128,
                                num_experts=4, decoder_sparse_step=1, norm_topk_prob=False)  # Qwen1.5-MoE's
        cls = Qwen2MoeForCausalLM
    else:
        config = MixtralConfig(**{**common, "intermediate_size": 64}, head_dim=64, num_local_experts=4)  # per expert
        cls = MixtralForCausalLM
    config.dtype = "float32"
    torch.manual_seed(seed)
    model = cls(config)
    model.save_pretrained(output_dir, safe_serialization=True)
    tokenizer.save_pretrained(output_dir)
    return output_dir


VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]

# ChatML whose message content may be a list of parts: {"type": "image"} becomes Qwen-VL's image slot
VL_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tiny_vl_model(output_dir: str | Path, seed: int = 0) -> Path:
    """Write a tiny random Qwen2_5_VLForConditionalGeneration, the tiny tokenizer plus Qwen-VL's vision
    tokens, and a Qwen2.5-VL processor (14-pixel patches merged 2x2; images resized to at most
    112x112 pixels, i.e. at most 16 image tokens) to `output_dir` and return it."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [16, 8, 8]},
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True,
        ),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=128,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                           fullatt_block_indexes=[1]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    config.dtype = "float32"
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config)
    model.save_pretrained(output_dir, safe_serialization=True)
    image_processor = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=112 * 112, patch_size=14,
                                               merge_size=2, temporal_patch_size=2)
    image_processor.save_pretrained(output_dir)  # with the tokenizer: what slime.utils.vision loads
    tokenizer.save_pretrained(output_dir)
    return output_dir


def main() -> None:
    parser = argparse.ArgumentParser(description="Write a tiny random model + tokenizer for tests and --tiny runs.")
    parser.add_argument("output_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--moe", choices=MOE_FAMILIES, default=None, help="a mixture-of-experts model of this family")
    parser.add_argument("--vl", action="store_true", help="a tiny Qwen2.5-VL (vision-language) model")
    args = parser.parse_args()
    if args.vl:
        print(build_tiny_vl_model(args.output_dir, seed=args.seed))
    elif args.moe:
        print(build_tiny_moe_model(args.output_dir, seed=args.seed, family=args.moe))
    else:
        print(build_tiny_model(args.output_dir, seed=args.seed))


if __name__ == "__main__":
    main()
