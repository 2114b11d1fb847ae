"""Legacy import paths (Megatron-LM before October 2023). Re-exports only; the code lives in
megatron.core.datasets and megatron.training.datasets."""
