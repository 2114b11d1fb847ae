"""megatron.core.pipeline_parallel: p2p communication between stages and the forward-backward schedules."""
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

__all__ = ["get_forward_backward_func"]
