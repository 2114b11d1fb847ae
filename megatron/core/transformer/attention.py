"""Tensor-parallel multi-head / grouped-query attention (self and cross), with KV cache and RoPE.

``ParallelAttention`` is the one implementation, built with megatron-core's submodule names (``linear_qkv``,
``linear_q``/``linear_kv``, ``linear_proj``); megatron-core's ``SelfAttention`` / ``CrossAttention`` are the
same class. The legacy class saves and loads Megatron's names (``query_key_value``, ``dense`` ...) through the one
table of :mod:`megatron.core.transformer.legacy_names`, so legacy checkpoints and megatron-core state dicts map key
for key.

Fused QKV layout (per TP partition): the output of ``query_key_value`` viewed as ``[sq, b, ng, (np/ng + 2) * hn]``
holds, for each of the ``ng`` query groups, the group's ``np/ng`` query heads, then its key head, then its value
head. Without GQA (``ng == np``) that is ``[q_h, k_h, v_h]`` per head. Splitting the weight's rows into TP
contiguous chunks therefore gives each rank whole groups.

Packed sequences (``packed_seq_params`` with ``qkv_format='thd'``, hidden states ``[t, 1, h]``): the rotary angles
restart at each document's start and the core attention attends within each document only.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Tuple, Union

import torch

from megatron.core import tensor_parallel
from megatron.core.transformer.legacy_names import install_legacy_state_dict_names
from megatron.core.transformer.attention_variants import l2_norm
from megatron.core.transformer.dot_product_attention import CoreAttention, DotProductAttention, packed_rotary_rows
from megatron.core.transformer.enums import AttnMaskType, AttnType
from megatron.core.utils import log_once
from megatron.core.process_groups_config import group_of
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.rotary import apply_rotary_pos_emb
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.utils import divide


class LinearQkv(Protocol):
    """What a ``linear_qkv`` submodule is (megatron-core's protocol): ``forward(input) -> (output, bias)`` and
    ``backward_dw()``, the deferred weight-gradient step (a no-op for layers that compute it in backward)."""

    def forward(self, input: torch.Tensor, /) -> tuple[torch.Tensor, object]:
        """``input [s, b, hidden] -> ([s, b, qkv partition], bias or None)``."""
        ...

    def backward_dw(self) -> None:
        """Run the weight-gradient computation deferred from backward."""
        ...


class LinearQkvBuilder(Protocol):
    """What builds a :class:`LinearQkv` (a class such as ``ColumnParallelLinear``): called as
    ``builder(input_size, output_size, *, config, init_method, gather_output, bias, skip_bias_add, is_expert,
    tp_comm_buffer_name, tp_group=None)``."""

    def __call__(self, input_size: int, output_size: int, /, *, config, init_method: Callable[[torch.Tensor], None],
                 gather_output: bool, bias: bool, skip_bias_add: bool, is_expert: bool, tp_comm_buffer_name: str,
                 tp_group: Optional[torch.distributed.ProcessGroup] = None) -> LinearQkv: ...


class LinearLayer(Protocol):
    """What a cross-attention ``linear_q`` / ``linear_kv`` submodule is: ``forward(input) -> (output, bias)``."""

    def forward(self, input: torch.Tensor, /) -> Tuple[torch.Tensor, object]:
        """``input -> (output, bias or None)``."""
        ...


class LinearLayerBuilder(Protocol):
    """What builds a :class:`LinearLayer`: ``builder(input_size, output_size, *, config, init_method,
    gather_output, bias, skip_bias_add, is_expert)``."""

    def __call__(self, input_size: int, output_size: int, /, *, config, init_method: Callable[[torch.Tensor], None],
                 gather_output: bool, bias: bool, skip_bias_add: bool, is_expert: bool) -> LinearLayer: ...


class CoreAttentionBuilder(Protocol):
    """What builds the ``core_attention`` submodule (a class such as ``DotProductAttention``):
    ``builder(*, config, layer_number, attn_mask_type, attention_type, cp_comm_type, softmax_scale,
    pg_collection)``; the result maps ``(query, key, value, attention_mask)`` to the attention output."""

    def __call__(self, *, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 cp_comm_type: Optional[str], softmax_scale: Optional[float], pg_collection) -> torch.nn.Module: ...


@dataclass
class SelfAttentionSubmodules:
    linear_qkv: Union[ModuleSpec, type] = None
    core_attention: Union[ModuleSpec, type] = None
    linear_proj: Union[ModuleSpec, type] = None
    q_layernorm: Union[ModuleSpec, type] = None
    k_layernorm: Union[ModuleSpec, type] = None


@dataclass
class CrossAttentionSubmodules:
    linear_q: Union[ModuleSpec, type] = None
    linear_kv: Union[ModuleSpec, type] = None
    core_attention: Union[ModuleSpec, type] = None
    linear_proj: Union[ModuleSpec, type] = None


class FlashSelfAttention(torch.nn.Module):
    """flash-attn's kernel (``--use-flash-attn``); inputs ``[b, s, heads, hn]``. Needs the flash-attn package."""

    def __init__(self, causal=False, softmax_scale=None, attention_dropout=0.0):
        super().__init__()
        try:
            from flash_attn import flash_attn_func  # type: ignore
        except ImportError as e:
            raise ImportError("--use-flash-attn was given but the flash-attn package is not installed: "
                              "`pip install flash-attn` (CUDA only) or drop --use-flash-attn") from e
        self._flash_attn_func = flash_attn_func
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.dropout_p = attention_dropout
        log_once("attention_flash", "attention: flash-attn (flash_attn_func)")

    def forward(self, q, k, v):
        if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
            raise RuntimeError("flash-attn needs fp16/bf16 CUDA tensors (--fp16/--bf16 on a GPU); "
                               "drop --use-flash-attn on CPU")
        dropout_p = self.dropout_p if self.training else 0.0
        return self._flash_attn_func(q, k, v, dropout_p, softmax_scale=self.softmax_scale, causal=self.causal)


def _class_of(spec, default):
    if spec is None:
        return default
    return spec.module if isinstance(spec, ModuleSpec) else spec


class ParallelAttention(MegatronModule):
    """``ParallelAttention(config, layer_number, attention_type, attn_mask_type)``.

    ``forward(hidden_states [s, b, h], attention_mask, encoder_output=None, inference_params=None,
    rotary_pos_emb=None) -> (output, bias)``; ``bias`` is the output projection's bias, left for the fused
    bias-dropout-add of the layer.
    """

    def __init__(self, config, layer_number, attention_type=AttnType.self_attn,
                 attn_mask_type=AttnMaskType.padding, *, naming: str = "legacy", submodules=None,
                 pg_collection=None, cp_comm_type=None):
        super().__init__(config=config)
        # Process groups (megatron-core's pg_collection): the TP group splits the heads and carries the linear
        # layers' collectives, the CP group the core attention's ring; None = parallel_state's.
        self.pg_collection = pg_collection
        self.tp_group = group_of(pg_collection, "tp")
        self.layer_number = max(1, layer_number)
        self.attention_type = attention_type
        self.attn_mask_type = attn_mask_type
        self.params_dtype = config.params_dtype
        self.sequence_parallel = config.sequence_parallel
        if naming == "legacy":  # Megatron's legacy checkpoint names, at the state-dict boundary only
            install_legacy_state_dict_names(self, "attention")
        self.recompute_core_attention = config.recomputes("core_attn")
        # YaRN (--position-embedding-type yarn) multiplies cos and sin by its attention concentration.
        self.rope_mscale = 1.0
        if config.position_embedding_type == "yarn":
            from megatron.core.transformer.rotary import yarn_concentration

            self.rope_mscale = yarn_concentration(config.rotary_scaling_factor, config.mscale, config.mscale_all_dim)

        query_projection_size = config.kv_channels * config.num_attention_heads
        kv_projection_size = config.kv_channels * config.num_query_groups
        world_size, _ = tensor_parallel.tp_size_and_rank(self.tp_group)
        self.hidden_size_per_attention_head = config.kv_channels
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, world_size)
        self.num_query_groups_per_partition = divide(config.num_query_groups, world_size)

        self.use_flash_attn = (config.use_flash_attn and attention_type == AttnType.self_attn
                               and attn_mask_type == AttnMaskType.causal)

        qkv_bias = config.add_bias_linear or config.add_qkv_bias
        common = dict(config=config, init_method=config.init_method, gather_output=False)
        if self.tp_group is not None:
            common["tp_group"] = self.tp_group
        sub = submodules
        if attention_type == AttnType.self_attn:
            col = _class_of(getattr(sub, "linear_qkv", None), tensor_parallel.ColumnParallelLinear)
            self.linear_qkv = col(config.hidden_size, query_projection_size + 2 * kv_projection_size,
                                                   bias=qkv_bias, **common)
        else:
            assert attention_type == AttnType.cross_attn
            col_q = _class_of(getattr(sub, "linear_q", None), tensor_parallel.ColumnParallelLinear)
            col_kv = _class_of(getattr(sub, "linear_kv", None), tensor_parallel.ColumnParallelLinear)
            self.linear_q = col_q(config.hidden_size, query_projection_size, bias=qkv_bias, **common)
            self.linear_kv = col_kv(config.hidden_size, 2 * kv_projection_size, bias=qkv_bias, **common)

        if naming == "mcore" or getattr(sub, "core_attention", None) is not None:
            extra = {} if pg_collection is None else {"pg_collection": pg_collection}
            if cp_comm_type is not None:
                extra["cp_comm_type"] = cp_comm_type
            self.core_attention = build_module(getattr(sub, "core_attention", None) or DotProductAttention,
                                               config=config, layer_number=self.layer_number,
                                               attn_mask_type=attn_mask_type, **extra)
        else:
            self.core_attention = CoreAttention(self.layer_number, config, attn_mask_type)

        # Llama 4: no rotary embedding in this layer (--no-rope-freq), the weightless QK L2 norm (--qk-l2-norm).
        self.no_rope = config.is_no_rope_layer(self.layer_number)
        self.qk_l2_norm = config.qk_l2_norm and not (config.qk_l2_norm_rope_layers_only and self.no_rope)
        # --qk-layernorm: one norm (config.normalization) over each head's hn channels of the queries / keys.
        self.q_layernorm = self.k_layernorm = None
        if config.qk_layernorm:
            from megatron.core.transformer.norms import get_norm

            self.q_layernorm = get_norm(config, hidden_size=self.hidden_size_per_attention_head)
            self.k_layernorm = get_norm(config, hidden_size=self.hidden_size_per_attention_head)
            if world_size > 1:
                # One weight shared by all heads, which the TP ranks split: each rank's gradient covers its own
                # heads only, so finalize_model_grads sums it over TP (as for sequence-parallel norms).
                for norm in (self.q_layernorm, self.k_layernorm):
                    for param in norm.parameters():
                        param.sequence_parallel = True

        if self.use_flash_attn:
            self.core_attention_flash = FlashSelfAttention(
                causal=True, softmax_scale=1.0 / (self.hidden_size_per_attention_head ** 0.5),
                attention_dropout=config.attention_dropout)

        row = _class_of(getattr(sub, "linear_proj", None), tensor_parallel.RowParallelLinear)
        self.linear_proj = row(query_projection_size, config.hidden_size, config=config,
                               init_method=config.output_layer_init_method, bias=config.add_bias_linear,
                               input_is_parallel=True, skip_bias_add=True,
                               **({} if self.tp_group is None else {"tp_group": self.tp_group}))

    # ------------------------------------------------------------------------------------------ helpers
    def _checkpointed_attention_forward(self, query_layer, key_layer, value_layer, attention_mask,
                                        packed_seq_params=None):
        """Selective recompute: keep no activations of the core attention (the s^2 part) for backward."""

        def custom_forward(*inputs):
            return self._core_attention(inputs[0], inputs[1], inputs[2], inputs[3], packed_seq_params)

        return tensor_parallel.checkpoint(custom_forward, False, query_layer, key_layer, value_layer, attention_mask)

    def _core_attention(self, query_layer, key_layer, value_layer, attention_mask, packed_seq_params=None):
        if packed_seq_params is None:
            return self.core_attention(query_layer, key_layer, value_layer, attention_mask)
        return self.core_attention(query_layer, key_layer, value_layer, attention_mask,
                                   packed_seq_params=packed_seq_params)

    def _packed_rotary(self, rotary_pos_emb, packed_seq_params):
        """Packed sequences (thd): the rows of the angles for each document's positions, restarting at 0 at every
        document (``cu_seqlens_*_padded`` when given, else ``cu_seqlens_*``, as megatron-core)."""
        q_pos_emb, k_pos_emb = rotary_pos_emb
        return packed_rotary_rows(self.core_attention, packed_seq_params, q_pos_emb, k_pos_emb)

    def _allocate_memory(self, inference_max_sequence_len, batch_size, device, dtype):
        return torch.empty(inference_max_sequence_len, batch_size, self.num_query_groups_per_partition,
                           self.hidden_size_per_attention_head, dtype=dtype, device=device)

    def _split_qkv(self, hidden_states, encoder_output):
        hn = self.hidden_size_per_attention_head
        ng = self.num_query_groups_per_partition
        heads_per_group = self.num_attention_heads_per_partition // ng
        if self.attention_type == AttnType.self_attn:
            mixed, _ = self.linear_qkv(hidden_states)
            mixed = mixed.view(*mixed.size()[:-1], ng, (heads_per_group + 2) * hn)
            query, key, value = torch.split(mixed, [heads_per_group * hn, hn, hn], dim=3)
            query = query.reshape(query.size(0), query.size(1), -1, hn)
        else:
            mixed_kv, _ = self.linear_kv(encoder_output)
            mixed_kv = mixed_kv.view(*mixed_kv.size()[:-1], ng, 2 * hn)
            key, value = torch.split(mixed_kv, [hn, hn], dim=3)
            query, _ = self.linear_q(hidden_states)
            query = query.view(*query.size()[:-1], self.num_attention_heads_per_partition, hn)
        return query, key, value

    # ------------------------------------------------------------------------------------------ forward
    def forward(self, hidden_states, attention_mask, encoder_output=None, inference_params=None,
                rotary_pos_emb=None, packed_seq_params=None):
        packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if packed and inference_params is not None:
            raise NotImplementedError("attention: packed sequences (packed_seq_params) with inference_params (KV "
                                      "cache) are not supported")
        is_first_step = False
        if inference_params is not None:
            memory = inference_params.key_value_memory_dict
            if self.layer_number not in memory:
                # The cache holds what the layer computes (the params dtype, or fp16/bf16 under Float16Module).
                key_memory = self._allocate_memory(inference_params.max_sequence_length, inference_params.max_batch_size,
                                                   hidden_states.device, hidden_states.dtype)
                value_memory = self._allocate_memory(inference_params.max_sequence_length,
                                                     inference_params.max_batch_size, hidden_states.device,
                                                     hidden_states.dtype)
                memory[self.layer_number] = (key_memory, value_memory)
                is_first_step = True
            else:
                key_memory, value_memory = memory[self.layer_number]

        query_layer, key_layer, value_layer = self._split_qkv(hidden_states, encoder_output)
        if self.q_layernorm is not None:
            query_layer = self.q_layernorm(query_layer)
            key_layer = self.k_layernorm(key_layer)
        if self.qk_l2_norm:
            query_layer = l2_norm(query_layer, self.config.layernorm_epsilon)
            key_layer = l2_norm(key_layer, self.config.layernorm_epsilon)
        if self.no_rope:
            rotary_pos_emb = None

        if rotary_pos_emb is not None and not isinstance(rotary_pos_emb, tuple):
            rotary_pos_emb = (rotary_pos_emb,) * 2

        if inference_params is not None:
            batch_start = inference_params.batch_size_offset
            batch_end = batch_start + key_layer.size(1)
            sequence_start = inference_params.sequence_len_offset
            sequence_end = sequence_start + key_layer.size(0)
            key_memory[sequence_start:sequence_end, batch_start:batch_end, ...] = key_layer
            value_memory[sequence_start:sequence_end, batch_start:batch_end, ...] = value_layer
            key_layer = key_memory[:sequence_end, batch_start:batch_end, ...]
            value_layer = value_memory[:sequence_end, batch_start:batch_end, ...]
            if rotary_pos_emb is not None:
                q_pos_emb, k_pos_emb = rotary_pos_emb
                if not is_first_step:
                    q_pos_emb = q_pos_emb[sequence_start:sequence_end]
                else:
                    q_pos_emb = q_pos_emb[:sequence_end]
                rotary_pos_emb = (q_pos_emb, k_pos_emb[:sequence_end])

        if rotary_pos_emb is not None and packed:
            rotary_pos_emb = self._packed_rotary(rotary_pos_emb, packed_seq_params)
        if rotary_pos_emb is not None:
            q_pos_emb, k_pos_emb = rotary_pos_emb
            rope_fusion = self.config.apply_rope_fusion
            interleaved = self.config.rotary_interleaved
            query_layer = apply_rotary_pos_emb(query_layer, q_pos_emb[: query_layer.size(0)], fused=rope_fusion,
                                               interleaved=interleaved, mscale=self.rope_mscale)
            key_layer = apply_rotary_pos_emb(key_layer, k_pos_emb[: key_layer.size(0)], fused=rope_fusion,
                                             interleaved=interleaved, mscale=self.rope_mscale)

        if self.use_flash_attn and packed_seq_params is None:
            groups = query_layer.size(2) // key_layer.size(2)
            if groups > 1:
                key_layer = key_layer.repeat_interleave(groups, dim=2)
                value_layer = value_layer.repeat_interleave(groups, dim=2)
            q, k, v = [x.transpose(0, 1).contiguous() for x in (query_layer, key_layer, value_layer)]
            rng = (tensor_parallel.get_cuda_rng_tracker().fork() if not self.sequence_parallel
                   else contextlib.nullcontext())
            with rng:
                context_layer = self.core_attention_flash(q, k, v)
            context_layer = context_layer.transpose(0, 1).reshape(context_layer.size(1), context_layer.size(0), -1)
        elif self.recompute_core_attention and self.training:
            context_layer = self._checkpointed_attention_forward(query_layer, key_layer, value_layer, attention_mask,
                                                                 packed_seq_params)
        else:
            context_layer = self._core_attention(query_layer, key_layer, value_layer, attention_mask,
                                                 packed_seq_params)

        output, bias = self.linear_proj(context_layer)
        return output, bias


