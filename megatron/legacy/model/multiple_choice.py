"""megatron.model.multiple_choice (legacy path): ``MultipleChoice(config, num_tokentypes=2, ...)``."""
from megatron.core.models.legacy.classification import MultipleChoice  # noqa: F401
