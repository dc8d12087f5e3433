# THUDM/GLM-4-9B-0414 (now zai-org/GLM-4-9B-0414): Megatron-LM architecture flags from its config.json
# (Glm4ForCausalLM, model_type glm4; not the older chatglm). Each block norms the attention and MLP outputs
# again (post_self_attn_layernorm, post_mlp_layernorm); partial_rotary_factor 0.5: rotary on 64 of head_dim 128.
# Usage: source scripts/models/glm4-9B.sh; python train.py "${MODEL_ARGS[@]}" ...
MODEL_ARGS=(
   --num-layers 40                           # num_hidden_layers
   --hidden-size 4096                        # hidden_size
   --ffn-hidden-size 13696                   # intermediate_size
   --num-attention-heads 32                  # num_attention_heads
   --group-query-attention
   --num-query-groups 2                      # num_key_value_heads
   --kv-channels 128                         # head_dim
   --swiglu                                  # hidden_act silu, gated MLP (fused gate_up_proj)
   --disable-bias-linear
   --add-qkv-bias                            # attention_bias true
   --normalization RMSNorm
   --norm-epsilon 1e-5                       # rms_norm_eps
   --post-self-attn-layernorm                # post_self_attn_layernorm
   --post-mlp-layernorm                      # post_mlp_layernorm
   --use-rotary-position-embeddings
   --rotary-base 10000                       # rope_theta
   --rotary-percent 0.5                      # partial_rotary_factor
   --rotary-interleaved                      # glm4 rotary turns adjacent pairs (2i, 2i+1)
   --vocab-size 151552                       # vocab_size
   --untie-embeddings-and-output-weights     # tie_word_embeddings false
)
