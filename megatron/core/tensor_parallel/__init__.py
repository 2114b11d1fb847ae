"""megatron.core.tensor_parallel (being written)."""
