"""Multi-token prediction (MTP, DeepSeek-V3): ``mtp_num_layers`` = D depths after the decoder, on the last pipeline
stage, sharing the embedding and the output layer with the main model.

Depth k (1..D), from ``h_0`` = the decoder's output after its final norm and ``h_{k-1}`` the previous depth's:

1. roll the token ids (and position ids) left by one more position (depth k sees the tokens shifted by k);
2. ``e = embedding(ids_k)``;
3. ``u = eh_proj([enorm(e); hnorm(h_{k-1})])``, ``eh_proj [h, 2h]`` column parallel without bias, its output gathered
   over TP (and scattered again along the sequence under sequence parallelism);
4. ``h_k = final_layernorm(transformer_layer(u))`` with the main model's mask and rotary embedding; the transformer
   layer is built from the decoder's last layer spec (an MoE layer for DeepSeek-V3);
5. ``logits_k = output_layer(h_k)``.

Loss (:func:`process_mtp_loss`): the labels and the loss mask roll with the ids (depth k at position t predicts
``token[t + 1 + k]``), ``l_k`` = per-token cross entropy, ``m_k`` = rolled mask, ``N_k = sum m_k`` (local). The term
``(lambda / D) sum(m_k l_k) / max(N_k, 1)`` (with ``calculate_per_token_loss``: ``(lambda / D) sum(m_k l_k) N_0 /
max(N_k, 1)``, ``N_0`` the unrolled mask's sum) is attached to the main hidden states by :class:`MTPLossAutoScaler`:
it adds nothing to the reported loss but its gradient is ``main_loss_backward_scale`` (the loss scale / the number of
micro-batches; the loss scale alone in per-token mode; no context-parallel factor, unlike the MoE aux loss). Logged
per depth in training: ``sum(m_k l_k) / max(N_k, 1)`` summed over micro-batches, averaged over DP x CP, divided by the
micro-batches, as ``mtp_{k} loss``; evaluation never adds it to ``lm loss``.

Rolling with context parallelism (:func:`roll_tensor`): each rank holds chunks ``r`` and ``2 CP - 1 - r`` of ``2 CP``;
each chunk is rolled and its last slot takes the first element of the globally next chunk (all-gathered over the CP
group), the sequence's last slot gets 0: a global left roll.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Union

import torch

from megatron.core import parallel_state, tensor_parallel
from megatron.core.process_groups_config import group_of, pg_group, pg_size
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_utils import all_reduce_logged, loss_auto_scaler
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.utils import get_pg_rank, make_tp_sharded_tensor_for_checkpoint


@dataclass
class MultiTokenPredictionBlockSubmodules:
    """One spec per depth: the inner transformer layer's (megatron-core's ``layer_specs``)."""

    layer_specs: List[ModuleSpec] = field(default_factory=list)


@dataclass
class MultiTokenPredictionLayerSubmodules:
    """The parts of one MTP depth: ``enorm`` / ``hnorm`` (the embedding's and the hidden states' norms), ``eh_proj``
    (the ``[2h -> h]`` projection), ``transformer_layer`` (its spec) and ``layer_norm`` (the final norm)."""

    enorm: Union[ModuleSpec, type] = None
    hnorm: Union[ModuleSpec, type] = None
    eh_proj: Union[ModuleSpec, type] = None
    transformer_layer: Union[ModuleSpec, type] = None
    layer_norm: Union[ModuleSpec, type] = None


def _mtp_layer_spec(transformer_layer_spec, column_parallel_linear: type, layer_norm: type) -> ModuleSpec:
    return ModuleSpec(module=MultiTokenPredictionLayer, submodules=MultiTokenPredictionLayerSubmodules(
        enorm=layer_norm, hnorm=layer_norm, eh_proj=column_parallel_linear, transformer_layer=transformer_layer_spec,
        layer_norm=layer_norm))


def get_mtp_layer_spec(transformer_layer_spec: ModuleSpec, use_transformer_engine: bool = False) -> ModuleSpec:
    """The spec of one MTP depth around ``transformer_layer_spec``: the config's norms, a column-parallel
    ``eh_proj``. Transformer Engine layers (``use_transformer_engine``) are not built by this library: a clear
    error says so."""
    if use_transformer_engine:
        from megatron.core.transformer.te_support import transformer_engine_layers_unavailable

        transformer_engine_layers_unavailable()
    from megatron.core.transformer.norms import FusedLayerNorm

    return _mtp_layer_spec(transformer_layer_spec, tensor_parallel.ColumnParallelLinear, FusedLayerNorm)


def get_mtp_layer_spec_for_backend(transformer_layer_spec: ModuleSpec, backend) -> ModuleSpec:
    """One MTP depth with ``backend``'s column-parallel linear and norm (a
    :class:`megatron.core.models.backends.BackendSpecProvider`)."""
    return _mtp_layer_spec(transformer_layer_spec, backend.column_parallel_linear(), backend.layer_norm())


def get_gpt_mtp_block_spec(config, spec,
                           use_transformer_engine: bool = False) -> Optional[MultiTokenPredictionBlockSubmodules]:
    """megatron-core's ``get_gpt_mtp_block_spec``: D depths built from the decoder's last layer spec (``spec``: a
    layer ``ModuleSpec`` or a ``TransformerBlockSubmodules``); None without ``config.mtp_num_layers``."""
    if use_transformer_engine:
        from megatron.core.transformer.te_support import transformer_engine_layers_unavailable

        transformer_engine_layers_unavailable()
    if not config.mtp_num_layers:
        return None
    last = spec.layer_specs[-1] if hasattr(spec, "layer_specs") else spec
    return MultiTokenPredictionBlockSubmodules(layer_specs=[get_mtp_layer_spec(last)] * config.mtp_num_layers)


# ------------------------------------------------------------------------------------------------------ rolling
def _on_last_stage(ignore_virtual: bool, vp_stage: Optional[int]) -> bool:
    if parallel_state.get_pipeline_model_parallel_rank() != parallel_state.get_pipeline_model_parallel_world_size() - 1:
        return False
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if ignore_virtual or vpp is None:
        return True
    stage = parallel_state.get_virtual_pipeline_model_parallel_rank() if vp_stage is None else vp_stage
    return stage == vpp - 1


def get_mtp_ranks(pp_ranks: List[int], config) -> List[int]:
    """The ranks of a pipeline group that hold MTP depths: the last stage's (none without ``mtp_num_layers``; a
    custom pipeline layout, which could place them elsewhere, is not supported here)."""
    return [pp_ranks[-1]] if config.mtp_num_layers else []


def mtp_on_this_rank(config, ignore_virtual: Optional[bool] = True, vp_stage: Optional[int] = None) -> bool:
    """Whether this rank builds the MTP block: with ``mtp_num_layers``, on the last pipeline stage (and, unless
    ``ignore_virtual``, on its last virtual chunk: ``vp_stage``, else parallel_state's virtual rank)."""
    return bool(config.mtp_num_layers) and _on_last_stage(bool(ignore_virtual), vp_stage)


def get_mtp_layer_offset(config, vp_stage: Optional[int] = None) -> int:
    """The global index of this rank's first MTP depth: 0 (every depth lives on the last stage)."""
    return 0


def get_mtp_num_layers_to_build(config, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None) -> int:
    """How many MTP depths this rank (or virtual chunk ``vp_stage``) builds: all ``mtp_num_layers`` on the last
    pipeline stage's last chunk, else 0."""
    return (config.mtp_num_layers or 0) if _on_last_stage(False, vp_stage) else 0


def roll_tensor(tensor: torch.Tensor, cp_group=None):
    """``(tensor rolled left by one along its last dim with the vacated slot 0, sum of the result)``; with a context-
    parallel group of size > 1 the roll is global over the zig-zag chunks (module docstring)."""
    cp = torch.distributed.get_world_size(group=cp_group) if cp_group is not None else 1
    if cp == 1:
        rolled = torch.roll(tensor, shifts=-1, dims=-1)
        rolled[..., -1] = 0
        return rolled, rolled.sum()
    rank = torch.distributed.get_rank(group=cp_group)
    chunks = list(tensor.chunk(2, dim=-1))  # chunk r, chunk 2cp-1-r
    heads = torch.stack([c[..., 0] for c in chunks]).contiguous()  # [2, ...]
    gathered = [torch.empty_like(heads) for _ in range(cp)]
    torch.distributed.all_gather(gathered, heads, group=cp_group)

    def head_of(global_chunk):  # first element of global chunk j (0 past the end of the sequence)
        if global_chunk >= 2 * cp:
            return torch.zeros_like(heads[0])
        if global_chunk < cp:
            return gathered[global_chunk][0]
        return gathered[2 * cp - 1 - global_chunk][1]

    out = []
    for chunk, global_chunk in zip(chunks, (rank, 2 * cp - 1 - rank)):
        rolled = torch.roll(chunk, shifts=-1, dims=-1)
        rolled[..., -1] = head_of(global_chunk + 1)
        out.append(rolled)
    rolled = torch.cat(out, dim=-1)
    return rolled, rolled.sum()


MTPLossAutoScaler = loss_auto_scaler(
    "MTPLossAutoScaler", "Attach an MTP depth's loss to the main hidden states (module docstring for its scale).")


# ------------------------------------------------------------------------------------------------------ modules
class MultiTokenPredictionLayer(MegatronModule):
    """One depth: ``forward(embedding [s, b, h], hidden_states [s, b, h], attention_mask, rotary_pos_emb) -> h_k``."""

    def __init__(self, config, submodules: Union[MultiTokenPredictionLayerSubmodules, ModuleSpec, type],
                 layer_number: int = 1, vp_stage=None, pg_collection=None):
        super().__init__(config=config)
        if not isinstance(submodules, MultiTokenPredictionLayerSubmodules):  # a transformer layer spec alone
            submodules = get_mtp_layer_spec(submodules).submodules
        self.submodules = submodules
        self.pg_collection = pg_collection
        self.tp_group = group_of(pg_collection, "tp")
        self.layer_number = layer_number
        self.vp_stage = vp_stage
        h, eps = config.hidden_size, config.layernorm_epsilon
        self.enorm = build_module(submodules.enorm, config=config, hidden_size=h, eps=eps)
        self.hnorm = build_module(submodules.hnorm, config=config, hidden_size=h, eps=eps)
        self.eh_proj = build_module(submodules.eh_proj, 2 * h, h, config=config, init_method=config.init_method,
                                    bias=False, skip_bias_add=False, gather_output=False, tp_group=self.tp_group)
        # Numbered after the decoder's layers (KV-cache and MoE-loss bookkeeping are keyed by layer number).
        self.transformer_layer = build_module(submodules.transformer_layer, config=config,
                                              layer_number=config.num_layers + layer_number,
                                              **({} if pg_collection is None else {"pg_collection": pg_collection}))
        self.final_layernorm = build_module(submodules.layer_norm, config=config, hidden_size=h, eps=eps)

    def forward(self, embedding, hidden_states, attention_mask, rotary_pos_emb=None):
        x = self._concat_embeddings(hidden_states, embedding)
        out = self.transformer_layer(x, attention_mask, rotary_pos_emb=rotary_pos_emb)
        out = out[0] if isinstance(out, tuple) else out
        return self._postprocess(out)

    def _concat_embeddings(self, hidden_states, decoder_input):
        """The transformer layer's input: ``eh_proj([enorm(decoder_input), hnorm(hidden_states)])`` (gathered over
        TP, scattered back to sequence-parallel shards)."""
        x = torch.cat([self.enorm(decoder_input), self.hnorm(hidden_states)], dim=-1)
        x, _ = self.eh_proj(x)
        x = tensor_parallel.gather_from_tensor_model_parallel_region(x, group=self.tp_group)
        if self.config.sequence_parallel and pg_size(self.pg_collection, "tp") > 1:
            x = tensor_parallel.scatter_to_sequence_parallel_region(x, group=self.tp_group)
        return x

    def _postprocess(self, hidden_states):
        """The depth's final norm."""
        return self.final_layernorm(hidden_states)


class MultiTokenPredictionBlock(MegatronModule):
    """``MultiTokenPredictionBlock(config, spec, vp_stage=None, pg_collection=None)``: the D depths
    (``layers.{k-1}``); ``tracked_losses`` holds each depth's logged MTP loss summed over this step's micro-batches
    (cleared by :func:`reduce_mtp_losses`). The collection's ``tp`` / ``cp`` / ``dp_cp`` groups (else parallel_state's)
    split the layers, roll the tokens across CP ranks and average the logged losses."""

    def __init__(self, config, spec: MultiTokenPredictionBlockSubmodules, vp_stage=None, pg_collection=None):
        super().__init__(config=config)
        self.pg_collection = pg_collection
        groups = {} if pg_collection is None else {"pg_collection": pg_collection}
        self.layers = torch.nn.ModuleList([build_module(s, config=config, layer_number=k + 1, **groups)
                                           for k, s in enumerate(spec.layer_specs)])
        self.tracked_losses: Dict[int, torch.Tensor] = {}

    def forward(self, input_ids, position_ids, hidden_states, attention_mask, embedding, rotary_pos_emb=None):
        """``[h_1, ..., h_D]`` from the decoder output ``hidden_states`` (``embedding(input_ids, position_ids)`` is
        the model's shared embedding)."""
        cp_group = _cp_group(self.pg_collection)
        outputs = []
        for layer in self.layers:
            input_ids, _ = roll_tensor(input_ids, cp_group)
            position_ids, _ = roll_tensor(position_ids, cp_group)
            e = embedding(input_ids=input_ids, position_ids=position_ids)
            # As in the decoder: with sequence parallelism each TP rank's hidden dropout must differ.
            with (tensor_parallel.get_cuda_rng_tracker().fork() if self.config.sequence_parallel
                  else contextlib.nullcontext()):
                hidden_states = layer(e, hidden_states, attention_mask, rotary_pos_emb)
            outputs.append(hidden_states)
        return outputs

    def track(self, depth: int, value: torch.Tensor):
        self.tracked_losses[depth] = self.tracked_losses.get(depth, 0.0) + value.detach().float()


def _cp_group(pg_collection):
    return pg_group(pg_collection, "cp") if pg_size(pg_collection, "cp") > 1 else None


def process_mtp_loss(block: MultiTokenPredictionBlock, hidden_states, mtp_hidden_states, labels, loss_mask,
                     output_logits, per_token_loss):
    """Attach the MTP loss of every depth to the main ``hidden_states`` (module docstring) and track the logged values.
    ``output_logits(h)`` applies the (shared) output layer, ``per_token_loss(labels, logits)`` the model's loss."""
    config = block.config
    depths = len(mtp_hidden_states)
    cp_group = _cp_group(block.pg_collection)
    if loss_mask is None:
        loss_mask = torch.ones_like(labels, dtype=torch.float32)
    loss_mask = loss_mask.float()
    n0 = loss_mask.sum()
    for k, h in enumerate(mtp_hidden_states):
        labels, _ = roll_tensor(labels, cp_group)
        loss_mask, n_k = roll_tensor(loss_mask, cp_group)
        losses = per_token_loss(labels, output_logits(h)).float() * loss_mask
        total = losses.sum()
        mean = total / n_k.clamp(min=1)
        if block.training and torch.is_grad_enabled():
            block.track(k, mean)
        scale = config.mtp_loss_scaling_factor / depths
        term = scale * total * n0 / n_k.clamp(min=1) if config.calculate_per_token_loss else scale * mean
        hidden_states = MTPLossAutoScaler.apply(hidden_states, term)
    return hidden_states


def mtp_blocks(model) -> List[MultiTokenPredictionBlock]:
    chunks = model if isinstance(model, (list, tuple)) else [model]
    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, MultiTokenPredictionBlock)]


