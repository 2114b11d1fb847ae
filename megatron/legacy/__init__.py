"""Megatron's legacy (pre-megatron-core) APIs, kept as thin layers over megatron.core."""
