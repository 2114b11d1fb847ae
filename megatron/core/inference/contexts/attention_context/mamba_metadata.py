"""``MambaInferenceStateConfig``: what a hybrid (Mamba) model needs allocated per request for inference (megatron-core's
dataclass; :func:`megatron.core.utils.get_mamba_inference_state_config_from_model` builds it from a model)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple


@dataclass
class MambaInferenceStateConfig:
    """``layer_type_list``: the stage's layer symbols (``M`` Mamba, ``*`` attention, ``-`` MLP, ``E`` MoE);
    ``mamba_conv_states_shape`` ``(conv channels, d_conv)`` and ``mamba_ssm_states_shape`` ``(heads, head dim,
    state dim)`` per request, on this tensor-parallel rank."""

    layer_type_list: List[str]
    mamba_conv_states_shape: Tuple[int]
    mamba_ssm_states_shape: Tuple[int]
