"""megatron.core.models.T5: megatron-core's T5Model and its layer specs."""
from megatron.core.models.T5.t5_model import T5Model

__all__ = ["T5Model"]
