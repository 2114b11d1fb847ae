"""megatron-core's GPTModel (``megatron.core.models.gpt.GPTModel``) over the one transformer implementation.

Submodule names are megatron-core's (``embedding``, ``decoder.layers.{i}.self_attention.linear_qkv`` ...,
``output_layer``); :mod:`megatron.core.models.conversion.keys` maps them to Megatron's legacy checkpoint names.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from megatron.core import tensor_parallel
from megatron.core.config_logger import has_config_logger_enabled, log_config_to_disk
from megatron.core.enums import ModelType
from megatron.core.models.common.embedding import LanguageModelEmbedding
from megatron.core.models.common.language_model import logits_or_loss
from megatron.core.packed_seq_params import packed_max_seqlen
from megatron.core.process_groups_config import group_of, is_pp_first_stage_of, pg_rank, pg_size
from megatron.core.transformer.module import MegatronModule, sync_tied_weight_across_pipeline
from megatron.core.transformer.rotary import RotaryEmbedding, YarnRotaryEmbedding, get_pos_emb_on_this_cp_rank
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group
from megatron.core.utils import get_pg_rank, make_tp_sharded_tensor_for_checkpoint


def _or(value, default):
    return default if value is None else value


class LanguageModule(MegatronModule):
    """Shared-embedding handling of megatron-core language models (tied weight lives in ``output_layer`` on
    the last stage). ``LanguageModule(config, pg_collection=None)``: the collection's ``tp`` group splits the
    vocabulary (embedding, output layer, loss), ``pp`` places the stage, ``embd`` ties the first and last stage's
    embedding copies, ``cp`` selects this rank's rotary angles; a group the collection leaves None (or no
    collection) is parallel_state's."""

    def __init__(self, config, pg_collection=None, share_embeddings_and_output_weights: bool = False):
        super().__init__(config=config, share_embeddings_and_output_weights=share_embeddings_and_output_weights)
        self.pg_collection = pg_collection
        self.tp_group = group_of(pg_collection, "tp")
        self.cp_group = group_of(pg_collection, "cp")
        self.pp_group = group_of(pg_collection, "pp")
        self.embd_group = group_of(pg_collection, "embd")
        ties = share_embeddings_and_output_weights or getattr(config, "mtp_num_layers", None)
        if (ties and pg_collection is not None and pg_collection.pp is not None and self.embd_group is None
                and pg_size(pg_collection, "pp") > 1):
            raise ValueError("a pg_collection with pipeline parallelism (pp) must carry its embd group (the first and "
                             "last stage of each pipeline) for the tied / MTP embedding")

    # The last stage's embedding copy for multi-token prediction (GPTModel sets it); a stage holding it also uses it
    # as the tied output weight.
    mtp_process = False

    def shared_embedding_or_output_weight(self):
        if self.pre_process or self.mtp_process:
            return self.embedding.word_embeddings.weight
        if self.post_process:
            return self.output_layer.weight
        return None

    def setup_embeddings_and_output_layer(self):
        if self.pre_process or self.mtp_process:
            self.embedding.word_embeddings.weight.is_embedding_or_output_parameter = True
        if self.post_process and self.output_layer.weight is not None:
            self.output_layer.weight.is_embedding_or_output_parameter = True
        # The first and last stage hold one weight twice when it is tied, or when MTP needs the embedding there.
        if not (self.share_embeddings_and_output_weights or getattr(self.config, "mtp_num_layers", None)):
            return
        if pg_size(self.pg_collection, "pp") == 1:
            if self.share_embeddings_and_output_weights:
                self.shared_embedding_or_output_weight().zero_out_wgrad = True
            return
        if is_pp_first_stage_of(self.pg_collection) and self.pre_process and not self.post_process:
            self.shared_embedding_or_output_weight().shared_embedding = True
        is_copy = self.post_process and not self.pre_process
        sync_tied_weight_across_pipeline(self.shared_embedding_or_output_weight(), is_copy, self.embd_group)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict = None):
        """The default sharded state, with the output layer tied to the word embedding: on a last stage without
        the embedding (PP > 1) the output weight is saved as a replica ``(1, 0, dp)`` of
        ``embedding.word_embeddings.weight`` (never written: the first stage's copy is); vocabulary-sized tensors
        may have another padded size on load."""
        if sharded_offsets:
            raise ValueError("a language model takes no sharded_offsets")
        # A model built from a pg_collection: replicas over its DP x CP group, and over its TP group for the tensors
        # every TP rank holds whole (norms, routers), in the modules that do not carry a TP group themselves.
        for name, field in (("dp_cp_group", "dp_cp"), ("tp_group", "tp")):
            group = group_of(self.pg_collection, field)
            if group is not None and name not in (metadata or {}):
                metadata = {**(metadata or {}), name: group}
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        embedding_key = f"{prefix}embedding.word_embeddings.weight"
        for name in self._output_weight_names():
            key = f"{prefix}{name}.weight"
            if self.share_embeddings_and_output_weights:
                if key in out and not self.pre_process:
                    out[key] = self._tied_output_weight(embedding_key, metadata)
            elif key in out:
                out[key].allow_shape_mismatch = True
            if f"{prefix}{name}.bias" in out:
                out[f"{prefix}{name}.bias"].allow_shape_mismatch = True
        return out

    def _output_weight_names(self):
        """Submodule names of the output layer (one, or an alias too)."""
        return ("output_layer",)

    def _tied_output_weight(self, embedding_key, metadata):
        dp_cp_group = metadata["dp_cp_group"]
        dp_rank = get_pg_rank(dp_cp_group) if dp_cp_group is not None else 0
        return make_tp_sharded_tensor_for_checkpoint(
            self.shared_embedding_or_output_weight(), embedding_key, replica_id=(1, 0, dp_rank),
            allow_shape_mismatch=True, tp_group=getattr(self, "tp_group", None), dp_cp_group=dp_cp_group)

    def _rotary_seq_len(self, input_ids, decoder_input, inference_params):
        """Length of the full sequence: the local length x TP (with SP, for hidden states) x CP."""
        if inference_params is not None:
            return inference_params.max_sequence_length
        cp = pg_size(self.pg_collection, "cp")
        if input_ids is not None:
            return input_ids.size(1) * cp
        hidden = decoder_input if decoder_input is not None else self.decoder.input_tensor
        tp, _ = tensor_parallel.tp_size_and_rank(getattr(self, "tp_group", None))
        return hidden.size(0) * (tp if self.config.sequence_parallel else 1) * cp

    def compute_language_model_loss(self, labels, logits):
        """Per-token loss ``[b, s]`` from ``[s, b, V/tp]`` logits and ``[b, s]`` labels."""
        return logits_or_loss(logits, labels, self.fp16_lm_cross_entropy,
                              fused=getattr(self.config, "cross_entropy_loss_fusion", False),
                              tp_group=getattr(self, "tp_group", None))


