"""Megatron-LM's post-training (ModelOpt) entry points: the extra command-line flags its model configurations carry."""
