"""megatron.core.transformer: the transformer configuration and building blocks."""
from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = ["TransformerConfig"]
