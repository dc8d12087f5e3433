# Qwen/Qwen3-235B-A22B: Megatron-LM architecture flags from its config.json
# (Qwen3MoeForCausalLM, model_type qwen3_moe).
# Every layer is MoE (decoder_sparse_step 1, mlp_only_layers []), no shared expert; norm_topk_prob true is
# softmax over all experts, top-k, then renormalised: Megatron's softmax router without --moe-router-pre-softmax.
# intermediate_size (12288) sizes no layer here (no dense layer); it is kept as --ffn-hidden-size like the config.
# Usage: source scripts/models/qwen3-235B-A22B.sh; python train.py "${MODEL_ARGS[@]}" ...
MODEL_ARGS=(
   --num-layers 94                           # num_hidden_layers
   --hidden-size 4096                        # hidden_size
   --ffn-hidden-size 12288                   # intermediate_size
   --num-attention-heads 64                  # num_attention_heads
   --group-query-attention
   --num-query-groups 4                      # num_key_value_heads
   --kv-channels 128                         # head_dim
   --qk-layernorm                            # q_norm / k_norm
   --swiglu                                  # hidden_act silu, gated experts
   --disable-bias-linear                     # attention_bias false
   --normalization RMSNorm
   --norm-epsilon 1e-6                       # rms_norm_eps
   --use-rotary-position-embeddings
   --rotary-base 1000000                     # rope_theta
   --vocab-size 151936                       # vocab_size
   --untie-embeddings-and-output-weights     # tie_word_embeddings false
   --num-experts 128                         # num_experts
   --moe-ffn-hidden-size 1536                # moe_intermediate_size
   --moe-router-topk 8                       # num_experts_per_tok
   --moe-router-score-function softmax       # norm_topk_prob true: top-k of the softmax, renormalised
   --moe-layer-freq 1                        # decoder_sparse_step 1, mlp_only_layers []
)
