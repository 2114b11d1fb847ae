"""DeepSeek sparse attention (DSA, DeepSeek-V3.2): megatron-core's ``DSAttention``, the core attention of multi-latent
attention when ``config.experimental_attention_variant == "dsa"``.

A lightning indexer scores every (query t, key s) pair cheaply and each query attends only to its ``k`` best keys.
Indexer (``H_I = dsa_indexer_n_heads`` heads of width ``d_I = dsa_indexer_head_dim``, the last ``d_r =
qk_pos_emb_head_dim`` channels rotary, one key head shared by the indexer heads):

    q_{t,j} = RoPE(W^{qb}_j c_t)                 c_t = MLA's query latent (``q_lora_rank`` wide; the hidden state
                                                 when queries are not compressed)
    k_s     = RoPE(LayerNorm(W^{k} h_s))
    w_{t,j} = (W^{w} h_t)_j / sqrt(H_I) / sqrt(d_I)
    I_{t,s} = sum_j w_{t,j} ReLU(Had(q_{t,j}) . Had(k_s)) + mask_{t,s}      (mask: 0 / -inf, causal)
    S_t     = top-k_s I_{t,s}                    (k = min(dsa_indexer_topk, sequence length))

``Had`` is the orthonormal Walsh-Hadamard rotation ``x H / sqrt(n)`` (Sylvester order, zero-padded to a power of 2
and cut back, as the ``fast_hadamard_transform`` kernel does). RoPE uses MLA's pair layout and MLA's rotary
embedding (YaRN with its concentration ``mscale``, or plain RoPE).

Sparse attention: ``softmax_s(q_t . k_s * scale + causal_{t,s} + [s not in S_t] * -inf) v_s`` per head.

Indexer loss (training only; the indexer's inputs are detached, so it alone trains the indexer): with
``A_t = normalise_s(sum_heads softmax_s(q_t . k_s * scale + causal [+ top-k mask]))`` (summed over every head of the
layer, i.e. all-reduced over tensor parallelism) and ``P_t = softmax_s(I_{t,s} [+ top-k mask])``,
``L = dsa_indexer_loss_coeff * mean_t KL(A_t || P_t)`` (``[+ top-k mask]`` with ``dsa_indexer_use_sparse_loss``).
``L`` rides on the attention output through :class:`DSAIndexerLossAutoScaler` (identity forward; backward sends
``main_loss_backward_scale``, 1 unless set, into ``L``) and is recorded per layer by
:class:`DSAIndexerLossLoggingHelper` when its coefficient is > 0.

Parallelism: the indexer sees the whole sequence on every tensor-parallel rank (under sequence parallelism its inputs
are all-gathered), so its duplicated weights get the same gradient everywhere and are not summed over the TP group;
context parallelism and packed sequences are refused (as in megatron-core). Unlike megatron-core's kernel path the
Hadamard rotation here runs in any floating dtype (fp32 on CPU), computed in fp32.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch

from megatron.core import parallel_state, tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection, group_of, pg_size
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_utils import loss_auto_scaler
from megatron.core.transformer.multi_latent_attention import mla_rotary_embedding
from megatron.core.transformer.norms import FusedLayerNorm
from megatron.core.transformer.rotary import apply_rotary_pos_emb, deinterleave_rotary_pairs
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

__all__ = ["rotate_activation", "DSAIndexerLossLoggingHelper", "compute_dsa_indexer_loss",
           "DSAIndexerLossAutoScaler", "DSAIndexerSubmodules", "DSAttentionSubmodules", "DSAIndexer",
           "unfused_dsa_fn", "DSAttention"]


def rotate_activation(x: torch.Tensor) -> torch.Tensor:
    """``x H_m[:n, :n'] / sqrt(n)`` over the last dim ``n`` (``H_m`` the Sylvester Hadamard matrix of the next power
    of two ``m >= n``; the input is zero-padded to ``m`` and the output cut back to ``n``); butterflies in fp32 (fp64
    for fp64 input)."""
    n = x.size(-1)
    m = 1 << max(0, (n - 1).bit_length())
    y = x.double() if x.dtype == torch.float64 else x.float()
    if m != n:
        y = torch.nn.functional.pad(y, (0, m - n))
    h = 1
    while h < m:
        y = y.reshape(*y.shape[:-1], m // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).reshape(*x.shape[:-1], m)
        h *= 2
    return (y[..., :n] * n ** -0.5).to(x.dtype)


class DSAIndexerLossLoggingHelper:
    """Per-layer indexer losses for logging (megatron-core's class API; class-level ``tracker`` dict with
    ``values [num_layers]``, ``reduce_group``, ``avg_group``)."""

    tracker = {}

    @staticmethod
    def save_loss_to_tracker(loss: torch.Tensor, layer_number: int, num_layers: int,
                             reduce_group: torch.distributed.ProcessGroup = None,
                             avg_group: torch.distributed.ProcessGroup = None):
        """Add ``loss`` (detached) to layer ``layer_number`` (1-based; None: not recorded)."""
        if layer_number is None:
            return
        tracker = DSAIndexerLossLoggingHelper.tracker
        if "values" not in tracker:
            tracker["values"] = torch.zeros(num_layers, device=loss.device)
        tracker["values"][layer_number - 1] += loss.detach().to(tracker["values"].device)
        tracker["reduce_group"] = reduce_group
        tracker["avg_group"] = avg_group

    @staticmethod
    def clean_loss_in_tracker():
        """Zero the recorded losses and forget the groups."""
        tracker = DSAIndexerLossLoggingHelper.tracker
        if "values" in tracker:
            tracker["values"].zero_()
        tracker["reduce_group"] = None
        tracker["avg_group"] = None

    @staticmethod
    def reduce_loss_in_tracker():
        """Sum over pipeline stages (each holds its own layers) and ``reduce_group``, average over ``avg_group`` and
        the data-parallel group (no collective when torch.distributed is not initialised)."""
        tracker = DSAIndexerLossLoggingHelper.tracker
        if "values" not in tracker or not torch.distributed.is_initialized():
            return
        values = tracker["values"]
        torch.distributed.all_reduce(values, group=parallel_state.get_pipeline_model_parallel_group())
        if tracker.get("reduce_group") is not None:
            torch.distributed.all_reduce(values, group=tracker["reduce_group"])
        for group in (tracker.get("avg_group"), parallel_state.get_data_parallel_group(with_context_parallel=False)):
            if group is not None:
                torch.distributed.all_reduce(values, group=group)
                values /= torch.distributed.get_world_size(group)

    @staticmethod
    def track_indexer_metrics(loss_scale: float, iteration: int, writer, wandb_writer=None, total_loss_dict=None,
                              per_layer_logging: bool = False):
        """Reduce, scale by ``loss_scale``, log the mean over layers as ``indexer loss`` (``total_loss_dict``,
        TensorBoard, W&B), then clear."""
        DSAIndexerLossLoggingHelper.reduce_loss_in_tracker()
        tracker = DSAIndexerLossLoggingHelper.tracker
        if "values" not in tracker:
            return
        values = tracker["values"] * loss_scale
        mean = values.sum() / values.shape[0]
        if total_loss_dict is not None:
            total_loss_dict["indexer loss"] = total_loss_dict.get("indexer loss", 0) + mean
        if writer is not None:
            writer.add_scalar("indexer loss", mean, iteration)
        if wandb_writer is not None:
            wandb_writer.log({"indexer loss": mean}, iteration)
        DSAIndexerLossLoggingHelper.clean_loss_in_tracker()


def _causal_mask(sq: int, sk: int, device) -> torch.Tensor:
    """``[sq, sk]``: 0 where key <= query, -inf above the diagonal."""
    return torch.triu(torch.full((sq, sk), float("-inf"), dtype=torch.float32, device=device), diagonal=1)


def _topk_mask(topk_indices: torch.Tensor, sk: int) -> torch.Tensor:
    """``[b, sq, sk]``: 0 at the selected keys, -inf elsewhere."""
    b, sq, _ = topk_indices.shape
    mask = torch.full((b, sq, sk), float("-inf"), dtype=torch.float32, device=topk_indices.device)
    return mask.scatter(-1, topk_indices, 0.0)


def _head_scores(query: torch.Tensor, key: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """``[sq, b, n, d] x [sk, b, n, d] -> [b, n, sq, sk]`` fp32 logits ``q . k * scale``."""
    return torch.einsum("sbnd,tbnd->bnst", query.float(), key.float()) * softmax_scale


def compute_dsa_indexer_loss(index_scores: torch.Tensor, topk_indices: torch.Tensor, query: torch.Tensor,
                             key: torch.Tensor, softmax_scale: float, loss_coeff: float, sparse_loss: bool,
                             pg_collection: ProcessGroupCollection) -> torch.Tensor:
    """``coeff * mean_t KL(A_t || P_t)`` (module docstring); ``index_scores [b, sq, sk]``, ``topk_indices
    [b, sq, k]``, ``query [sq, b, n, d]``, ``key [sk, b, n, d]`` (this rank's heads; the head sum is all-reduced
    over ``pg_collection.tp``)."""
    sq, sk = query.size(0), key.size(0)
    logits = _head_scores(query, key, softmax_scale) + _causal_mask(sq, sk, query.device)
    if sparse_loss:
        sparse = _topk_mask(topk_indices, sk)
        logits = logits + sparse.unsqueeze(1)
        index_scores = index_scores + sparse
    target = torch.softmax(logits, dim=-1).sum(dim=1)
    tp_group = group_of(pg_collection, "tp")
    if pg_size(pg_collection, "tp") > 1:
        torch.distributed.all_reduce(target, group=tp_group)
    target = target / target.sum(dim=-1, keepdim=True)
    predicted = torch.softmax(index_scores.float(), dim=-1)
    kl = target * (torch.log(target + 1e-10) - torch.log(predicted + 1e-10))
    return kl.sum(dim=-1).mean() * loss_coeff


DSAIndexerLossAutoScaler = loss_auto_scaler(
    "DSAIndexerLossAutoScaler", "Attach the DSA indexer loss to the attention output (megatron-core's API).")


@dataclass
class DSAIndexerSubmodules:
    """The indexer's layers: query up projection ``linear_wq_b``, key projection ``linear_wk``, key norm ``k_norm``
    (a LayerNorm), head weights ``linear_weights_proj`` (None: this library's default class)."""

    linear_wq_b: Union[ModuleSpec, type] = None
    linear_wk: Union[ModuleSpec, type] = None
    k_norm: Union[ModuleSpec, type] = None
    linear_weights_proj: Union[ModuleSpec, type] = None


@dataclass
class DSAttentionSubmodules:
    """``DSAttention``'s indexer (None: :class:`DSAIndexer`)."""

    indexer: Union[ModuleSpec, type] = None


def _duplicated(spec, input_size, output_size, config, tp_group):
    """A duplicated linear layer; its weight is not marked sequence-parallel: every TP rank computes the whole
    sequence, so the gradients are already equal."""
    layer = build_module(spec if spec is not None else tensor_parallel.DuplicatedLinear, input_size, output_size,
                         config=config, init_method=config.init_method, bias=False,
                         **({} if tp_group is None else {"tp_group": tp_group}))
    for param in layer.parameters():
        param.sequence_parallel = False
    return layer


class DSAIndexer(MegatronModule):
    """``DSAIndexer(config, submodules, pg_collection=None)``; ``forward(x [s, b, h], qr [s, b, r_q], mask=None,
    packed_seq_params=None) -> topk_indices [b, s, k]``; ``forward_with_scores`` also returns ``index_scores
    [b, s, s]`` (module docstring)."""

    def __init__(self, config, submodules: DSAIndexerSubmodules = None,
                 pg_collection: Optional[ProcessGroupCollection] = None) -> None:
        super().__init__(config=config)
        sub = submodules if submodules is not None else DSAIndexerSubmodules()
        self.pg_collection = pg_collection
        self.tp_group = group_of(pg_collection, "tp")
        self.hidden_size = config.hidden_size
        self.qk_pos_emb_head_dim = config.qk_pos_emb_head_dim
        self.q_lora_rank = config.q_lora_rank if config.q_lora_rank is not None else config.hidden_size
        self.index_n_heads = config.dsa_indexer_n_heads
        self.index_head_dim = config.dsa_indexer_head_dim
        self.index_topk = config.dsa_indexer_topk
        self.softmax_scale = self.index_head_dim ** -0.5
        self.rotary_pos_emb = mla_rotary_embedding(config)
        self.linear_wq_b = _duplicated(sub.linear_wq_b, self.q_lora_rank, self.index_n_heads * self.index_head_dim,
                                       config, self.tp_group)
        self.linear_wk = _duplicated(sub.linear_wk, self.hidden_size, self.index_head_dim, config, self.tp_group)
        norm_config = copy.copy(config)
        norm_config.normalization = "LayerNorm"
        norm_config.sequence_parallel = False
        self.k_norm = build_module(sub.k_norm if sub.k_norm is not None else FusedLayerNorm, config=norm_config,
                                   hidden_size=self.index_head_dim, eps=config.layernorm_epsilon)
        self.linear_weights_proj = _duplicated(sub.linear_weights_proj, self.hidden_size, self.index_n_heads,
                                               config, self.tp_group)

    def _apply_rope(self, x: torch.Tensor, rotary_pos_emb: torch.Tensor, mscale: float) -> torch.Tensor:
        """RoPE on the last ``qk_pos_emb_head_dim`` channels (MLA's pair layout)."""
        x_nope, x_pe = torch.split(x, [self.index_head_dim - self.qk_pos_emb_head_dim, self.qk_pos_emb_head_dim],
                                   dim=-1)
        x_pe = apply_rotary_pos_emb(deinterleave_rotary_pairs(x_pe), rotary_pos_emb, mscale=mscale)
        return torch.cat([x_nope, x_pe], dim=-1)

    def _compute_index_scores(self, q: torch.Tensor, weights: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """``I [b, sq, sk] = sum_j w_{t,j} ReLU(q_{t,j} . k_s)`` in fp32 (``q [sq, b, H_I, d_I]``, ``weights
        [sq, b, H_I]``, ``k [sk, b, d_I]``)."""
        scores = torch.relu(torch.einsum("sbhd,tbd->sbht", q.float(), k.float()))
        return (scores * weights.float().unsqueeze(-1)).sum(dim=2).transpose(0, 1)

    def forward_with_scores(self, x: torch.Tensor, qr: torch.Tensor, mask: Optional[torch.Tensor] = None,
                            packed_seq_params=None) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(index_scores [b, s, s], topk_indices [b, s, k])``; ``mask`` (fp32, 0 / -inf) is added to the scores."""
        if packed_seq_params is not None:
            raise NotImplementedError("DeepSeek sparse attention does not support packed sequences")
        if self.config.sequence_parallel and pg_size(self.pg_collection, "tp") > 1:
            x = tensor_parallel.gather_from_sequence_parallel_region(x, group=self.tp_group)
            qr = tensor_parallel.gather_from_sequence_parallel_region(qr, group=self.tp_group)
        s, b, _ = x.shape
        emb = self.rotary_pos_emb(s)
        emb, mscale = emb if isinstance(emb, tuple) else (emb, 1.0)
        q, _ = self.linear_wq_b(qr)
        q = self._apply_rope(q.reshape(s, b, self.index_n_heads, self.index_head_dim), emb, mscale)
        k, _ = self.linear_wk(x)
        k = self._apply_rope(self.k_norm(k).reshape(s, b, 1, self.index_head_dim), emb, mscale)
        q, k = rotate_activation(q), rotate_activation(k.reshape(s, b, self.index_head_dim))
        weights, _ = self.linear_weights_proj(x)
        weights = weights * (self.index_n_heads ** -0.5) * self.softmax_scale
        index_scores = self._compute_index_scores(q, weights, k)
        if mask is not None:
            if mask.dtype != index_scores.dtype:
                raise ValueError(f"the indexer's mask must be {index_scores.dtype}, got {mask.dtype}")
            index_scores = index_scores + mask
        topk_indices = index_scores.topk(min(self.index_topk, s), dim=-1)[1]
        return index_scores, topk_indices

    def forward(self, x: torch.Tensor, qr: torch.Tensor, mask: Optional[torch.Tensor] = None,
                packed_seq_params=None) -> torch.Tensor:
        return self.forward_with_scores(x, qr, mask, packed_seq_params)[1]


def unfused_dsa_fn(query, key, value, topk_indices, softmax_scale):
    """Causal attention over each query's selected keys: ``query [sq, b, n, d]``, ``key [sk, b, n, d]``, ``value
    [sk, b, n, d_v]``, ``topk_indices [b, sq, k]`` -> ``[sq, b, n d_v]``."""
    sq, b, n, _ = query.shape
    sk, d_v = key.size(0), value.size(3)
    mask = _topk_mask(topk_indices, sk) + _causal_mask(sq, sk, query.device)
    probs = torch.softmax(_head_scores(query, key, softmax_scale) + mask.unsqueeze(1), dim=-1)
    out = torch.einsum("bnst,tbnd->sbnd", probs.to(value.dtype), value)
    return out.reshape(sq, b, n * d_v)


class DSAttention(MegatronModule):
    """megatron-core's ``DSAttention(config, submodules, layer_number, attn_mask_type, attention_type,
    attention_dropout=None, softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type="p2p",
    pg_collection=None)``; ``forward(query, key, value, attention_mask, x, qr, attn_mask_type=None,
    attention_bias=None, packed_seq_params=None) -> [sq, b, n d_v]`` (module docstring; no attention dropout)."""

    def __init__(self, config, submodules: DSAttentionSubmodules, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, k_channels: Optional[int] = None,
                 v_channels: Optional[int] = None, cp_comm_type: str = "p2p",
                 pg_collection: ProcessGroupCollection = None):
        super().__init__(config=config)
        if config.context_parallel_size > 1 or pg_size(pg_collection, "cp") > 1:
            raise ValueError("DeepSeek sparse attention does not support context parallelism "
                             "(--context-parallel-size 1)")
        self.layer_number = layer_number
        sub = submodules if submodules is not None else DSAttentionSubmodules()
        self.indexer = build_module(sub.indexer if sub.indexer is not None else DSAIndexer, config=config,
                                    pg_collection=pg_collection)
        if softmax_scale is None:
            softmax_scale = 1.0 / math.sqrt(k_channels if k_channels is not None else config.kv_channels)
        self.softmax_scale = softmax_scale

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor,
                x: torch.Tensor, qr: torch.Tensor, attn_mask_type: AttnMaskType = None,
                attention_bias: torch.Tensor = None, packed_seq_params=None):
        sq, b = query.size(0), query.size(1)
        sk = key.size(0)
        x, qr = x.detach(), qr.detach()
        if attn_mask_type is not None:
            if attn_mask_type != AttnMaskType.causal:
                raise ValueError(f"DeepSeek sparse attention supports the causal mask only, got {attn_mask_type}")
            float_mask = _causal_mask(sq, sk, query.device)
        else:
            if tuple(attention_mask.shape) != (b, 1, sq, sk):
                raise ValueError(f"attention_mask must be [b, 1, sq, sk] = {(b, 1, sq, sk)}, got "
                                 f"{tuple(attention_mask.shape)}")
            float_mask = torch.zeros(b, sq, sk, device=query.device).masked_fill(attention_mask[:, 0], float("-inf"))
        index_scores, topk_indices = self.indexer.forward_with_scores(x, qr, mask=float_mask,
                                                                      packed_seq_params=packed_seq_params)
        output = unfused_dsa_fn(query, key, value, topk_indices, self.softmax_scale)
        if self.training and torch.is_grad_enabled():
            coeff = self.config.dsa_indexer_loss_coeff or 0.0
            loss = compute_dsa_indexer_loss(index_scores, topk_indices, query.detach(), key.detach(),
                                            self.softmax_scale, coeff, self.config.dsa_indexer_use_sparse_loss,
                                            self.indexer.pg_collection)
            if coeff > 0:
                DSAIndexerLossLoggingHelper.save_loss_to_tracker(loss, self.layer_number, self.config.num_layers)
            output = DSAIndexerLossAutoScaler.apply(output, loss)
        return output