class SelfAttention(ParallelAttention):
    """megatron-core: ``SelfAttention(config, submodules, layer_number=1, attn_mask_type=padding, cp_comm_type=None,
    pg_collection=None)``; ``forward(hidden_states, attention_mask, key_value_states=None, inference_params=None,
    rotary_pos_emb=None)``."""

    def __init__(self, config, submodules: Optional[SelfAttentionSubmodules] = None, layer_number: int = 1,
                 attn_mask_type=AttnMaskType.padding, cp_comm_type: Optional[str] = None, pg_collection=None):
        super().__init__(config, layer_number, AttnType.self_attn, attn_mask_type, naming="mcore",
                         submodules=submodules, pg_collection=pg_collection, cp_comm_type=cp_comm_type)

    def forward(self, hidden_states, attention_mask, key_value_states=None, inference_params=None,
                rotary_pos_emb=None, packed_seq_params=None):
        return super().forward(hidden_states, attention_mask, None, inference_params, rotary_pos_emb,
                               packed_seq_params=packed_seq_params)


class CrossAttention(ParallelAttention):
    """megatron-core: ``CrossAttention(config, submodules, layer_number=1, attn_mask_type=padding,
    cp_comm_type=None, pg_collection=None)``."""

    def __init__(self, config, submodules: Optional[CrossAttentionSubmodules] = None, layer_number: int = 1,
                 attn_mask_type=AttnMaskType.padding, cp_comm_type: Optional[str] = None, pg_collection=None):
        super().__init__(config, layer_number, AttnType.cross_attn, attn_mask_type, naming="mcore",
                         submodules=submodules, pg_collection=pg_collection, cp_comm_type=cp_comm_type)

    def forward(self, hidden_states, attention_mask, key_value_states=None, inference_params=None,
                rotary_pos_emb=None, packed_seq_params=None):
        if packed_seq_params is not None:
            raise NotImplementedError("cross attention: packed sequences (packed_seq_params) are not supported")
        return super().forward(hidden_states, attention_mask, key_value_states, inference_params, rotary_pos_emb)


# megatron-core's name of the attention base class (SelfAttention and CrossAttention derive from it).
Attention = ParallelAttention
