"""Building blocks shared by megatron.core's models: embeddings, language model, LM head."""
