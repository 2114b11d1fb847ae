"""Layer specs for megatron-core's GPTModel (``get_gpt_layer_local_spec()``)."""
from __future__ import annotations

from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer, default_layer_submodules


def get_gpt_layer_local_spec(num_experts=None, moe_grouped_gemm=False, qk_layernorm=False) -> ModuleSpec:
    """Causal self-attention + MLP built from megatron.core's own layers (no Transformer Engine)."""
    if num_experts is not None:
        raise NotImplementedError("mixture-of-experts layers (num_experts) are not implemented")
    # qk_layernorm is read from config.qk_layernorm by the attention (the same local norms either way).
    return ModuleSpec(module=TransformerLayer, submodules=default_layer_submodules(AttnMaskType.causal))


def get_gpt_layer_with_transformer_engine_spec(num_experts=None, moe_grouped_gemm=False, qk_layernorm=False):
    """Transformer Engine layers: raises a clear error when TE is missing (and TE layers are not built yet)."""
    from megatron.core.transformer.te_support import transformer_engine_layers_unavailable

    transformer_engine_layers_unavailable()
