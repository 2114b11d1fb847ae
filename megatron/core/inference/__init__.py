"""megatron-core's inference package path: only the names other parts of megatron-core hand out live here (this
library's text generation is ``megatron/inference``)."""
