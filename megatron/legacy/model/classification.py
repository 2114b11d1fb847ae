"""megatron.model.classification (legacy path): ``Classification(config, num_classes, num_tokentypes=2, ...)``."""
from megatron.core.models.legacy.classification import Classification  # noqa: F401
