"""megatron-core's path of the vision models' base module."""
