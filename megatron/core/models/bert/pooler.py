"""megatron-core's path of :class:`Pooler` (defined in :mod:`megatron.core.models.common.language_model`)."""
from megatron.core.models.common.language_model import Pooler  # noqa: F401
