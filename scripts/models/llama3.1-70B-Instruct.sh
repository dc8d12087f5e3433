# meta-llama/Llama-3.1-70B-Instruct: Megatron-LM architecture flags from its config.json
# (LlamaForCausalLM, model_type llama).
# rope_scaling: rope_type llama3, factor 8.0, low_freq_factor 1.0, high_freq_factor 4.0,
# original_max_position_embeddings 8192.
# Usage: source scripts/models/llama3.1-70B-Instruct.sh; python train.py "${MODEL_ARGS[@]}" ...
MODEL_ARGS=(
   --num-layers 80                           # num_hidden_layers
   --hidden-size 8192                        # hidden_size
   --ffn-hidden-size 28672                   # intermediate_size
   --num-attention-heads 64                  # num_attention_heads
   --group-query-attention
   --num-query-groups 8                      # num_key_value_heads
   --swiglu                                  # hidden_act silu, gated MLP
   --disable-bias-linear                     # attention_bias false, mlp_bias false
   --normalization RMSNorm
   --norm-epsilon 1e-5                       # rms_norm_eps
   --use-rotary-position-embeddings
   --rotary-base 500000                      # rope_theta
   --use-rope-scaling                        # rope_scaling.rope_type llama3
   --rotary-scaling-factor 8.0               # rope_scaling.factor
   --vocab-size 128256                       # vocab_size
   --untie-embeddings-and-output-weights     # tie_word_embeddings false
)
