"""The exception for a configuration that cannot work (a flag or a size that does not fit), shared by the core
library and the training entry points (``megatron.training.errors`` re-exports it and prints it as one line)."""


class ConfigurationError(ValueError):
    """A flag or flag combination that cannot work; the message names the flag(s) and the fix."""


__all__ = ["ConfigurationError"]
