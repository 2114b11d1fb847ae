"""MambaStack: the layers of a hybrid model that one pipeline stage (and virtual chunk) builds, plus the final norm.

The layers come from the hybrid pattern (:mod:`megatron.core.ssm.mamba_hybrid_layer_allocation`): ``M`` a
:class:`MambaLayer`, ``*`` an attention-only ``TransformerLayer``, ``-`` an MLP-only ``TransformerLayer``, ``E`` an
MoE-only one. Every layer is numbered globally (``layer_number`` = 1 + its index in the whole pattern), so
checkpoint keys and per-layer settings do not depend on the pipeline layout. The final norm is ``final_norm``
(megatron-core's name for hybrid stacks; GPT's is ``final_layernorm``).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional, Union

import torch

from megatron.core import parallel_state, tensor_parallel
from megatron.core.process_groups_config import pg_rank, pg_size
from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron.core.ssm.mamba_hybrid_layer_allocation import HybridPattern, Symbols, layers_of_stage, \
    parse_hybrid_pattern
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import IdentityOp, ModuleSpec, build_module
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.transformer.utils import sharded_state_dict_default
from megatron.core.utils import make_viewless_tensor


@dataclass
class MambaStackSubmodules:
    mamba_layer: Union[ModuleSpec, type] = IdentityOp
    attention_layer: Union[ModuleSpec, type] = IdentityOp
    mlp_layer: Union[ModuleSpec, type] = IdentityOp
    moe_layer: Union[ModuleSpec, type] = IdentityOp
    final_norm: Union[ModuleSpec, type] = IdentityOp


def stage_layers(pattern: HybridPattern, vp_stage: Optional[int] = None, pg_collection=None):
    """(global index of the first layer, layer symbols) of this pipeline rank (``pg_collection.pp``, else
    parallel_state's) and virtual chunk."""
    pp, rank = pg_size(pg_collection, "pp"), pg_rank(pg_collection, "pp")
    if vp_stage is None:
        vp_stage = parallel_state.get_virtual_pipeline_model_parallel_rank() or 0
    return layers_of_stage(pattern, pp, rank, vp_stage)


class MambaStack(MegatronModule):
    """``MambaStack(config, submodules, hybrid_override_pattern=None, pre_process=True, post_layer_norm=True,
    post_process=True, device=None, dtype=None, pg_collection=None, *, hybrid_layer_pattern=None, vp_stage=None)``;
    ``forward(hidden_states, attention_mask, inference_params=None, rotary_pos_emb=None) -> [s, b, h]``. The
    collection's ``pp`` group (else parallel_state's) picks this stage's layers; every layer gets the collection."""

    def __init__(self, config, submodules: MambaStackSubmodules, residual_in_fp32: bool = False,
                 pre_process: bool = True, hybrid_attention_ratio: float = 0.0, hybrid_mlp_ratio: float = 0.0,
                 hybrid_override_pattern: Optional[str] = None, post_layer_norm: bool = True,
                 post_process: bool = True, device=None, dtype=None, pg_collection=None, *,
                 hybrid_layer_pattern: Optional[str] = None, vp_stage: Optional[int] = None):
        super().__init__(config=config)
        if device is not None or dtype is not None:
            raise ValueError("MambaStack: device / dtype are taken from the config (use_cpu_initialization, "
                             "params_dtype)")
        self.pg_collection = pg_collection
        if residual_in_fp32:
            raise ValueError("MambaStack: residual_in_fp32 is not implemented")
        if hybrid_attention_ratio or hybrid_mlp_ratio:
            raise ValueError("hybrid_attention_ratio / hybrid_mlp_ratio allocation is not implemented: give "
                             "hybrid_layer_pattern")
        text = hybrid_layer_pattern or hybrid_override_pattern or config.hybrid_layer_pattern
        if text is None:
            raise ValueError("MambaStack needs hybrid_layer_pattern (--hybrid-layer-pattern)")
        self.pattern = parse_hybrid_pattern(text)
        if config.num_layers != self.pattern.num_layers:
            raise ValueError(f"config.num_layers ({config.num_layers}) differs from the {self.pattern.num_layers} "
                             f"layers of the hybrid pattern {text!r}")
        self.pre_process, self.post_process = pre_process, post_process
        self.post_layer_norm = post_layer_norm
        self.input_tensor = None
        self.sequence_parallel = config.sequence_parallel
        offset, symbols = stage_layers(self.pattern, vp_stage, pg_collection)
        self.layer_type_list = list(symbols)
        specs = {Symbols.MAMBA: submodules.mamba_layer, Symbols.ATTENTION: submodules.attention_layer,
                 Symbols.MLP: submodules.mlp_layer, Symbols.MOE: submodules.moe_layer}
        self.layers = torch.nn.ModuleList(
            [build_module(specs[symbol], config=config, layer_number=offset + i + 1,
                          **({} if pg_collection is None else {"pg_collection": pg_collection}))
             for i, symbol in enumerate(symbols)])
        if post_process and post_layer_norm:
            self.final_norm = build_module(submodules.final_norm, config=config, hidden_size=config.hidden_size,
                                           eps=config.layernorm_epsilon)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict = None):
        """Per-layer keys, never stacked (layers differ by type): layer ``i`` of the whole pattern (``layer_number -
        1``) under ``{prefix}layers.{i}.``, whatever the pipeline layout; then the final norm."""
        if sharded_offsets:
            raise ValueError("a hybrid stack takes no sharded_offsets")
        out = {}
        for index, layer in enumerate(self.layers):
            local_prefix = f"{prefix}layers.{index}."
            layer_sd = layer.sharded_state_dict(local_prefix, (), metadata)
            replace_prefix_for_sharding(layer_sd, local_prefix, f"{prefix}layers.{layer.layer_number - 1}.")
            out.update(layer_sd)
        for name, module in self.named_children():
            if module is not self.layers:
                out.update(sharded_state_dict_default(module, f"{prefix}{name}.", (), metadata))
        return out

    def mamba_state_shapes_per_request(self):
        """``(conv state shape, SSM state shape)`` per sequence of this stage's first Mamba layer; None when the
        stage has none (megatron-core's)."""
        for symbol, layer in zip(self.layer_type_list, self.layers):
            if symbol == Symbols.MAMBA:
                return layer.mamba_state_shapes_per_request()
        return None

    def set_input_tensor(self, input_tensor):
        """The activation received from the previous pipeline stage (used instead of forward's input)."""
        self.input_tensor = input_tensor

    def forward(self, hidden_states, attention_mask, inference_params=None, rotary_pos_emb=None, **unused):
        if not self.pre_process:
            hidden_states = self.input_tensor
        hidden_states = make_viewless_tensor(hidden_states, requires_grad=True, keep_graph=True)
        # With sequence parallelism every TP rank holds different tokens: hidden dropout must differ per rank.
        rng_context = (tensor_parallel.get_cuda_rng_tracker().fork() if self.sequence_parallel
                       else contextlib.nullcontext())
        with rng_context:
            for layer in self.layers:
                if isinstance(layer, TransformerLayer):
                    hidden_states, _ = layer(hidden_states, attention_mask, rotary_pos_emb=rotary_pos_emb,
                                             inference_params=inference_params)
                else:
                    hidden_states = layer(hidden_states, attention_mask, inference_params=inference_params,
                                          rotary_pos_emb=rotary_pos_emb)
        if self.post_process and self.post_layer_norm:
            hidden_states = self.final_norm(hidden_states)
        return hidden_states
