# Qwen/Qwen2.5-7B: Megatron-LM architecture flags from its config.json (Qwen2ForCausalLM, model_type qwen2).
# Qwen/Qwen2.5-7B-Instruct has the same architecture fields.
# Usage: source scripts/models/qwen2.5-7B.sh; python train.py "${MODEL_ARGS[@]}" ...
MODEL_ARGS=(
   --num-layers 28                           # num_hidden_layers
   --hidden-size 3584                        # hidden_size
   --ffn-hidden-size 18944                   # intermediate_size
   --num-attention-heads 28                  # num_attention_heads (head_dim 128 = hidden_size / heads)
   --group-query-attention
   --num-query-groups 4                      # num_key_value_heads
   --swiglu                                  # hidden_act silu, gated MLP
   --disable-bias-linear
   --add-qkv-bias                            # Qwen2 q/k/v projections have a bias
   --normalization RMSNorm
   --norm-epsilon 1e-6                       # rms_norm_eps
   --use-rotary-position-embeddings
   --rotary-base 1000000                     # rope_theta
   --vocab-size 152064                       # vocab_size
   --untie-embeddings-and-output-weights     # tie_word_embeddings false
)
