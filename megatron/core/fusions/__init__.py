"""megatron-core's import paths for the fused element-wise ops (implemented in megatron.core.transformer)."""
