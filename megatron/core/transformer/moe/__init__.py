"""Mixture of experts (megatron.core.transformer.moe): router, token dispatchers, experts, MoE layer."""
