"""Attention-context metadata (megatron-core\x27s path)."""
