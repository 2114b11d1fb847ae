"""megatron.model.t5_model (legacy path): ``T5Model(config, num_tokentypes=0, parallel_output=True, ...)``."""
from megatron.core.models.T5.t5_model import t5_extended_attention_mask, t5_position_ids  # noqa: F401
from megatron.core.models.legacy.t5_model import T5LMHead, T5Model  # noqa: F401

__all__ = ["T5Model", "T5LMHead", "t5_extended_attention_mask", "t5_position_ids"]
