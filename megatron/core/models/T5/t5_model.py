"""megatron-core's T5Model (``megatron.core.models.T5.T5Model``): Megatron's encoder-decoder LM.

One embedding (word + learned absolute positions ``arange(s)``) feeds both stacks. Encoder: pre-LN layers with
bidirectional self-attention under the padding mask, final LayerNorm. Decoder: pre-LN layers with causal
self-attention, cross-attention to the encoder output, MLP, final LayerNorm. Logits
``decoder_out . E^T + b`` with the tied word embedding ``E`` and the LM bias ``b`` (``lm_head.output_layer.bias``,
present only when tied, as in megatron-core). Masks are boolean, True = masked: encoder ``[b,1,se,se]``, decoder
``[b,1,sd,sd]`` (padding x lower-triangular), encoder-decoder ``[b,1,sd,se]``.

Pipeline parallelism (``--pipeline-model-parallel-split-rank``): stages before the split hold the encoder, the
others the decoder; the split stage has the embedding again (synchronised from stage 0 over the embedding and
position-embedding groups), decoder stages receive ``[decoder hidden, encoder output]`` (the split stage only the
encoder output).
"""
from __future__ import annotations

import dataclasses

import torch

from megatron.core import parallel_state, tensor_parallel
from megatron.core.config_logger import has_config_logger_enabled, log_config_to_disk
from megatron.core.enums import ModelType
from megatron.core.models.common.embedding import LanguageModelEmbedding
from megatron.core.models.gpt.gpt_model import LanguageModule
from megatron.core.process_groups_config import group_of, is_pp_first_stage_of, pg_size
from megatron.core.transformer.module import MegatronModule, is_member, sync_tied_weight_across_pipeline
from megatron.core.transformer.rotary import RotaryEmbedding
from megatron.core.transformer.transformer_block import TransformerBlock


def t5_extended_attention_mask(attention_mask_list):
    """``[b, sq, sk]`` masks -> ``[b, 1, sq, sk]`` (Megatron's helper; ``None`` stays ``None``)."""
    return [None if m is None else m.unsqueeze(1) for m in attention_mask_list]


def t5_position_ids(token_ids):
    """``arange(s)`` expanded to ``[b, s]``."""
    seq_length = token_ids.size(1)
    position_ids = torch.arange(seq_length, dtype=torch.long, device=token_ids.device)
    return position_ids.unsqueeze(0).expand_as(token_ids)


class T5LMHead(MegatronModule):
    """``T5LMHead(config, parallel_output, vocab_size, pre_process=True, share_embeddings_and_output_weights=False,
    tp_group=None)``:
    ``output_layer`` = ColumnParallelLinear ``h -> V/tp`` (weight = the word embedding when tied; bias only when
    tied). ``forward(hidden_states, word_embeddings_weight) -> [s, b, V/tp]``."""

    def __init__(self, config, parallel_output, vocab_size, pre_process=True,
                 share_embeddings_and_output_weights=False, tp_group=None):
        super().__init__(config=config)
        self.parallel_output = parallel_output
        self.tp_group = tp_group
        self.output_layer = tensor_parallel.ColumnParallelLinear(
            config.hidden_size, vocab_size, config=config, init_method=config.init_method,
            bias=share_embeddings_and_output_weights, skip_bias_add=not share_embeddings_and_output_weights,
            gather_output=not parallel_output,
            skip_weight_param_allocation=pre_process and share_embeddings_and_output_weights, tp_group=tp_group)

    def forward(self, hidden_states, word_embeddings_weight=None):
        logits, _ = self.output_layer(hidden_states, weight=word_embeddings_weight)
        return logits


