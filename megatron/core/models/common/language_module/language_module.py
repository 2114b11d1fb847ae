"""megatron-core's path of :class:`LanguageModule` (defined in :mod:`megatron.core.models.gpt.gpt_model`)."""
from megatron.core.models.gpt.gpt_model import LanguageModule  # noqa: F401
