"""Classes that checkpoints pickle and ``torch.load(weights_only=True)`` must accept (megatron-core's
``megatron.core.safe_globals``): the argument namespace and the enums of the args."""
from __future__ import annotations

from argparse import Namespace

import torch

from megatron.core.enums import AttnBackend, AttnMaskType, AttnType, LayerType, ModelType
from megatron.core.transformer.enums import AttnBackend as _AttnBackend  # noqa: F401  (same object)

SAFE_GLOBALS = [Namespace, ModelType, AttnBackend, AttnMaskType, AttnType, LayerType]


def register_safe_globals() -> None:
    """Allow :data:`SAFE_GLOBALS` in ``torch.load(weights_only=True)``."""
    torch.serialization.add_safe_globals(SAFE_GLOBALS)
