"""MambaLayer: ``residual + dropout(mixer(norm(x)))`` (megatron-core's ``MambaLayer``, a ``M`` of the hybrid pattern).

``norm`` is the config's normalization (RMSNorm for every Nemotron-H model); Megatron-LM fuses it into the mixer's
``in_proj`` (Transformer Engine's ``LayerNormColumnParallelLinear``), which is why torch_dist stores ``norm.weight``
as ``mixer.in_proj.layer_norm_weight``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Union


from megatron.core.transformer.module import GraphableMegatronModule
from megatron.core.transformer.spec_utils import IdentityFuncOp, IdentityOp, ModuleSpec, build_module
from megatron.core.transformer.utils import apply_sharded_keys_map
from megatron.core.utils import make_viewless_tensor


@dataclass
class MambaLayerSubmodules:
    norm: Union[ModuleSpec, type] = IdentityOp
    mixer: Union[ModuleSpec, type] = IdentityOp
    mamba_bda: Union[ModuleSpec, type] = IdentityFuncOp
    # Checkpoint key prefixes renamed in ``sharded_state_dict`` (the local spec: ``norm.`` is stored under
    # Transformer Engine's fused name ``mixer.in_proj.layer_norm_``).
    sharded_state_dict_keys_map: Dict[str, str] = field(default_factory=dict)


class MambaLayer(GraphableMegatronModule):
    """``MambaLayer(config, submodules, layer_number=1, residual_in_fp32=False, pg_collection=None)`` (the collection
    goes to the mixer);
    ``forward(hidden_states [s, b, h], attention_mask=None, inference_params=None, rotary_pos_emb=None)``."""

    def __init__(self, config, submodules: MambaLayerSubmodules, layer_number: int = 1,
                 residual_in_fp32: bool = False, pg_collection=None):
        super().__init__(config=config)
        if residual_in_fp32:
            raise ValueError("MambaLayer: residual_in_fp32 is not implemented (use --fp32-residual-connection)")
        self.layer_number = layer_number
        self.pg_collection = pg_collection
        self.hidden_dropout = config.hidden_dropout
        self.norm = build_module(submodules.norm, config=config, hidden_size=config.hidden_size,
                                 eps=config.layernorm_epsilon)
        self.mixer = build_module(submodules.mixer, config=config, d_model=config.hidden_size,
                                  layer_number=layer_number,
                                  **({} if pg_collection is None else {"pg_collection": pg_collection}))
        self.mamba_bda = build_module(submodules.mamba_bda)
        self.sharded_state_dict_keys_map = dict(submodules.sharded_state_dict_keys_map)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict = None):
        """The default (every submodule's) with the spec's ``sharded_state_dict_keys_map`` applied to the keys."""
        return apply_sharded_keys_map(super().sharded_state_dict(prefix, sharded_offsets, metadata), prefix,
                                      self.sharded_state_dict_keys_map)

    def mamba_state_shapes_per_request(self):
        """The mixer's ``(conv state shape, SSM state shape)`` per sequence."""
        return self.mixer.mamba_state_shapes_per_request()

    def forward(self, hidden_states, attention_mask=None, inference_params=None, rotary_pos_emb=None, **unused):
        out_with_bias = self.mixer(self.norm(hidden_states), inference_params=inference_params)
        output = self.mamba_bda(self.training, self.config.bias_dropout_fusion)(
            out_with_bias, hidden_states, self.hidden_dropout)
        return make_viewless_tensor(inp=output, requires_grad=output.requires_grad, keep_graph=True)
