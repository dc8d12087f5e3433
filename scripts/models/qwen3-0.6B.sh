# Qwen/Qwen3-0.6B: Megatron-LM architecture flags from its config.json (Qwen3ForCausalLM, model_type qwen3).
# head_dim is 128 in config.json whatever hidden_size / heads is, hence --kv-channels.
# tie_word_embeddings is true, so no --untie-embeddings-and-output-weights.
# Usage: source scripts/models/qwen3-0.6B.sh; python train.py "${MODEL_ARGS[@]}" ...
MODEL_ARGS=(
   --num-layers 28                           # num_hidden_layers
   --hidden-size 1024                        # hidden_size
   --ffn-hidden-size 3072                    # intermediate_size
   --num-attention-heads 16                  # num_attention_heads
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
)