def reduce_mtp_losses(model, num_microbatches: int) -> Dict[str, float]:
    """``{'mtp_{k} loss': value}`` of the last step (module docstring), on the ranks holding an MTP block (the last
    pipeline stage; collective over its DP x CP group); clears the tracked sums. The per-depth sums go through
    :class:`MTPLossLoggingHelper` (averaged over ``dp_cp``, scaled by ``1 / num_microbatches``)."""
    totals = {}
    for block in mtp_blocks(model):
        if not block.tracked_losses:
            continue
        depths = len(block.layers)
        tracker = MTPLossLoggingHelper.tracker
        if "values" in tracker and len(tracker["values"]) != depths:
            tracker.clear()  # another model's layout
        group = pg_group(block.pg_collection, "dp_cp")
        for depth, value in sorted(block.tracked_losses.items()):
            MTPLossLoggingHelper.save_loss_to_tracker(value, depth, depths, avg_group=group)
        block.tracked_losses.clear()
        MTPLossLoggingHelper.track_mtp_metrics(1.0 / num_microbatches, 0, None, total_loss_dict=totals)
    return {name: float(value) for name, value in totals.items()}


def _tied_copy(sharded_state_dict, tensor, key: str, tp_group, dp_cp_group) -> None:
    """Replace ``sharded_state_dict[key]`` by a non-main replica ``(1, 0, dp_cp rank)`` of ``tensor``, split over
    ``tp_group`` along axis 0 (vocabulary padding may differ: shape mismatch allowed)."""
    if key not in sharded_state_dict:
        raise KeyError(f"{key!r} is not in the sharded state dict (keys: {sorted(sharded_state_dict)[:8]} ...)")
    del sharded_state_dict[key]
    sharded_state_dict[key] = make_tp_sharded_tensor_for_checkpoint(
        tensor=tensor, key=key, replica_id=(1, 0, get_pg_rank(dp_cp_group)), allow_shape_mismatch=True,
        tp_group=tp_group, dp_cp_group=dp_cp_group)


