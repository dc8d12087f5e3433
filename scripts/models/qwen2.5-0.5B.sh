# Qwen/Qwen2.5-0.5B: Megatron-LM architecture flags from its config.json (Qwen2ForCausalLM, model_type qwen2).
# Qwen/Qwen2.5-0.5B-Instruct has the same architecture fields.
# tie_word_embeddings is true, so no --untie-embeddings-and-output-weights.
# Usage: source scripts/models/qwen2.5-0.5B.sh; python train.py "${MODEL_ARGS[@]}" ...
MODEL_ARGS=(
   --num-layers 24                           # num_hidden_layers
   --hidden-size 896                         # hidden_size
   --ffn-hidden-size 4864                    # intermediate_size
   --num-attention-heads 14                  # num_attention_heads (head_dim 64 = hidden_size / heads)
   --group-query-attention
   --num-query-groups 2                      # num_key_value_heads
   --swiglu                                  # hidden_act silu, gated MLP
   --disable-bias-linear
   --add-qkv-bias                            # Qwen2 q/k/v projections have a bias
   --normalization RMSNorm
   --norm-epsilon 1e-6                       # rms_norm_eps
   --use-rotary-position-embeddings
   --rotary-base 1000000                     # rope_theta
   --vocab-size 151936                       # vocab_size
)
