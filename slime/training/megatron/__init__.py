"""megatron-core training backend (`--train-backend megatron`); see docs/megatron.md."""
