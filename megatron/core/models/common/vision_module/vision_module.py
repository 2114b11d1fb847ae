"""``VisionModule``: the base of megatron-core's vision models (CLIP, ViT ...), a :class:`MegatronModule` built from
a ``TransformerConfig`` that adds nothing yet (as in megatron-core)."""
from megatron.core.transformer.module import MegatronModule


class VisionModule(MegatronModule):
    """``VisionModule(config)``: a MegatronModule that vision models derive from."""

    def __init__(self, config) -> None:
        super().__init__(config=config)