class T5Model(LanguageModule):
    """``T5Model(config, encoder_config, transformer_encoder_layer_spec, transformer_decoder_layer_spec, vocab_size,
    max_sequence_length, pre_process=True, post_process=True, fp16_lm_cross_entropy=False, parallel_output=True,
    share_embeddings_and_output_weights=False, position_embedding_type='learned_absolute', rotary_percent=1.0,
    seq_len_interpolation_factor=None, add_encoder=True, add_decoder=True, pg_collection=None)``.

    The decoder has ``config.num_layers`` layers, the encoder ``encoder_config.num_layers``. Layer specs are
    layer ``ModuleSpec``s or ``TransformerBlockSubmodules`` (:mod:`megatron.core.models.T5.t5_spec`).
    """

    def __init__(self, config, encoder_config, transformer_encoder_layer_spec, transformer_decoder_layer_spec,
                 vocab_size, max_sequence_length, pre_process=True, post_process=True, fp16_lm_cross_entropy=False,
                 parallel_output=True, share_embeddings_and_output_weights=False,
                 position_embedding_type="learned_absolute", rotary_percent=1.0, seq_len_interpolation_factor=None,
                 relative_attention_num_buckets=32, relative_attention_max_distance=128, add_encoder=True,
                 add_decoder=True, pg_collection=None):
        # The collection's groups (else parallel_state's): ``tp`` splits the vocabulary and every layer, ``pp`` places
        # the stage (the encoder-decoder split is parallel_state's split rank, a stage number of this pipeline),
        # ``embd`` ties the word embeddings of the first, split and last stages, ``pos_embd`` the position
        # embeddings of the first and split stages.
        super().__init__(config, pg_collection, share_embeddings_and_output_weights=share_embeddings_and_output_weights)
        if has_config_logger_enabled(config):
            log_config_to_disk(config, locals(), prefix=type(self).__name__)
        if position_embedding_type not in ("learned_absolute", "rope"):
            raise NotImplementedError(f"T5 position_embedding_type {position_embedding_type!r}: only "
                                      "'learned_absolute' and 'rope' are implemented ('relative' needs Transformer "
                                      "Engine in megatron-core)")
        if encoder_config is None:
            encoder_config = config
        self.encoder_config = encoder_config
        self.vocab_size = vocab_size
        self.max_sequence_length = max_sequence_length
        self.pre_process = pre_process
        self.post_process = post_process
        self.add_encoder = add_encoder
        self.add_decoder = add_decoder
        self.fp16_lm_cross_entropy = fp16_lm_cross_entropy
        self.parallel_output = parallel_output
        self.position_embedding_type = position_embedding_type
        self.model_type = ModelType.encoder_or_decoder
        self.xattn_needed = True
        self.encoder_hidden_state = None

        if self.pre_process:
            self.embedding = LanguageModelEmbedding(config, vocab_size, max_sequence_length,
                                                    position_embedding_type=position_embedding_type,
                                                    tp_group=self.tp_group)
            if position_embedding_type == "learned_absolute":
                self.position_embeddings = self.embedding.position_embeddings  # megatron-core's alias
        if position_embedding_type == "rope":
            self.rotary_pos_emb = RotaryEmbedding(config.kv_channels, rotary_percent,
                                                  rotary_interleaved=config.rotary_interleaved,
                                                  seq_len_interpolation_factor=seq_len_interpolation_factor)
        self.encoder = None
        if add_encoder:
            self.encoder = TransformerBlock(encoder_config, spec=transformer_encoder_layer_spec, pre_process=pre_process,
                                            post_process=post_process, pg_collection=pg_collection, role="encoder")
        self.decoder = None
        if add_decoder:
            self.decoder = TransformerBlock(config, spec=transformer_decoder_layer_spec, pre_process=pre_process,
                                            post_process=post_process, pg_collection=pg_collection, role="decoder")
        self.has_lm_head = post_process and add_decoder
        if self.has_lm_head:
            self.lm_head = T5LMHead(config, parallel_output, vocab_size, pre_process=pre_process,
                                    share_embeddings_and_output_weights=share_embeddings_and_output_weights,
                                    tp_group=self.tp_group)
            self.output_layer = self.lm_head.output_layer  # megatron-core's alias
        self._setup_embeddings()
        self._register_load_state_dict_pre_hook(self._fill_aliases)

    @staticmethod
    def _fill_aliases(state_dict, prefix, *unused):
        """megatron-core's aliases (``position_embeddings`` = ``embedding.position_embeddings``, ``output_layer`` =
        ``lm_head.output_layer``) appear twice in a state dict; accept a state dict that spells either one."""
        for alias, target in (("position_embeddings.", "embedding.position_embeddings."),
                              ("output_layer.", "lm_head.output_layer.")):
            for key in list(state_dict):
                if key.startswith(prefix + target):
                    state_dict.setdefault(prefix + alias + key[len(prefix + target):], state_dict[key])
                elif key.startswith(prefix + alias):
                    state_dict.setdefault(prefix + target + key[len(prefix + alias):], state_dict[key])

    # ------------------------------------------------------------------------------------ embeddings
    def shared_embedding_or_output_weight(self):
        if self.pre_process:
            return self.embedding.word_embeddings.weight
        if self.has_lm_head:
            return self.output_layer.weight
        return None

    def _setup_embeddings(self):
        """Tie the output layer to the word embedding across stages; give a split stage stage 0's embedding."""
        if self.pre_process:
            self.embedding.word_embeddings.weight.is_embedding_or_output_parameter = True
        if self.has_lm_head and self.output_layer.weight is not None:
            self.output_layer.weight.is_embedding_or_output_parameter = True
        pgs = self.pg_collection
        if pg_size(pgs, "pp") == 1:
            if self.share_embeddings_and_output_weights:
                self.shared_embedding_or_output_weight().zero_out_wgrad = True
            return
        split = parallel_state.get_pipeline_model_parallel_split_rank()
        if split is not None and not self.share_embeddings_and_output_weights:
            raise ValueError("T5 with --pipeline-model-parallel-split-rank needs tied embeddings "
                             "(drop --untie-embeddings-and-output-weights)")
        if not self.share_embeddings_and_output_weights:
            return
        first = is_pp_first_stage_of(pgs, ignore_virtual=True)
        if first and self.pre_process and not self.has_lm_head:
            self.shared_embedding_or_output_weight().shared_embedding = True
        if self.pre_process and not first:
            self.embedding.zero_parameters()  # the split stage: stage 0's values arrive by the all-reduce
        is_copy = self.has_lm_head and not self.pre_process
        if self.pre_process or is_copy:
            sync_tied_weight_across_pipeline(self.shared_embedding_or_output_weight(), is_copy, self.embd_group)
        if not (split is not None and self.pre_process and torch.distributed.is_initialized()
                and self.embedding.add_position_embedding):
            return
        pos_group = group_of(pgs, "pos_embd")
        if pos_group is None and pgs is not None and pgs.pp is not None:
            raise ValueError("a pg_collection with pipeline parallelism (pp) and a split rank must carry its pos_embd "
                             "group (the first stage of the encoder and of the decoder) for T5's position embedding")
        if pos_group is None and parallel_state.is_rank_in_position_embedding_group():
            pos_group = parallel_state.get_position_embedding_group()
        if is_member(pos_group):
            torch.distributed.all_reduce(self.embedding.position_embeddings.weight.data, group=pos_group)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict = None):
        """The language model's sharded state; on the split stage (``--pipeline-model-parallel-split-rank``) the
        embedding is a synchronised copy of stage 0's, saved as replica ``(1, ...)`` (never written, stage 0's is)."""
        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if self.pre_process and not is_pp_first_stage_of(self.pg_collection, ignore_virtual=True):
            for key, leaf in out.items():
                if key.startswith((f"{prefix}embedding.", f"{prefix}position_embeddings.")) and \
                        hasattr(leaf, "replica_id"):
                    replica = leaf.replica_id if isinstance(leaf.replica_id, tuple) else (leaf.replica_id,)
                    out[key] = dataclasses.replace(leaf, replica_id=(1, *replica[1:]))
        return out

    # ------------------------------------------------------------------------------------ pipeline
    def set_input_tensor(self, input_tensor):
        """Encoder stage: one tensor (hidden states). Decoder stage: ``[decoder hidden, encoder output]``, or
        ``[encoder output]`` on the split stage (its decoder input comes from its embedding)."""
        if not isinstance(input_tensor, list):
            input_tensor = [input_tensor]
        if self.add_encoder and self.add_decoder:
            assert len(input_tensor) == 1, "input_tensor should only be length 1 for a stage with encoder and decoder"
            self.encoder.set_input_tensor(input_tensor[0])
        elif self.add_encoder:
            assert len(input_tensor) == 1, "input_tensor should only be length 1 for an encoder stage"
            self.encoder.set_input_tensor(input_tensor[0])
        elif self.add_decoder:
            if len(input_tensor) == 2:
                self.decoder.set_input_tensor(input_tensor[0])
                self.encoder_hidden_state = input_tensor[1]
            elif len(input_tensor) == 1:
                self.decoder.set_input_tensor(None)
                self.encoder_hidden_state = input_tensor[0]
            else:
                raise Exception("input_tensor must have either length 1 or 2")
        else:
            raise Exception("Stage must have at least either encoder or decoder")

    # ------------------------------------------------------------------------------------ forward
    def _rope(self, ids, block):
        if self.position_embedding_type != "rope":
            return None
        if ids is not None:
            return self.rotary_pos_emb(ids.size(1))
        hidden = block.input_tensor
        tp = pg_size(self.pg_collection, "tp")
        return self.rotary_pos_emb(hidden.size(0) * (tp if self.config.sequence_parallel else 1))

    def forward(self, encoder_input_ids, decoder_input_ids, encoder_attn_mask, decoder_attn_mask,
                encoder_decoder_attn_mask, lm_labels=None, encoder_hidden_states=None,
                output_encoder_hidden_only=False, inference_context=None, packed_seq_params=None, *,
                inference_params=None):
        if packed_seq_params is not None:
            raise NotImplementedError("packed sequences (packed_seq_params) are not supported")
        if encoder_hidden_states is None:
            if self.add_encoder:
                encoder_input = None
                if self.pre_process:
                    encoder_input = self.embedding(input_ids=encoder_input_ids,
                                                   position_ids=t5_position_ids(encoder_input_ids))
                encoder_hidden_states = self.encoder(encoder_input, encoder_attn_mask,
                                                     rotary_pos_emb=self._rope(encoder_input_ids, self.encoder))
            else:
                encoder_hidden_states = self.encoder_hidden_state
        if not self.add_decoder or output_encoder_hidden_only:
            return encoder_hidden_states

        decoder_input = None
        if self.pre_process:
            decoder_input = self.embedding(input_ids=decoder_input_ids, position_ids=t5_position_ids(decoder_input_ids))
        decoder_hidden_states = self.decoder(decoder_input, decoder_attn_mask, context=encoder_hidden_states,
                                             context_mask=encoder_decoder_attn_mask,
                                             rotary_pos_emb=self._rope(decoder_input_ids, self.decoder))
        if not self.post_process:
            return decoder_hidden_states
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        logits = self.lm_head(decoder_hidden_states, word_embeddings_weight=weight)
        if lm_labels is None:
            return logits.transpose(0, 1).contiguous()
        return self.compute_language_model_loss(lm_labels, logits)
