# Qwen/Qwen3-8B: Megatron-LM architecture flags from its config.json (Qwen3ForCausalLM, model_type qwen3).
# head_dim is 128 in config.json whatever hidden_size / heads is, hence --kv-channels.
# Usage: source scripts/models/qwen3-8B.sh; python train.py "${MODEL_ARGS[@]}" ...
MODEL_ARGS=(
   --num-layers 36                           # num_hidden_layers
   --hidden-size 4096                        # hidden_size
   --ffn-hidden-size 12288                   # intermediate_size
   --num-attention-heads 32                  # num_attention_heads
   --group-query-attention
   --num-query-groups 8                      # num_key_value_heads
   --kv-channels 128                         # head_dim
   --qk-layernorm                            # q_norm / k_norm (RMSNorm over head_dim)
   --swiglu                                  # hidden_act silu, gated MLP
   --disable-bias-linear                     # attention_bias false
   --normalization RMSNorm
   --norm-epsilon 1e-6                       # rms_norm_eps
   --use-rotary-position-embeddings
   --rotary-base 1000000                     # rope_theta
   --vocab-size 151936                       # vocab_size
   --untie-embeddings-and-output-weights     # tie_word_embeddings false
)
