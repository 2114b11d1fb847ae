"""Model providers the entry points share (Megatron-LM HEAD's ``megatron/training/models/``)."""
