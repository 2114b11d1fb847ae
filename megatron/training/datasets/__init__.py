"""Training-side data plumbing: samplers and data loaders over megatron.core datasets."""