def _rotary_cp_split(pg_collection, packed_seq_params):
    """``(size, rank)`` of the context-parallel split of the rotary angles: the model's CP group; none for packed
    ``thd`` sequences (the attention picks each document's rows); a hybrid-CP sample's own ``cp_group`` (none for
    ``local_cp_size`` 1) with ``sbhd`` packed params."""
    if packed_seq_params is None or (packed_seq_params.qkv_format != "thd" and packed_seq_params.cp_group is None
                                     and packed_seq_params.local_cp_size is None):
        return pg_size(pg_collection, "cp"), pg_rank(pg_collection, "cp")
    group = packed_seq_params.cp_group
    if packed_seq_params.qkv_format == "thd" or group is None:
        return 1, 0
    return torch.distributed.get_world_size(group=group), torch.distributed.get_rank(group=group)


class GPTModel(LanguageModule):
    """``GPTModel(config, transformer_layer_spec, vocab_size, max_sequence_length, pre_process=True,
    post_process=True, fp16_lm_cross_entropy=False, parallel_output=True, share_embeddings_and_output_weights=False,
    position_embedding_type=None, rotary_percent=None, rotary_base=None, rope_scaling=None,
    rope_scaling_factor=None, seq_len_interpolation_factor=None)``; the position-embedding arguments left at None
    take the config's values (``position_embedding_type``, ``rotary_percent``, ``rotary_base``, ``use_rope_scaling``,
    ``rope_scaling_factor``, ``rotary_seq_len_interpolation_factor``; megatron-core's defaults unless set).

    ``forward(input_ids [b, s], position_ids [b, s], attention_mask, decoder_input=None, labels=None,
    inference_params=None, loss_mask=None)`` -> logits ``[b, s, V/tp]``, or the per-token loss ``[b, s]`` with
    ``labels``. With ``config.mtp_num_layers`` the last stage also holds the multi-token prediction block (``mtp``,
    ``mtp_block_spec`` or built from the decoder's last layer spec) and an embedding copy; with labels its losses
    (weighted by ``loss_mask``) train it without entering the returned loss
    (:mod:`megatron.core.transformer.multi_token_prediction`).
    """

    def __init__(self, config, transformer_layer_spec: ModuleSpec, vocab_size: int, max_sequence_length: int,
                 pre_process: bool = True, post_process: bool = True, fp16_lm_cross_entropy: bool = False,
                 parallel_output: bool = True, share_embeddings_and_output_weights: bool = False,
                 position_embedding_type: str = None, rotary_percent: float = None, rotary_base: int = None,
                 rope_scaling: bool = None, rope_scaling_factor: float = None,
                 scatter_embedding_sequence_parallel: bool = True, seq_len_interpolation_factor=None,
                 mtp_block_spec=None, pg_collection=None, vp_stage=None):
        super().__init__(config, pg_collection, share_embeddings_and_output_weights=share_embeddings_and_output_weights)
        if has_config_logger_enabled(config):
            log_config_to_disk(config, locals(), prefix=type(self).__name__)
        # Position-embedding settings not passed come from the config's fields of the same meaning (whose defaults
        # are megatron-core's defaults of these arguments).
        position_embedding_type = _or(position_embedding_type, config.position_embedding_type)
        rotary_percent = _or(rotary_percent, config.rotary_percent)
        rotary_base = _or(rotary_base, config.rotary_base)
        rope_scaling = _or(rope_scaling, config.use_rope_scaling)
        rope_scaling_factor = _or(rope_scaling_factor, config.rope_scaling_factor)
        seq_len_interpolation_factor = _or(seq_len_interpolation_factor, config.rotary_seq_len_interpolation_factor)
        if position_embedding_type not in ("learned_absolute", "rope", "yarn", "none"):
            raise ValueError("position_embedding_type must be 'learned_absolute', 'rope', 'yarn' or 'none', "
                             f"got {position_embedding_type!r}")
        self.transformer_layer_spec = transformer_layer_spec
        self.vocab_size = vocab_size
        self.max_sequence_length = max_sequence_length
        self.pre_process = pre_process
        self.post_process = post_process
        self.fp16_lm_cross_entropy = fp16_lm_cross_entropy
        self.parallel_output = parallel_output
        self.position_embedding_type = position_embedding_type
        self.model_type = ModelType.encoder_or_decoder

        # Multi-token prediction on the last (virtual) stage, which then holds the embedding too.
        self.mtp_process = bool(config.mtp_num_layers) and post_process
        if self.mtp_process:
            if mtp_block_spec is None:
                from megatron.core.transformer.multi_token_prediction import get_gpt_mtp_block_spec

                mtp_block_spec = get_gpt_mtp_block_spec(config, transformer_layer_spec)
        if self.pre_process or self.mtp_process:
            self.embedding = LanguageModelEmbedding(
                config, vocab_size, max_sequence_length, position_embedding_type=position_embedding_type,
                scatter_to_sequence_parallel=scatter_embedding_sequence_parallel, tp_group=self.tp_group)
        # Multi-latent attention owns its rotary embedding (of the d_r rotary channels): none at the model level.
        if self.position_embedding_type == "rope" and not config.multi_latent_attention:
            self.rotary_pos_emb = RotaryEmbedding(config.kv_channels, rotary_percent,
                                                  rotary_interleaved=config.rotary_interleaved,
                                                  seq_len_interpolation_factor=seq_len_interpolation_factor,
                                                  rotary_base=rotary_base, rope_scaling=rope_scaling,
                                                  rope_scaling_factor=rope_scaling_factor)
        elif self.position_embedding_type == "yarn" and not config.multi_latent_attention:
            self.rotary_pos_emb = YarnRotaryEmbedding(
                config.kv_channels, rotary_percent, rotary_base=rotary_base,
                scaling_factor=config.rotary_scaling_factor,
                original_max_position_embeddings=config.original_max_position_embeddings,
                beta_fast=config.beta_fast, beta_slow=config.beta_slow, mscale=config.mscale,
                mscale_all_dim=config.mscale_all_dim,
                correction_range_round_to_int=config.yarn_correction_range_round_to_int)
        self.vp_stage = vp_stage
        self.decoder = TransformerBlock(config, spec=transformer_layer_spec, pre_process=self.pre_process,
                                        post_process=self.post_process, pg_collection=pg_collection,
                                        vp_stage=vp_stage)
        if self.mtp_process:
            from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock

            self.mtp = MultiTokenPredictionBlock(config, mtp_block_spec, pg_collection=pg_collection)
        if self.post_process:
            self.output_layer = tensor_parallel.ColumnParallelLinear(
                config.hidden_size, vocab_size, config=config, init_method=config.init_method, bias=False,
                skip_bias_add=False, gather_output=not self.parallel_output,
                skip_weight_param_allocation=((self.pre_process or self.mtp_process)
                                              and self.share_embeddings_and_output_weights),
                tp_group=self.tp_group, reuse_cpu_output_buffer=True)
        if self.pre_process or self.post_process:
            self.setup_embeddings_and_output_layer()
        if has_config_logger_enabled(config):
            log_config_to_disk(config, self.state_dict(), prefix=f"{type(self).__name__}_init_ckpt")

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict = None):
        """:meth:`LanguageModule.sharded_state_dict` without the output layer's (empty) ``_extra_state``, which
        GPT checkpoints never held."""
        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        out.pop(f"{prefix}output_layer._extra_state", None)
        if self.mtp_process and not self.pre_process:
            # The last stage's embedding copy (multi-token prediction): replicas (1, 0, dp) of the first stage's.
            dp_cp_group = ensure_metadata_has_dp_cp_group(metadata)["dp_cp_group"]
            dp_rank = get_pg_rank(dp_cp_group) if dp_cp_group is not None else 0
            for key, leaf in out.items():
                if key.startswith(f"{prefix}embedding."):
                    leaf.replica_id = (1, 0, dp_rank)
        return out

    def set_input_tensor(self, input_tensor):
        if not isinstance(input_tensor, list):
            input_tensor = [input_tensor]
        assert len(input_tensor) == 1, "input_tensor should only be length 1 for gpt"
        self.decoder.set_input_tensor(input_tensor[0])

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None, inference_params=None,
                packed_seq_params=None, extra_block_kwargs=None, loss_mask=None):
        if packed_seq_params is not None and self.mtp_process:
            raise NotImplementedError("GPTModel: packed sequences (packed_seq_params) with multi-token prediction "
                                      "(mtp_num_layers) are not supported")
        decoder_input, rotary_pos_emb, *_ = self._preprocess(input_ids, position_ids, decoder_input,
                                                             inference_context=inference_params,
                                                             packed_seq_params=packed_seq_params)
        packed = {} if packed_seq_params is None else {"packed_seq_params": packed_seq_params}
        hidden_states = self.decoder(hidden_states=decoder_input, attention_mask=attention_mask,
                                     inference_params=inference_params, rotary_pos_emb=rotary_pos_emb, **packed)
        return self._postprocess(hidden_states, input_ids, position_ids, labels, rotary_pos_emb, None, None,
                                 mtp_in_postprocess=True, loss_mask=loss_mask, decoder_input=decoder_input,
                                 attention_mask=attention_mask)

    def _preprocess(self, input_ids, position_ids, decoder_input=None, inference_context=None,
                    packed_seq_params=None, padding_mask=None):
        """Before the decoder: the embedding (first stage, unless ``decoder_input`` is given) and the rotary
        angles of this context-parallel rank's positions. Returns megatron-core's 6-tuple ``(decoder_input,
        rotary_pos_emb, rotary_pos_cos, rotary_pos_sin, sequence_len_offset, padding_mask)`` (cos / sin /
        offset are None here: attention applies the angles itself). Packed sequences (``packed_seq_params``, one
        row ``[1, t]`` of documents): the angles of positions ``0 .. max(max_seqlen_q, max_seqlen_kv)``, not split
        by context parallelism (the attention picks each document's rows)."""
        if padding_mask is not None:
            raise NotImplementedError("GPTModel: padding_mask is not supported")
        if decoder_input is None and self.pre_process:
            decoder_input = self.embedding(input_ids=input_ids, position_ids=position_ids)
        rotary_pos_emb = None
        if hasattr(self, "rotary_pos_emb"):
            rotary_len = (self._rotary_seq_len(input_ids, decoder_input, inference_context)
                          if packed_seq_params is None else packed_max_seqlen(packed_seq_params))
            rotary_pos_emb = self.rotary_pos_emb(rotary_len)
            if isinstance(rotary_pos_emb, tuple):  # YaRN: (angles, concentration); attention applies the latter
                rotary_pos_emb = rotary_pos_emb[0]
            cp, cp_rank = _rotary_cp_split(self.pg_collection, packed_seq_params)
            if cp > 1:
                # Angles of this CP rank's positions (chunks r and 2CP-1-r), as the batch was split.
                rotary_pos_emb = get_pos_emb_on_this_cp_rank(rotary_pos_emb, seq_dim=0, cp_size=cp, cp_rank=cp_rank)
        return decoder_input, rotary_pos_emb, None, None, None, None

    def _postprocess(self, hidden_states, input_ids, position_ids, labels, rotary_pos_emb, rotary_pos_cos,
                     rotary_pos_sin, mtp_in_postprocess=None, loss_mask=None, decoder_input=None,
                     attention_mask=None, inference_params=None, packed_seq_params=None, sequence_len_offset=None,
                     runtime_gather_output=None, extra_block_kwargs=None, inference_context=None):
        """After the decoder (last stage): the multi-token prediction depths' losses (training with labels; the
        MTP block runs here when ``mtp_in_postprocess``, else ``hidden_states`` is ``[main, h_1, ..., h_D]``
        concatenated along the sequence by a schedule plan's MTP layers), the output layer; returns the logits
        ``[b, s, V/tp]``, or the per-token loss ``[b, s]`` with labels. Other stages return ``hidden_states``."""
        if not self.post_process:
            return hidden_states
        if runtime_gather_output:
            raise NotImplementedError("GPTModel: runtime_gather_output is not supported")
        output_weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        mtp_hidden = None
        if self.mtp_process and not mtp_in_postprocess:
            # The depths ran as layers of a schedule plan: [main, h_1, ..., h_D] concatenated along the sequence.
            hidden_states, *mtp_hidden = torch.chunk(hidden_states, 1 + self.config.mtp_num_layers, dim=0)
        if self.mtp_process and labels is not None and self.training:
            # The MTP depths' losses ride on the main hidden states (MTPLossAutoScaler): not in the returned loss.
            from megatron.core.transformer.multi_token_prediction import process_mtp_loss

            if mtp_hidden is None:
                mtp_hidden = self.mtp(input_ids, position_ids, hidden_states, attention_mask, self.embedding,
                                      rotary_pos_emb)
            hidden_states = process_mtp_loss(self.mtp, hidden_states, mtp_hidden, labels, loss_mask,
                                             lambda h: self.output_layer(h, weight=output_weight)[0],
                                             self.compute_language_model_loss)
        logits, _ = self.output_layer(hidden_states, weight=output_weight)
        if has_config_logger_enabled(self.config):  # this call's inputs and logits [s, b, V/tp] (a .pth file)
            log_config_to_disk(self.config, OrderedDict(input_ids=input_ids, position_ids=position_ids,
                                                        attention_mask=attention_mask, decoder_input=decoder_input,
                                                        logits=logits), prefix="input_and_logits")
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        return self.compute_language_model_loss(labels, logits)

    def build_schedule_plan(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None,
                            inference_context=None, packed_seq_params=None, extra_block_kwargs=None,
                            runtime_gather_output=None, inference_params=None, loss_mask=None, padding_mask=None):
        """The arguments of :meth:`forward`, returned as a
        :class:`~megatron.core.models.common.model_chunk_schedule_plan.TransformerModelChunkSchedulePlan` (the
        chunk cut into pre-process, per-layer and post-process nodes) for the combined 1F1B schedule; running it
        computes what :meth:`forward` computes."""
        from megatron.core.models.common.model_chunk_schedule_plan import TransformerModelChunkSchedulePlan

        if inference_context is not None or inference_params is not None:
            raise ValueError("build_schedule_plan is for training: inference_context must be None")
        return TransformerModelChunkSchedulePlan(self, input_ids, position_ids, attention_mask, decoder_input,
                                                 labels, packed_seq_params, extra_block_kwargs,
                                                 runtime_gather_output, loss_mask, padding_mask)
