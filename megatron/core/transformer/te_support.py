"""Transformer Engine (``--transformer-impl transformer_engine``): imported lazily, with a clear error."""
from __future__ import annotations

from megatron.core.utils import log_once


def require_transformer_engine():
    """Return the ``transformer_engine`` module or raise an error that says what to do."""
    try:
        import transformer_engine  # type: ignore  # noqa: F401
        import transformer_engine.pytorch  # type: ignore  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "--transformer-impl transformer_engine was requested but Transformer Engine is not installed: install "
            "it (`pip install transformer_engine[pytorch]`, CUDA only) or use --transformer-impl local"
        ) from e
    log_once("transformer_engine", f"transformer implementation: Transformer Engine {transformer_engine.__version__}")
    return transformer_engine


def transformer_engine_layers_unavailable():
    """``--transformer-impl transformer_engine``: a clear error either way, never a silent fallback.

    Without TE installed the error says how to install it; with TE installed it says that this library does not
    build its transformer from TE modules yet (use ``--transformer-impl local``).
    """
    require_transformer_engine()
    raise NotImplementedError("--transformer-impl transformer_engine: Transformer Engine is installed, but building "
                              "the transformer from TE modules is not implemented in this library yet; use "
                              "--transformer-impl local")
