"""TransformerConfig: the shape and numerics of a transformer, with Megatron's fields and rules."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from megatron.core.fp8_utils import fp8_recipe_from_config
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.utils import init_method_normal, scaled_init_method_normal


@dataclass
class TransformerConfig(ModelParallelConfig):
    """Transformer settings; derived sizes are filled and contradictions rejected in ``__post_init__``."""

    # Model architecture
    num_layers: int = 0
    hidden_size: int = 0
    num_attention_heads: int = 0
    num_query_groups: Optional[int] = None
    ffn_hidden_size: Optional[int] = None
    kv_channels: Optional[int] = None
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    fp32_residual_connection: bool = False
    apply_residual_connection_post_layernorm: bool = False
    layernorm_epsilon: float = 1e-5
    layernorm_zero_centered_gamma: bool = False
    add_bias_linear: bool = True
    gated_linear_unit: bool = False
    activation_func: Callable = F.gelu

    # Initialization
    init_method: Optional[Callable] = None
    output_layer_init_method: Optional[Callable] = None
    init_method_std: float = 0.02

    # Mixed precision
    apply_query_key_layer_scaling: bool = True
    attention_softmax_in_fp32: bool = True

    # Fusions
    bias_gelu_fusion: bool = False
    masked_softmax_fusion: bool = False
    persist_layer_norm: bool = False
    bias_dropout_fusion: bool = False
    # megatron-core's newer fusion fields (--bias-swiglu-fusion, --no-rope-fusion, --cross-entropy-loss-fusion):
    # bias + SwiGLU of a gated MLP, rotary embedding, vocab-parallel cross entropy as torch.compile'd kernels.
    bias_activation_fusion: bool = False
    apply_rope_fusion: bool = False
    cross_entropy_loss_fusion: bool = False

    # Activation recomputation
    recompute_granularity: Optional[str] = None
    recompute_method: Optional[str] = None
    recompute_num_layers: Optional[int] = None
    distribute_saved_activations: Optional[bool] = None

    # FP8 (--fp8-format e4m3|hybrid): GEMMs of the linear layers in FP8, see megatron/core/fp8_utils.py
    fp8: Optional[str] = None
    fp8_recipe: str = "delayed"
    fp8_margin: int = 0
    fp8_interval: int = 1
    fp8_amax_history_len: int = 1
    fp8_amax_compute_algo: str = "most_recent"
    fp8_wgrad: bool = True

    normalization: str = "LayerNorm"

    def __post_init__(self):
        super().__post_init__()

        if self.fp16 and self.bf16:
            raise ValueError(f"Only one of self.fp16: {self.fp16} and self.bf16 {self.bf16} should be True.")

        if self.num_attention_heads % self.tensor_model_parallel_size != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"tensor_model_parallel_size ({self.tensor_model_parallel_size})."
            )

        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size

        if self.kv_channels is None:
            if self.num_attention_heads == 0:
                raise ValueError("num_attention_heads must be set (> 0) to derive kv_channels")
            self.kv_channels = self.hidden_size // self.num_attention_heads

        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads

        if self.num_query_groups % self.tensor_model_parallel_size != 0:
            raise ValueError(
                f"num_query_groups ({self.num_query_groups}) must be a multiple of "
                f"tensor_model_parallel_size ({self.tensor_model_parallel_size})."
            )
        if self.num_attention_heads % self.num_query_groups != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_query_groups ({self.num_query_groups})."
            )

        if self.apply_query_key_layer_scaling:
            self.attention_softmax_in_fp32 = True

        if self.fp8 is not None:
            fp8_recipe_from_config(self)  # raises a ValueError naming the flag for an invalid combination

        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"normalization must be 'LayerNorm' or 'RMSNorm', got {self.normalization!r}")

        if self.recompute_granularity is not None:
            if self.recompute_granularity not in ("full", "selective"):
                raise ValueError(
                    f'When using recompute_granuarlity: {self.recompute_granularity} must be "full" or "selective".'
                )
            if self.recompute_method is not None:
                if self.recompute_method not in ("block", "uniform"):
                    raise ValueError(f'recompute_method: {self.recompute_method} must be "block" or "uniform".')
            elif self.recompute_granularity != "selective":
                raise ValueError(
                    f'Using recompute_granularity: {self.recompute_granularity} so recompute_method must be "block" or "uniform"'
                )
            if self.recompute_granularity != "selective" and self.recompute_num_layers is None:
                raise ValueError(
                    f"When using recompute_granularity: {self.recompute_granularity} recompute_num_layers must be between "
                    f"1 and num_layers_per_pipeline_rank: "
                    f"{self.num_layers // self.pipeline_model_parallel_size}"
                )
            if self.recompute_granularity == "selective" and self.recompute_num_layers is not None:
                raise ValueError(
                    f"When using recompute_granularity: {self.recompute_granularity} recompute_num_layers must be None."
                )
            if self.distribute_saved_activations and self.sequence_parallel:
                raise ValueError(
                    f"distribute_saved_activations: {self.distribute_saved_activations} must be false when "
                    f"sequence parallel is enabled: {self.sequence_parallel}"
                )

        if self.virtual_pipeline_model_parallel_size is not None:
            if self.num_layers % self.virtual_pipeline_model_parallel_size != 0:
                raise ValueError(
                    f"num_layers: {self.num_layers} must be divisible by virtual_model_parallel_size "
                    f"{self.virtual_pipeline_model_parallel_size}"
                )

        if self.bias_gelu_fusion:
            if not self.add_bias_linear:
                raise ValueError("When bias_gelu_fusion is True, add_bias_linear must also be True.")
            if self.activation_func is not F.gelu:
                raise ValueError("When bias_gelu_fusion is True, activation_func must be F.gelu.")

        if self.init_method is None:
            self.init_method = init_method_normal(self.init_method_std)
        if self.output_layer_init_method is None:
            self.output_layer_init_method = scaled_init_method_normal(self.init_method_std, max(self.num_layers, 1))
