"""Text tokenizers (megatron-core's ``megatron.core.tokenizers.text`` path)."""
