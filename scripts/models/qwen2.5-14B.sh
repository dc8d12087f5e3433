# Qwen/Qwen2.5-14B: Megatron-LM architecture flags from its config.json (Qwen2ForCausalLM, model_type qwen2).
# The base config.json says rms_norm_eps 1e-05. The -Instruct repo is believed to say 1e-06 (not verified
# here); the architecture check compares against the checkpoint's own config.json, and for a config with
# 1e-06 append --norm-epsilon 1e-6 after ${MODEL_ARGS[@]} (the last value wins).
# Usage: source scripts/models/qwen2.5-14B.sh; python train.py "${MODEL_ARGS[@]}" ...
MODEL_ARGS=(
   --num-layers 48                           # num_hidden_layers
   --hidden-size 5120                        # hidden_size
   --ffn-hidden-size 13824                   # intermediate_size
   --num-attention-heads 40                  # num_attention_heads (head_dim 128 = hidden_size / heads)
   --group-query-attention
   --num-query-groups 8                      # num_key_value_heads
   --swiglu                                  # hidden_act silu, gated MLP
   --disable-bias-linear
   --add-qkv-bias                            # Qwen2 q/k/v projections have a bias
   --normalization RMSNorm
   --norm-epsilon 1e-5                       # rms_norm_eps
   --use-rotary-position-embeddings
   --rotary-base 1000000                     # rope_theta
   --vocab-size 152064                       # vocab_size
   --untie-embeddings-and-output-weights     # tie_word_embeddings false
)
