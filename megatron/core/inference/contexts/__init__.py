"""Inference contexts (megatron-core\x27s path)."""
