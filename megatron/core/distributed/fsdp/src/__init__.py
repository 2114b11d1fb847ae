"""megatron-core's package path of Megatron-FSDP (``megatron.core.distributed.fsdp.src.megatron_fsdp``), built on
this library's Megatron-FSDP in ``megatron.core.distributed.fsdp``."""
