"""Library-wide switches (megatron-core's ``megatron.core.config``): experimental features are off unless enabled."""

ENABLE_EXPERIMENTAL = False


def set_experimental_flag(flag: bool) -> None:
    """Enable (or disable) the features marked experimental (``megatron.core.utils.experimental_fn/cls``)."""
    global ENABLE_EXPERIMENTAL
    ENABLE_EXPERIMENTAL = bool(flag)


def is_experimental_enabled() -> bool:
    return ENABLE_EXPERIMENTAL
