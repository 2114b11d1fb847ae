"""Core attention: softmax(Q K^T / sqrt(d) + mask) V for the heads of this tensor-parallel rank.

``CoreAttention`` (Megatron's legacy class; megatron-core calls it ``DotProductAttention``) has three
implementations of the same function, chosen per call and printed once:

* ``torch.nn.functional.scaled_dot_product_attention`` (SDPA: flash / memory-efficient kernels on GPU) for
  causal and boolean padding masks — ``config.attention_backend`` ``auto`` (the default), ``fused`` and
  ``flash`` (``--attention-backend``; Megatron's names for Transformer Engine's cuDNN / flash-attn kernels);
* the explicit path of Megatron (``baddbmm`` into a reused buffer, scale-mask-softmax, dropout, ``bmm``)
  for ``unfused`` and ``local``, or masks that are not boolean;
* ``flash-attn``'s kernel when ``--use-flash-attn`` is given (see :mod:`megatron.core.transformer.attention`);
* with context parallelism (``config.context_parallel_size > 1``) the pure-PyTorch ring / all-gather attention of
  :mod:`megatron.core.transformer.context_parallel` (``--cp-comm-type p2p`` or ``all_gather``), causal or no mask.

Packed sequences (megatron-core's ``PackedSeqParams`` with ``qkv_format='thd'``: several documents in one row,
bounded by ``cu_seqlens``) attend within each document only: ``softmax(Q_i K_i^T / sqrt(d) + causal) V_i`` per
document ``i``, which is what running each document alone gives; with context parallelism each document goes
through the ring attention in turn (a rank holds two chunks of every padded document). With
``qkv_format='sbhd'`` (hybrid context parallelism: one whole sample per row) the attention is the ordinary one, with
context parallelism over the sample's own ``packed_seq_params.cp_group`` (none for ``local_cp_size`` 1).

Masks are boolean with True = masked. Rows that are masked entirely (padding queries in BERT) get the
uniform average of the values in the explicit path (all scores equal -10000); the SDPA path reproduces
that instead of returning NaNs.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.enums import AttnBackend, AttnMaskType
from megatron.core.utils import log_once
from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax, attention_mask_func, causal_mask
from megatron.core.transformer.attention_variants import attention_with_sinks, window_mask
from megatron.core.process_groups_config import group_of
from megatron.core.transformer.module import MegatronModule
from megatron.core.device import init_device, param_device, weights_on_meta
from megatron.core.utils import context_parallel_chunk_indices, divide
from megatron.core.packed_seq_params import packed_layout_cu_seqlens
from megatron.core.transformer.rotary import packed_sequence_rotary_freqs

_CAUSAL_CHECK_CACHE = {}


def _is_plain_causal(mask: torch.Tensor, sq: int, sk: int) -> bool:
    """True if ``mask`` is the standard ``[1, 1, s, s]`` causal mask (cached per tensor version)."""
    if mask.dim() != 4 or mask.shape[0] != 1 or mask.shape[1] != 1 or sq != sk:
        return False
    key = (mask.data_ptr(), tuple(mask.shape), mask._version, mask.device)
    hit = _CAUSAL_CHECK_CACHE.get(key)
    if hit is None:
        hit = bool(torch.equal(mask[0, 0], causal_mask(sq, sk, mask.device)[0, 0]))
        _CAUSAL_CHECK_CACHE.clear()
        _CAUSAL_CHECK_CACHE[key] = hit
    return hit


def _log_sdpa_mode(is_causal: bool, keep, q: torch.Tensor) -> None:
    """Say once per mode which SDPA kernels the call can use: flash needs no materialised mask."""
    if keep is None:
        mode = "is_causal=True, no mask" if is_causal else "no mask"
        kernels = "flash / memory-efficient kernels eligible" if q.is_cuda else "CPU kernel"
    else:
        mode, kernels = "boolean mask", ("memory-efficient or math kernel (flash takes no mask)" if q.is_cuda
                                         else "CPU kernel")
    log_once(f"sdpa_mode:{mode}:{q.device.type}", f"attention SDPA call: {mode}, {q.dtype} on {q.device.type}: "
                                                  f"{kernels}")


def packed_rotary_rows(core_attention, packed_seq_params, q_pos_emb, k_pos_emb):
    """The query and key angles of a packed (thd) batch's rows: each document's positions from 0, this rank's chunks
    of each under the context parallelism ``core_attention`` splits the batch over (its ``packed_cp_group``)."""
    cu_q, cu_kv = packed_layout_cu_seqlens(packed_seq_params)
    cp_size, cp_rank = 1, 0
    if hasattr(core_attention, "packed_cp_group"):
        _, cp_size, cp_rank = core_attention.packed_cp_group(packed_seq_params)
    return (packed_sequence_rotary_freqs(q_pos_emb, cu_q, cp_size, cp_rank),
            packed_sequence_rotary_freqs(k_pos_emb, cu_kv, cp_size, cp_rank))


class CoreAttention(MegatronModule):
    """``CoreAttention(layer_number, config, attn_mask_type)``; ``forward(q, k, v, mask) -> [sq, b, hp]``.

    Inputs are ``[s, b, heads, hn]``; keys and values with fewer heads than the queries (grouped-query
    attention) are repeated to match.
    """

    def __init__(self, layer_number, config, attn_mask_type=AttnMaskType.padding, attention_dropout=None,
                 softmax_scale=None, k_channels=None, v_channels=None, *, tp_group=None, cp_group=None):
        super().__init__(config=config)
        self.tp_group = tp_group  # splits the heads; None = parallel_state's TP group
        self.cp_group = cp_group  # the ring of context parallelism; None = parallel_state's CP group
        self.fp16 = config.fp16
        self.bf16 = config.bf16
        self.apply_query_key_layer_scaling = config.apply_query_key_layer_scaling
        self.attention_softmax_in_fp32 = config.attention_softmax_in_fp32 or self.apply_query_key_layer_scaling
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.sequence_parallel = config.sequence_parallel
        self.backend = config.attention_backend
        self.explicit_only = self.backend in (AttnBackend.unfused, AttnBackend.local)
        log_once(f"attention_backend:{self.backend.name}",
                 f"--attention-backend {self.backend.name}: " + (
                     "explicit baddbmm + masked softmax" if self.explicit_only else
                     "torch SDPA (flash / memory-efficient kernels eligible on CUDA) where the mask allows, "
                     "explicit masked softmax otherwise"))

        # Query/key and value head sizes (multi-latent attention: k_channels = d_n + d_r, v_channels = d_v).
        k_channels = k_channels if k_channels is not None else config.kv_channels
        v_channels = v_channels if v_channels is not None else config.kv_channels
        world_size, self._tp_rank = tensor_parallel.tp_size_and_rank(tp_group)
        self.hidden_size_per_partition = divide(v_channels * config.num_attention_heads, world_size)
        self.hidden_size_per_attention_head = k_channels
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, world_size)
        # The scores are q.k * softmax_scale (default 1/sqrt(k_channels)).
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(k_channels)

        # Query-key layer scaling divides the scores by the layer number in the (fp16) GEMM and multiplies
        # them back in the fp32 softmax, which keeps deep fp16 models from overflowing.
        coeff = None
        self.norm_factor = math.sqrt(k_channels) if softmax_scale is None else 1.0 / softmax_scale
        if self.apply_query_key_layer_scaling:
            coeff = self.layer_number
            self.norm_factor *= coeff
        self.scale_mask_softmax = FusedScaleMaskSoftmax(
            self.fp16, self.bf16, self.attn_mask_type, config.masked_softmax_fusion, attention_mask_func,
            self.attention_softmax_in_fp32, coeff)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.attention_dropout = torch.nn.Dropout(dropout)

        self._init_attention_variants(config, world_size)
        self.cp_size = config.context_parallel_size
        comm = config.cp_comm_type if config.cp_comm_type is not None else "p2p"
        self.cp_comm_type = comm if isinstance(comm, str) else comm[self.layer_number - 1]
        if self.cp_size > 1:
            log_once(f"attention_cp:{self.cp_comm_type}",
                     f"attention: context parallel over {self.cp_size} ranks, --cp-comm-type {self.cp_comm_type}, "
                     "pure PyTorch (megatron.core.transformer.context_parallel; Transformer Engine not used)")

    def _init_attention_variants(self, config, world_size: int) -> None:
        """Attention sinks and the sliding window of this layer (:mod:`.attention_variants`)."""
        self.softmax_type = config.softmax_type
        self.window = config.window_size if config.is_window_attention_layer(self.layer_number) else None
        if self.softmax_type == "learnable":
            self.softmax_offset = torch.nn.Parameter(torch.empty(self.num_attention_heads_per_partition,
                                                                 dtype=config.params_dtype, device=param_device(config)))
            tensor_parallel.set_tensor_model_parallel_attributes(self.softmax_offset, True, 0, 1)
            self.reset_parameters()
        elif self.softmax_type == "off-by-one":
            self.register_buffer("softmax_offset", torch.zeros(self.num_attention_heads_per_partition,
                                                               device=init_device(config)), persistent=False)
        else:
            self.softmax_offset = None
        if config.context_parallel_size > 1 and (self.window is not None or self.softmax_offset is not None):
            raise ValueError(f"context parallelism (--context-parallel-size {config.context_parallel_size}) with "
                             f"{'--window-size' if self.window is not None else '--softmax-type ' + self.softmax_type}"
                             " is not implemented: the ring attention has no window or sink")

    def reset_parameters(self):
        """The learnable sink logits: one per head, the full [heads] vector from the global generator (the same on
        every TP rank), then this rank's heads, so every TP size starts from the same model."""
        if not isinstance(self.softmax_offset, torch.nn.Parameter) or weights_on_meta(self):
            return
        config = self.config
        full = torch.zeros(config.num_attention_heads, dtype=torch.float32)
        if config.perform_initialization:
            config.init_method(full)
        world_size = config.num_attention_heads // self.num_attention_heads_per_partition
        rank = self._tp_rank if world_size > 1 else 0
        with torch.no_grad():
            self.softmax_offset.copy_(full.chunk(world_size)[rank])

    # ------------------------------------------------------------------------------------------- dispatch
    def _dropout_rng(self):
        # Attention heads are split across TP ranks, so their dropout must differ per rank: draw from the
        # TP-specific tracker state (with sequence parallelism the whole layer already runs inside it).
        if self.sequence_parallel:
            return contextlib.nullcontext()
        return tensor_parallel.get_cuda_rng_tracker().fork()

    def use_sdpa(self, attention_mask) -> bool:
        if self.explicit_only:
            return False
        return attention_mask is None or attention_mask.dtype == torch.bool

    def _context_parallel_forward(self, query_layer, key_layer, value_layer, attention_mask, group=None):
        """Attention over the context-parallel ``group`` (default: this layer's CP group, which must have
        ``config.context_parallel_size`` ranks; hybrid CP passes each sample's own group)."""
        from megatron.core.transformer.context_parallel import context_parallel_attention

        own = group is None
        if own:
            group = self.cp_group if self.cp_group is not None else parallel_state.get_context_parallel_group()
        if own and torch.distributed.get_world_size(group=group) != self.cp_size:
            raise RuntimeError(f"config.context_parallel_size is {self.cp_size} but the context-parallel group has "
                               f"{torch.distributed.get_world_size(group=group)} ranks: pass the same size to "
                               "initialize_model_parallel(context_parallel_size=...) or in pg_collection.cp")
        causal = self.attn_mask_type == AttnMaskType.causal
        if attention_mask is not None and not causal:
            raise NotImplementedError("context parallelism supports causal attention or no mask, not an explicit "
                                      "attention mask")
        # A causal layer ignores a passed mask: with CP the causal structure is per chunk pair (see the module).
        dropout_p = self.attention_dropout.p if self.training else 0.0
        return context_parallel_attention(
            query_layer, key_layer, value_layer, group=group,
            global_ranks=torch.distributed.get_process_group_ranks(group), comm_type=self.cp_comm_type,
            causal=causal, softmax_scale=self.softmax_scale,
            dropout=self.attention_dropout if dropout_p > 0.0 else None,
            dropout_rng=self._dropout_rng() if dropout_p > 0.0 else None)

    def forward(self, query_layer, key_layer, value_layer, attention_mask, packed_seq_params=None):
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            return self._packed_forward(query_layer, key_layer, value_layer, packed_seq_params)
        if packed_seq_params is not None:
            return self._per_sample_cp_forward(query_layer, key_layer, value_layer, attention_mask,
                                               packed_seq_params)
        if self.cp_size > 1:
            return self._context_parallel_forward(query_layer, key_layer, value_layer, attention_mask)
        return self._local_forward(query_layer, key_layer, value_layer, attention_mask)

    # -------------------------------------------------------------------------------- packed sequences
    def _per_sample_cp_forward(self, query_layer, key_layer, value_layer, attention_mask, packed_seq_params):
        """``sbhd`` packed params (hybrid context parallelism: one whole sample per batch row, ``cu_seqlens``
        ``[0, S, 2S, ...]``): the ordinary attention, with context parallelism over the sample's own group
        ``packed_seq_params.cp_group`` (none when it is None or has one rank, e.g. ``local_cp_size`` 1), in place
        of the layer's CP group (megatron-core's dynamic CP group)."""
        p = packed_seq_params
        if p.qkv_format != "sbhd":
            raise NotImplementedError(f"packed_seq_params.qkv_format={p.qkv_format!r}: the local attention "
                                      "supports packed sequences in the 'thd' and 'sbhd' formats only")
        for cu in (p.cu_seqlens_q, p.cu_seqlens_kv, p.cu_seqlens_q_padded, p.cu_seqlens_kv_padded):
            if cu is not None and cu.numel() > 2 and len(set((cu[1:] - cu[:-1]).tolist())) > 1:
                raise NotImplementedError("packed_seq_params in the 'sbhd' format with sequences of different "
                                          "lengths (padding) are not supported: pack them in the 'thd' format")
        group = p.cp_group
        if group is None and p.local_cp_size not in (None, 1):
            raise ValueError(f"packed_seq_params.local_cp_size={p.local_cp_size} needs its cp_group")
        if group is None and p.local_cp_size is None:
            return self.forward(query_layer, key_layer, value_layer, attention_mask)  # the layer's own CP
        if group is None or torch.distributed.get_world_size(group=group) == 1:
            return self._local_forward(query_layer, key_layer, value_layer, attention_mask)
        if self.window is not None or self.softmax_offset is not None:
            raise NotImplementedError("hybrid context parallelism with a sliding window or attention sinks is not "
                                      "implemented: the ring attention has no window or sink")
        return self._context_parallel_forward(query_layer, key_layer, value_layer, attention_mask, group=group)

    def packed_cp_group(self, packed_seq_params):
        """``(group, size, rank)`` of the context parallelism a packed batch is split over: its own ``cp_group``;
        none (``(None, 1, 0)``) for ``local_cp_size`` 1; else this layer's CP group when
        ``context_parallel_size > 1``."""
        group = packed_seq_params.cp_group
        if group is None and (packed_seq_params.local_cp_size == 1 or self.cp_size == 1):
            return None, 1, 0
        if group is None:
            group = self.cp_group if self.cp_group is not None else parallel_state.get_context_parallel_group()
        return group, torch.distributed.get_world_size(group=group), torch.distributed.get_rank(group=group)

    def _packed_forward(self, query_layer, key_layer, value_layer, packed_seq_params):
        """Packed sequences (THD): document ``i`` holds the rows ``start_i .. start_i + L_i`` of the packed tensors
        (``start`` from ``cu_seqlens_*_padded`` when given, else ``cu_seqlens_*``; ``L_i`` from ``cu_seqlens_*``),
        and attends to its own keys only, causally for a causal layer: each document goes through this layer's
        attention alone, with no mask (as Transformer Engine's ``thd`` kernels, ``attention_mask`` is not used).
        Rows past a document's real length (padding) give zeros. Inputs are ``[t, 1, np, hn]`` (output
        ``[t, 1, np * hv]``) or megatron-core's squeezed ``[t, np, hn]`` (output ``[t, np * hv]``).

        With context parallelism over ``CP`` ranks (:meth:`packed_cp_group`) a rank holds, per document in order,
        chunks ``r`` and ``2 CP - 1 - r`` of the padded document (``get_thd_batch_on_this_cp_rank``): each document
        runs through the ring attention over the group, one after the other (the same order on every rank)."""
        if packed_seq_params.qkv_format != "thd":
            raise NotImplementedError(f"packed_seq_params.qkv_format={packed_seq_params.qkv_format!r}: the local "
                                      "attention supports packed sequences in the 'thd' format only")
        squeezed = query_layer.dim() == 3
        if squeezed:
            query_layer, key_layer, value_layer = (x.unsqueeze(1) for x in (query_layer, key_layer, value_layer))
        if query_layer.size(1) != 1:
            raise ValueError(f"packed sequences (thd): the batch dimension must be 1, got {query_layer.size(1)}")
        p = packed_seq_params
        cu_q = p.cu_seqlens_q
        cu_kv = p.cu_seqlens_kv if p.cu_seqlens_kv is not None else cu_q
        if cu_q is None:
            raise ValueError("packed sequences (thd): packed_seq_params.cu_seqlens_q is required")
        pad_q, pad_kv = packed_layout_cu_seqlens(p)
        cu_q, cu_kv, pad_q, pad_kv = ([int(x) for x in c.tolist()] for c in (cu_q, cu_kv, pad_q, pad_kv))
        group, cp, cp_rank = self.packed_cp_group(p)
        total = query_layer.size(0)
        if not (len(cu_q) == len(cu_kv) == len(pad_q) == len(pad_kv)) or pad_q[-1] > total * cp or \
                pad_kv[-1] > key_layer.size(0) * cp:
            raise ValueError(f"packed sequences (thd): cu_seqlens describe {pad_q[-1]} query / {pad_kv[-1]} key rows "
                             f"but the tensors have {total} / {key_layer.size(0)} (x {cp} context-parallel ranks), or "
                             "their lengths differ")
        if cp > 1:
            out = self._packed_cp_forward(query_layer, key_layer, value_layer, cu_q, cu_kv, pad_q, pad_kv, group, cp,
                                          cp_rank)
            return out.squeeze(1) if squeezed else out
        log_once("attention_packed", "attention: packed sequences (thd), each document attended alone")
        pieces, row = [], 0
        width = self.hidden_size_per_partition
        for i in range(len(cu_q) - 1):
            start, length = pad_q[i], cu_q[i + 1] - cu_q[i]
            k_start, k_length = pad_kv[i], cu_kv[i + 1] - cu_kv[i]
            if start > row:
                pieces.append(query_layer.new_zeros(start - row, 1, width))
            if length > 0:
                pieces.append(self._local_forward(query_layer[start:start + length],
                                                  key_layer[k_start:k_start + k_length],
                                                  value_layer[k_start:k_start + k_length], None))
            row = start + length
        if total > row:
            pieces.append(query_layer.new_zeros(total - row, 1, width))
        out = torch.cat(pieces, dim=0)
        return out.squeeze(1) if squeezed else out

    def _packed_cp_forward(self, query_layer, key_layer, value_layer, cu_q, cu_kv, pad_q, pad_kv, group, cp,
                           cp_rank):
        """:meth:`_packed_forward` with context parallelism: the ring attention per padded document; rows of
        padding (past the real length, at the document's end) give zeros. Keys past the real length are never seen
        by a real query of a causal layer; a non-causal layer with padding is refused."""
        causal = self.attn_mask_type == AttnMaskType.causal
        if cu_q != cu_kv or pad_q != pad_kv:
            raise NotImplementedError("packed sequences with context parallelism: queries and keys must share "
                                      "their cu_seqlens (self attention)")
        if not causal and cu_q != pad_q:
            raise NotImplementedError("packed sequences with context parallelism and padding "
                                      "(cu_seqlens_*_padded) need a causal attention layer")
        if self.window is not None or self.softmax_offset is not None:
            raise NotImplementedError("packed sequences with context parallelism and a sliding window or attention "
                                      "sinks are not implemented: the ring attention has no window or sink")
        log_once("attention_packed_cp", f"attention: packed sequences (thd) over {cp} context-parallel ranks, "
                                        "the ring attention per document")
        pieces, row = [], 0
        for i in range(len(cu_q) - 1):
            padded, real = pad_q[i + 1] - pad_q[i], cu_q[i + 1] - cu_q[i]
            local = padded // cp
            if local == 0:
                continue
            rows = slice(row, row + local)
            out = self._context_parallel_forward(query_layer[rows], key_layer[rows], value_layer[rows], None,
                                                 group=group)
            if real < padded:
                keep = context_parallel_chunk_indices(padded, cp, cp_rank).to(out.device) < real
                out = out * keep.view(-1, 1, 1).to(out.dtype)
            pieces.append(out)
            row += local
        if query_layer.size(0) > row:
            pieces.append(query_layer.new_zeros(query_layer.size(0) - row, 1, self.hidden_size_per_partition))
        return torch.cat(pieces, dim=0)

    def _local_forward(self, query_layer, key_layer, value_layer, attention_mask):
        """Attention of one rank's whole sequence (no context parallelism)."""
        groups = query_layer.size(2) // key_layer.size(2)
        if groups > 1:
            key_layer = key_layer.repeat_interleave(groups, dim=2)
            value_layer = value_layer.repeat_interleave(groups, dim=2)
        if self.window is not None or self.softmax_offset is not None:
            return self._variant_forward(query_layer, key_layer, value_layer, attention_mask)
        if self.use_sdpa(attention_mask):
            log_once("attention_sdpa", "attention: torch.nn.functional.scaled_dot_product_attention (SDPA)")
            return self._sdpa_forward(query_layer, key_layer, value_layer, attention_mask)
        log_once("attention_unfused", "attention: explicit masked softmax (unfused)")
        return self._explicit_forward(query_layer, key_layer, value_layer, attention_mask)

    # ------------------------------------------------------------------------------- window and sinks
    def _variant_mask(self, attention_mask, sq: int, sk: int, device):
        """Boolean mask (True = hidden) of the causal structure, the given mask and this layer's window."""
        hidden = None
        if self.attn_mask_type == AttnMaskType.causal:
            hidden = causal_mask(sq, sk, device)[0, 0]
        if attention_mask is not None:
            given = attention_mask.bool()
            hidden = given if hidden is None else hidden | given
        if self.window is not None:
            window = window_mask(sq, sk, self.window, device)
            hidden = window if hidden is None else hidden | window
        return hidden

    def _variant_forward(self, query_layer, key_layer, value_layer, attention_mask):
        """Sliding window (SDPA with the band mask, or the explicit path) and/or attention sinks (explicit softmax
        with the sink column, attention_variants.attention_with_sinks)."""
        sq, b, np_, hn = query_layer.shape
        sk = key_layer.size(0)
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query_layer, key_layer, value_layer))
        hidden = self._variant_mask(attention_mask, sq, sk, q.device)
        dropout_p = self.attention_dropout.p if self.training else 0.0
        rng = self._dropout_rng() if dropout_p > 0.0 else contextlib.nullcontext()
        if self.softmax_offset is not None:
            log_once(f"attention_sinks:{self.softmax_type}", f"attention: --softmax-type {self.softmax_type} sinks, "
                     "explicit softmax with a sink column (attention_variants.attention_with_sinks)"
                     + (f", sliding window {self.window}" if self.window is not None else ""))
            with rng:
                out = attention_with_sinks(q, k, v, hidden, self.softmax_offset, self.attention_dropout)
        else:
            log_once("attention_window", f"attention: sliding window {self.window} as a boolean mask, torch SDPA")
            with rng:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=~hidden, dropout_p=dropout_p,
                                                     scale=1.0 / math.sqrt(hn))
        return out.permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)

    # ----------------------------------------------------------------------------------- explicit path
    def _explicit_forward(self, query_layer, key_layer, value_layer, attention_mask):
        sq, b, np_, hn = query_layer.shape
        sk = key_layer.size(0)
        output_size = (b, np_, sq, sk)
        query_layer = query_layer.reshape(sq, b * np_, hn)
        key_layer = key_layer.reshape(sk, b * np_, hn)
        matmul_input_buffer = parallel_state.get_global_memory_buffer().get_tensor(
            (b * np_, sq, sk), query_layer.dtype, "mpu")
        if matmul_input_buffer.device != query_layer.device:
            matmul_input_buffer = torch.empty((b * np_, sq, sk), dtype=query_layer.dtype, device=query_layer.device)
        matmul_result = torch.baddbmm(
            matmul_input_buffer, query_layer.transpose(0, 1), key_layer.transpose(0, 1).transpose(1, 2),
            beta=0.0, alpha=(1.0 / self.norm_factor))
        attention_scores = matmul_result.view(*output_size)

        attention_probs = self.scale_mask_softmax(attention_scores, attention_mask)
        with self._dropout_rng():
            attention_probs = self.attention_dropout(attention_probs)

        hv = value_layer.size(-1)
        value_layer = value_layer.reshape(sk, b * np_, hv)
        attention_probs = attention_probs.view(b * np_, sq, sk)
        context_layer = torch.bmm(attention_probs, value_layer.transpose(0, 1))
        context_layer = context_layer.view(b, np_, sq, hv).permute(2, 0, 1, 3).contiguous()
        return context_layer.view(sq, b, np_ * hv)

    # --------------------------------------------------------------------------------------- SDPA path
    def _sdpa_forward(self, query_layer, key_layer, value_layer, attention_mask):
        sq, b, np_, hn = query_layer.shape
        sk = key_layer.size(0)
        q = query_layer.permute(1, 2, 0, 3)
        k = key_layer.permute(1, 2, 0, 3)
        v = value_layer.permute(1, 2, 0, 3)

        is_causal, keep, fully_masked = False, None, None
        if attention_mask is None:
            if self.attn_mask_type == AttnMaskType.causal:
                if sq == sk:
                    is_causal = True
                else:
                    keep = ~causal_mask(sq, sk, q.device)
        elif self.attn_mask_type == AttnMaskType.causal and _is_plain_causal(attention_mask, sq, sk):
            is_causal = True
        else:
            # SDPA's boolean mask means "may attend". Fully masked rows would give NaN: let them attend to
            # every key and replace their output below by the mean of the values, as the explicit path gives.
            fully_masked = attention_mask.all(dim=-1, keepdim=True)
            keep = (~attention_mask) | fully_masked

        _log_sdpa_mode(is_causal, keep, q)
        dropout_p = self.attention_dropout.p if self.training else 0.0
        rng = self._dropout_rng() if dropout_p > 0.0 else contextlib.nullcontext()
        with rng:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=dropout_p, is_causal=is_causal,
                                                 scale=self.softmax_scale)
        if fully_masked is not None:
            out = torch.where(fully_masked, v.mean(dim=-2, keepdim=True).to(out.dtype), out)
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)


class DotProductAttention(CoreAttention):
    """megatron-core's name and signature: ``DotProductAttention(config, layer_number, attn_mask_type, attention_type,
    attention_dropout, softmax_scale, ...)``; ``k_channels`` / ``v_channels`` (Transformer Engine's, used by
    multi-latent attention) give query/key and value head sizes that differ from ``kv_channels``."""

    def __init__(self, config, layer_number: int = 1, attn_mask_type=AttnMaskType.padding, attention_type=None,
                 attention_dropout=None, softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type=None,
                 pg_collection=None):
        super().__init__(layer_number, config, attn_mask_type, attention_dropout=attention_dropout,
                         softmax_scale=softmax_scale, k_channels=k_channels, v_channels=v_channels,
                         tp_group=group_of(pg_collection, "tp"), cp_group=group_of(pg_collection, "cp"))
        self.pg_collection = pg_collection
        if cp_comm_type is not None:  # this layer's --cp-comm-type (megatron-core passes it per layer)
            self.cp_comm_type = cp_comm_type

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, packed_seq_params=None):
        return super().forward(query, key, value, attention_mask, packed_seq_params=packed_seq_params)
