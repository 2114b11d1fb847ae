"""Multi-latent attention (MLA, DeepSeek-V2/V3): megatron-core's ``MLASelfAttention`` with its submodule names.

Sizes: hidden ``h``, ``n`` heads (``n/t`` per tensor-parallel rank), no-position head part ``d_n`` (``qk_head_dim``),
rotary part ``d_r`` (``qk_pos_emb_head_dim``), query/key head ``d_q = d_n + d_r``, value head ``d_v``, query latent
``r_q`` (``q_lora_rank``, None: no query compression) and key/value latent ``r_kv`` (``kv_lora_rank``).

* queries: ``linear_q_proj [n d_q, h]`` (column parallel), or ``linear_q_down_proj [r_q, h]`` -> ``q_layernorm(r_q)``
  -> ``linear_q_up_proj [n d_q, r_q]`` (column parallel); head j is rows ``[j d_q, (j+1) d_q)``: ``d_n`` then ``d_r``;
* keys and values: ``linear_kv_down_proj [r_kv + d_r, h]`` gives the latent ``c`` (``r_kv``) and ONE rotary key
  ``k_r`` (``d_r``) shared by all heads; ``kv_layernorm(c)`` -> ``linear_kv_up_proj [n (d_n + d_v), r_kv]`` (column
  parallel), head j = ``k_n`` (``d_n``) then ``v`` (``d_v``);
* RoPE only on ``q_r`` and ``k_r``, as adjacent pairs ``(x_2i, x_2i+1)`` rotating by ``pos f_i``: the ``d_r`` channels
  are reordered ``[x_0, x_2, ..., x_1, x_3, ...]`` and rotated in the rotate-half layout (the output stays reordered,
  for queries and keys alike, which leaves ``q.k`` unchanged); YaRN frequencies by default (``rope_type``);
* ``Q = [q_n, q_r]``, ``K = [k_n, k_r]`` (``k_r`` broadcast to the heads), ``V = v``; causal softmax attention with
  scale ``g(s, mscale_all_dim)^2 / sqrt(d_q)`` (YaRN's ``g``, see :mod:`megatron.core.transformer.rotary`); the
  ``[s, b, n/t d_v]`` output goes through ``linear_proj [h, n d_v]`` (row parallel).

The latent norms exist only with ``qk_layernorm`` (RMSNorm / LayerNorm of ``config.normalization``). The down
projections are duplicated on every tensor-parallel rank (:class:`DuplicatedLinear`, Transformer Engine's choice):
each rank projects its own tokens, so under sequence parallelism the up projections all-gather the latents and
``k_r`` is all-gathered before RoPE. Selective recompute ``mla_up_proj`` recomputes the latent norms, up projections
and RoPE in backward instead of keeping ``Q``, ``K`` and ``V``. Context parallelism runs through the core attention
(:mod:`megatron.core.transformer.context_parallel`, values of width ``d_v`` padded there).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Union

import torch

from megatron.core import tensor_parallel
from megatron.core.process_groups_config import group_of, pg_rank, pg_size
from megatron.core.packed_seq_params import packed_max_seqlen
from megatron.core.transformer.dot_product_attention import DotProductAttention, packed_rotary_rows
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.rotary import (
    RotaryEmbedding,
    YarnRotaryEmbedding,
    apply_rotary_pos_emb,
    deinterleave_rotary_pairs,
    get_pos_emb_on_this_cp_rank,
    yarn_get_mscale,
)
from megatron.core.transformer.spec_utils import IdentityOp, ModuleSpec, build_module
from megatron.core.utils import divide


@dataclass
class MLASelfAttentionSubmodules:
    """megatron-core's submodules of ``MLASelfAttention`` (None: this library's default class)."""

    linear_q_proj: Union[ModuleSpec, type] = None
    linear_q_down_proj: Union[ModuleSpec, type] = None
    linear_q_up_proj: Union[ModuleSpec, type] = None
    linear_kv_down_proj: Union[ModuleSpec, type] = None
    linear_kv_up_proj: Union[ModuleSpec, type] = None
    core_attention: Union[ModuleSpec, type] = None
    linear_proj: Union[ModuleSpec, type] = None
    q_layernorm: Union[ModuleSpec, type] = None
    kv_layernorm: Union[ModuleSpec, type] = None


def mla_softmax_scale(config) -> float:
    """``g(s, mscale_all_dim)^2 / sqrt(d_n + d_r)`` (module docstring)."""
    mscale = yarn_get_mscale(config.rotary_scaling_factor, config.mscale_all_dim)
    return mscale * mscale / math.sqrt(config.qk_head_dim + config.qk_pos_emb_head_dim)


def mla_rotary_embedding(config) -> RotaryEmbedding:
    """The rotary embedding of dimension ``d_r`` that multi-latent attention owns (YaRN unless ``rope_type='rope'``)."""
    if config.rope_type == "rope":
        return RotaryEmbedding(config.qk_pos_emb_head_dim, config.rotary_percent, rotary_base=config.rotary_base)
    return YarnRotaryEmbedding(config.qk_pos_emb_head_dim, rotary_base=config.rotary_base,
                               scaling_factor=config.rotary_scaling_factor,
                               original_max_position_embeddings=config.original_max_position_embeddings,
                               beta_fast=config.beta_fast, beta_slow=config.beta_slow, mscale=config.mscale,
                               mscale_all_dim=config.mscale_all_dim, correction_range_round_to_int=True)


def _build(spec, default, *args, **kwargs):
    return build_module(spec if spec is not None else default, *args, **kwargs)


class MLASelfAttention(MegatronModule):
    """``MLASelfAttention(config, submodules, layer_number=1, attn_mask_type=causal, cp_comm_type=None)``;
    ``forward(hidden_states [s, b, h], attention_mask, key_value_states=None, inference_params=None,
    rotary_pos_emb=None, packed_seq_params=None) -> (output [s, b, h], bias)``. ``config`` is an
    :class:`~megatron.core.transformer.transformer_config.MLATransformerConfig`; ``rotary_pos_emb`` is ignored (the
    layer owns its ``d_r``-dimensional rotary embedding)."""

    def __init__(self, config, submodules: MLASelfAttentionSubmodules = None, layer_number: int = 1,
                 attn_mask_type=AttnMaskType.causal, cp_comm_type=None, pg_collection=None):
        super().__init__(config=config)
        # megatron-core's pg_collection: its TP group splits the heads (and carries the linear layers' and the
        # sequence-parallel collectives), its CP group picks this rank's rotary angles and runs the attention ring;
        # None = parallel_state's.
        self.pg_collection = pg_collection
        self.tp_group = group_of(pg_collection, "tp")
        if not getattr(config, "multi_latent_attention", False):
            raise ValueError("MLASelfAttention needs an MLATransformerConfig (--multi-latent-attention)")
        sub = submodules if submodules is not None else MLASelfAttentionSubmodules()
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        tp = pg_size(pg_collection, "tp")
        n = config.num_attention_heads
        self.num_heads_per_partition = divide(n, tp)
        self.d_n, self.d_r, self.d_v = config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim
        self.d_q = self.d_n + self.d_r
        h, init = config.hidden_size, config.init_method
        groups = {} if self.tp_group is None else {"tp_group": self.tp_group}
        column = dict(config=config, init_method=init, bias=False, gather_output=False, **groups)
        duplicated = dict(config=config, init_method=init, bias=False, **groups)
        norm = config.qk_layernorm
        self.q_lora_rank = config.q_lora_rank
        if self.q_lora_rank is None:
            self.linear_q_proj = _build(sub.linear_q_proj, tensor_parallel.ColumnParallelLinear, h, n * self.d_q,
                                        **column)
        else:
            self.linear_q_down_proj = _build(sub.linear_q_down_proj, tensor_parallel.DuplicatedLinear, h,
                                             self.q_lora_rank, **duplicated)
            self.q_layernorm = self._latent_norm(sub.q_layernorm, self.q_lora_rank) if norm else None
            self.linear_q_up_proj = _build(sub.linear_q_up_proj, tensor_parallel.ColumnParallelLinear,
                                           self.q_lora_rank, n * self.d_q, **column)
        self.linear_kv_down_proj = _build(sub.linear_kv_down_proj, tensor_parallel.DuplicatedLinear, h,
                                          config.kv_lora_rank + self.d_r, **duplicated)
        self.kv_layernorm = self._latent_norm(sub.kv_layernorm, config.kv_lora_rank) if norm else None
        self.linear_kv_up_proj = _build(sub.linear_kv_up_proj, tensor_parallel.ColumnParallelLinear,
                                        config.kv_lora_rank, n * (self.d_n + self.d_v), **column)
        self.softmax_scale = mla_softmax_scale(config)
        self.core_attention = _build(sub.core_attention, DotProductAttention, config=config,
                                     layer_number=self.layer_number, attn_mask_type=attn_mask_type,
                                     attention_type="self", softmax_scale=self.softmax_scale, k_channels=self.d_q, v_channels=self.d_v,
                                     cp_comm_type=cp_comm_type,
                                     **({} if pg_collection is None else {"pg_collection": pg_collection}))
        self.linear_proj = _build(sub.linear_proj, tensor_parallel.RowParallelLinear, n * self.d_v, h, config=config,
                                  init_method=config.output_layer_init_method, bias=config.add_bias_linear,
                                  input_is_parallel=True, skip_bias_add=True, **groups)
        self.rotary_pos_emb = mla_rotary_embedding(config)
        self.recompute_up_proj = config.recomputes("mla_up_proj")
        self.recompute_core_attention = config.recomputes("core_attn")

    def _latent_norm(self, spec, size):
        """A latent norm (built only with ``config.qk_layernorm``; a spec may name its class)."""
        if spec is None or spec is IdentityOp:
            from megatron.core.transformer.norms import get_norm

            return get_norm(self.config, hidden_size=size)
        return build_module(spec, config=self.config, hidden_size=size, eps=self.config.layernorm_epsilon)

    # ------------------------------------------------------------------------------------------ pieces
    def _rotary(self, seq_len: int, inference_params):
        """(angles of this rank's positions ``[s, 1, 1, d_r]``, concentration)."""
        cp = pg_size(self.pg_collection, "cp")
        if inference_params is not None:
            start = inference_params.sequence_len_offset
            emb = self.rotary_pos_emb(start + seq_len)
        else:
            start = 0
            emb = self.rotary_pos_emb(seq_len * cp)
        emb, mscale = emb if isinstance(emb, tuple) else (emb, 1.0)
        if inference_params is None and cp > 1:
            emb = get_pos_emb_on_this_cp_rank(emb, seq_dim=0, cp_size=cp, cp_rank=pg_rank(self.pg_collection, "cp"))
        return emb[start:start + seq_len], mscale

    def _packed_rotary(self, packed_seq_params):
        """Packed (thd) batch: (angles of each document's positions from 0, this rank's chunks of each under
        context parallelism, ``[t, 1, 1, d_r]``; concentration)."""
        emb = self.rotary_pos_emb(packed_max_seqlen(packed_seq_params))
        emb, mscale = emb if isinstance(emb, tuple) else (emb, 1.0)
        rows, _ = packed_rotary_rows(self.core_attention, packed_seq_params, emb, emb)
        return rows, mscale

    def _up_projections(self, q_latent, kv_latent, k_r, freqs, mscale):
        """Latents -> ``(Q [s, b, n/t, d_q], K [s, b, n/t, d_q], V [s, b, n/t, d_v])`` (norms, up projections, RoPE)."""
        if self.q_lora_rank is None:
            q = q_latent
        else:
            if self.q_layernorm is not None:
                q_latent = self.q_layernorm(q_latent)
            q, _ = self.linear_q_up_proj(q_latent)
        if self.kv_layernorm is not None:
            kv_latent = self.kv_layernorm(kv_latent)
        kv, _ = self.linear_kv_up_proj(kv_latent)
        s, b = q.shape[0], q.shape[1]
        q = q.view(s, b, self.num_heads_per_partition, self.d_q)
        q_n, q_r = torch.split(q, [self.d_n, self.d_r], dim=-1)
        kv = kv.view(s, b, self.num_heads_per_partition, self.d_n + self.d_v)
        k_n, v = torch.split(kv, [self.d_n, self.d_v], dim=-1)
        fused = self.config.apply_rope_fusion
        q_r = apply_rotary_pos_emb(deinterleave_rotary_pairs(q_r), freqs, fused=fused, mscale=mscale)
        k_r = apply_rotary_pos_emb(deinterleave_rotary_pairs(k_r.view(s, b, 1, self.d_r)), freqs, fused=fused, mscale=mscale)
        query = torch.cat([q_n, q_r], dim=-1)
        key = torch.cat([k_n, k_r.expand(-1, -1, self.num_heads_per_partition, -1)], dim=-1)
        return query, key, v.contiguous()

    def _cache(self, inference_params, key, value):
        """Write this step's keys and values into the inference cache; all cached keys and values so far."""
        memory = inference_params.key_value_memory_dict
        if self.layer_number not in memory:
            shape = (inference_params.max_sequence_length, inference_params.max_batch_size,
                     self.num_heads_per_partition)
            memory[self.layer_number] = (key.new_empty(shape + (self.d_q,)), value.new_empty(shape + (self.d_v,)))
        key_memory, value_memory = memory[self.layer_number]
        b0 = inference_params.batch_size_offset
        b1, s0 = b0 + key.size(1), inference_params.sequence_len_offset
        s1 = s0 + key.size(0)
        key_memory[s0:s1, b0:b1] = key
        value_memory[s0:s1, b0:b1] = value
        return key_memory[:s1, b0:b1], value_memory[:s1, b0:b1]

    # ------------------------------------------------------------------------------------------ forward
    def forward(self, hidden_states, attention_mask, key_value_states=None, inference_params=None,
                rotary_pos_emb=None, packed_seq_params=None):
        if packed_seq_params is not None and (packed_seq_params.qkv_format != "thd" or inference_params is not None
                                              or self.config.experimental_attention_variant == "dsa"):
            raise NotImplementedError("multi-latent attention supports packed sequences (packed_seq_params) in the "
                                      "'thd' format only, without inference_params or DeepSeek sparse attention")
        if self.q_lora_rank is None:
            q_latent, _ = self.linear_q_proj(hidden_states)
        else:
            q_latent, _ = self.linear_q_down_proj(hidden_states)
        kv_compressed, _ = self.linear_kv_down_proj(hidden_states)
        kv_latent, k_r = torch.split(kv_compressed, [self.config.kv_lora_rank, self.d_r], dim=-1)
        # k_r feeds every local head: all-gather it along the sequence under SP (its gradient is reduce-scattered),
        # else sum its gradient over the TP ranks, whose heads differ.
        if self.config.sequence_parallel and pg_size(self.pg_collection, "tp") > 1:
            k_r = tensor_parallel.gather_from_sequence_parallel_region(k_r, group=self.tp_group)
        else:
            k_r = tensor_parallel.copy_to_tensor_model_parallel_region(k_r, group=self.tp_group)
        freqs, mscale = (self._rotary(k_r.size(0), inference_params) if packed_seq_params is None
                         else self._packed_rotary(packed_seq_params))
        if self.recompute_up_proj and self.training and torch.is_grad_enabled():
            query, key, value = tensor_parallel.checkpoint(
                lambda q, kv, kr: self._up_projections(q, kv, kr, freqs, mscale), False, q_latent, kv_latent, k_r)
        else:
            query, key, value = self._up_projections(q_latent, kv_latent, k_r, freqs, mscale)
        if inference_params is not None:
            key, value = self._cache(inference_params, key, value)
        if self.config.experimental_attention_variant == "dsa":
            # DeepSeek sparse attention's indexer reads the hidden states and the query latent (before its norm).
            qr = hidden_states if self.q_lora_rank is None else q_latent
            context = self.core_attention(query, key, value, attention_mask, x=hidden_states, qr=qr,
                                          attn_mask_type=self.attn_mask_type)
        elif self.recompute_core_attention and self.training and torch.is_grad_enabled():
            packed = {} if packed_seq_params is None else {"packed_seq_params": packed_seq_params}
            context = tensor_parallel.checkpoint(lambda q, k, v: self.core_attention(q, k, v, attention_mask, **packed),
                                                 False, query, key, value)
        elif packed_seq_params is not None:
            context = self.core_attention(query, key, value, attention_mask, packed_seq_params=packed_seq_params)
        else:
            context = self.core_attention(query, key, value, attention_mask)
        return self.linear_proj(context)


# megatron-core's name of the multi-latent attention class (megatron-core's MLASelfAttention derives from it; here
# the self-attention form is the only one and is the class itself).
MultiLatentAttention = MLASelfAttention
