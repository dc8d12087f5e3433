# meta-llama/Llama-3.2-1B-Instruct: Megatron-LM architecture flags from its config.json
# (LlamaForCausalLM, model_type llama).
# rope_scaling: rope_type llama3, factor 32.0, low_freq_factor 1.0, high_freq_factor 4.0,
# original_max_position_embeddings 8192.
# tie_word_embeddings is true, so no --untie-embeddings-and-output-weights.
# Usage: source scripts/models/llama3.2-1B-Instruct.sh; python train.py "${MODEL_ARGS[@]}" ...
MODEL_ARGS=(
   --num-layers 16                           # num_hidden_layers
   --hidden-size 2048                        # hidden_size
   --ffn-hidden-size 8192                    # intermediate_size
   --num-attention-heads 32                  # num_attention_heads
   --group-query-attention
   --num-query-groups 8                      # num_key_value_heads
   --kv-channels 64                          # head_dim
   --swiglu                                  # hidden_act silu, gated MLP
   --disable-bias-linear                     # attention_bias false, mlp_bias false
   --normalization RMSNorm
   --norm-epsilon 1e-5                       # rms_norm_eps
   --use-rotary-position-embeddings
   --rotary-base 500000                      # rope_theta
   --use-rope-scaling                        # rope_scaling.rope_type llama3
   --rotary-scaling-factor 32.0              # rope_scaling.factor
   --vocab-size 128256                       # vocab_size
)
