"""Inference: text generation (``megatron.inference.text_generation``) and its REST server."""