def tie_word_embeddings_state_dict(sharded_state_dict, word_emb_weight: torch.Tensor, word_emb_weight_key: str,
                                   tp_group, dp_cp_group) -> None:
    """In place: the MTP stage's copy of the word embeddings becomes a replica of the first stage's
    (``replica_id (1, 0, dp_cp rank)``, so only the first stage saves it)."""
    _tied_copy(sharded_state_dict, word_emb_weight, word_emb_weight_key, tp_group, dp_cp_group)


def tie_output_layer_state_dict(sharded_state_dict, output_layer_weight: torch.Tensor, output_layer_weight_key: str,
                                tp_group, dp_cp_group) -> None:
    """In place: the MTP stage's copy of the output layer becomes a replica of the post-process stage's
    (``replica_id (1, 0, dp_cp rank)``)."""
    _tied_copy(sharded_state_dict, output_layer_weight, output_layer_weight_key, tp_group, dp_cp_group)


class MTPLossLoggingHelper:
    """megatron-core's MTP loss log: ``tracker = {"values": [num_layers], "reduce_group", "avg_group"}``, one per
    process. ``values[d]`` accumulates depth ``d``'s (0-based) loss; reduction: SUM over ``reduce_group``, then MEAN
    over ``avg_group`` (where given); ``track_mtp_metrics`` logs ``loss_scale * values[d]`` as ``mtp_{d+1} loss``
    and zeroes the tracker."""

    tracker = {}

    @staticmethod
    def save_loss_to_tracker(loss: torch.Tensor, layer_number: int, num_layers: int, reduce_group=None,
                             avg_group=None):
        """Add ``loss`` (detached) to ``values[layer_number]`` (0-based; nothing when None), creating a zero vector
        of ``num_layers`` on ``loss``'s device first."""
        if layer_number is None:
            return
        tracker = MTPLossLoggingHelper.tracker
        if "values" not in tracker:
            tracker["values"] = torch.zeros(num_layers, device=loss.device)
        tracker["values"][layer_number] += loss.detach().to(tracker["values"].dtype)
        tracker["reduce_group"], tracker["avg_group"] = reduce_group, avg_group

    @staticmethod
    def clean_loss_in_tracker():
        tracker = MTPLossLoggingHelper.tracker
        tracker["values"].zero_()
        tracker["reduce_group"] = tracker["avg_group"] = None

    @staticmethod
    def reduce_loss_in_tracker():
        tracker = MTPLossLoggingHelper.tracker
        if "values" not in tracker:
            return
        all_reduce_logged(tracker["values"], tracker.get("reduce_group"))
        all_reduce_logged(tracker["values"], tracker.get("avg_group"), mean=True)

    @staticmethod
    def track_mtp_metrics(loss_scale, iteration, writer, wandb_writer=None, total_loss_dict=None):
        """Reduce, then per depth ``d``: ``total_loss_dict["mtp_{d+1} loss"] += loss_scale * values[d]``,
        ``writer.add_scalar`` / ``wandb_writer.log`` of the same; then zero the tracker."""
        MTPLossLoggingHelper.reduce_loss_in_tracker()
        tracker = MTPLossLoggingHelper.tracker
        if "values" not in tracker:
            return
        for depth, loss in enumerate(tracker["values"] * loss_scale):
            name = f"mtp_{depth + 1} loss"
            if total_loss_dict is not None:
                total_loss_dict[name] = total_loss_dict[name] + loss if name in total_loss_dict else loss
            if writer is not None:
                writer.add_scalar(name, loss, iteration)
            if wandb_writer is not None:
                wandb_writer.log({name: loss}, iteration)
        MTPLossLoggingHelper.clean_loss_in_tracker()
