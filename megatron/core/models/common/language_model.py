"""Megatron's language model: embedding -> transformer -> (pooler, output layer), and the LM logits and loss.

``TransformerLanguageModel`` holds the parts that GPT and BERT share; settings Megatron reads from the command
line (vocabulary size, position-embedding type, untied output layer ...) are typed fields of ``TransformerConfig``.
"""
from __future__ import annotations

import dataclasses

import torch

from megatron.core import parallel_state, tensor_parallel
from megatron.core.enums import ModelType
from megatron.core.models.common.embedding import Embedding
from megatron.core.transformer.enums import AttnMaskType, LayerType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.rotary import RotaryEmbedding
from megatron.core.transformer.transformer_block import ParallelTransformer
from megatron.core.transformer.utils import get_linear_layer


def parallel_lm_logits(input_, word_embeddings_weight, parallel_output, bias=None, *, config=None):
    """Logits ``[s, b, V/tp]`` (or all-gathered ``[s, b, V]`` when not ``parallel_output``) against a
    vocabulary-parallel weight ``[V/tp, h]``. With sequence parallelism ``input_`` is ``[s/tp, b, h]`` and is
    all-gathered inside the GEMM."""
    sequence_parallel = bool(config is not None and config.sequence_parallel)
    async_allreduce = bool(config is not None and config.async_tensor_model_parallel_allreduce)
    grad_accumulation_fusion = bool(config is not None and config.gradient_accumulation_fusion)
    if async_allreduce or sequence_parallel:
        input_parallel = input_
        model_parallel = parallel_state.get_tensor_model_parallel_world_size() > 1
        async_grad_allreduce = async_allreduce and model_parallel and not sequence_parallel
    else:
        input_parallel = tensor_parallel.copy_to_tensor_model_parallel_region(input_)
        async_grad_allreduce = False
    logits_parallel = tensor_parallel.linear_with_grad_accumulation_and_async_allreduce(
        input=input_parallel, weight=word_embeddings_weight, bias=bias,
        gradient_accumulation_fusion=grad_accumulation_fusion, async_grad_allreduce=async_grad_allreduce,
        sequence_parallel=sequence_parallel)
    if parallel_output:
        return logits_parallel
    return tensor_parallel.gather_from_tensor_model_parallel_region(logits_parallel)


def logits_or_loss(logits, labels, fp16_lm_cross_entropy=False, fused=False, tp_group=None):
    """``[s, b, V]`` logits -> ``[b, s, V]`` logits, or the per-token loss ``[b, s]`` when labels ``[b, s]`` are given.

    ``fused`` (``config.cross_entropy_loss_fusion``, ``--cross-entropy-loss-fusion``) computes the same loss
    with the compiled, single-all-reduce kernel of :mod:`megatron.core.fusions.fused_cross_entropy`. The vocabulary
    is split over ``tp_group`` (None: parallel_state's TP group).
    """
    if labels is None:
        return logits.transpose(0, 1).contiguous()
    labels = labels.transpose(0, 1).contiguous()
    if fused:
        if tp_group is not None:
            raise NotImplementedError("the fused cross entropy (--cross-entropy-loss-fusion) reduces over "
                                      "parallel_state's TP group: a model built with another pg_collection.tp cannot "
                                      "use it; drop --cross-entropy-loss-fusion")
        from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy as cross_entropy
    else:
        # The logits were made for this loss and are not returned: the loss may overwrite them.
        def cross_entropy(logits, labels):
            return tensor_parallel.vocab_parallel_cross_entropy(logits, labels, inplace=True, tp_group=tp_group)
    if fp16_lm_cross_entropy:
        assert logits.dtype == torch.half, "--fp16-lm-cross-entropy needs fp16 logits (--fp16)"
        loss = cross_entropy(logits, labels)
    else:
        loss = cross_entropy(logits.float(), labels)
    return loss.transpose(0, 1).contiguous()


class Pooler(MegatronModule):
    """``Pooler(hidden_size, init_method)``: ``tanh(dense(h[sequence_index]))`` (BERT's [CLS] representation)."""

    def __init__(self, hidden_size, init_method, *, config=None):
        super().__init__(config=config)
        self.dense = get_linear_layer(hidden_size, hidden_size, init_method, config=config)
        self.sequence_parallel = bool(config is not None and config.sequence_parallel)

    def forward(self, hidden_states, sequence_index=0):
        # hidden_states: [s, b, h]; with sequence parallelism gather the sequence first. The pooler is
        # replicated, so the gradient needs no reduction: split it back (tensor_parallel_output_grad=False).
        if self.sequence_parallel:
            hidden_states = tensor_parallel.gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False)
        pooled = hidden_states[sequence_index, :, :]
        pooled = self.dense(pooled)
        return torch.tanh(pooled)


class TransformerLanguageModel(MegatronModule):
    """``TransformerLanguageModel(config, encoder_attn_mask_type, num_tokentypes=0, add_encoder=True,
    add_decoder=False, decoder_attn_mask_type=causal, add_pooler=False, pre_process=True, post_process=True)``.

    Submodules (checkpoint keys): ``embedding`` (first stage), ``encoder``, ``pooler``, ``output_layer`` (untied
    embeddings, last stage).
    """

    def __init__(self, config, encoder_attn_mask_type, num_tokentypes=0, add_encoder=True, add_decoder=False,
                 decoder_attn_mask_type=AttnMaskType.causal, add_pooler=False, pre_process=True, post_process=True,
                 *, encoder_decoder: bool = False):
        untie = config.untie_embeddings_and_output_weights
        super().__init__(config=config, share_embeddings_and_output_weights=not untie)
        # encoder_decoder (T5): the stacks of an encoder-decoder model (either may be absent on a pipeline stage).
        encoder_decoder = encoder_decoder or add_decoder
        if encoder_decoder and untie:
            raise ValueError("the encoder-decoder model (T5) does not support --untie-embeddings-and-output-weights")
        self.encoder_decoder = encoder_decoder
        self.pre_process = pre_process
        self.post_process = post_process
        self.hidden_size = config.hidden_size
        self.num_tokentypes = num_tokentypes
        self.init_method = config.init_method
        self.add_encoder = add_encoder
        self.encoder_attn_mask_type = encoder_attn_mask_type
        self.add_decoder = add_decoder
        self.decoder_attn_mask_type = decoder_attn_mask_type
        self.add_pooler = add_pooler
        self.encoder_hidden_state = None
        self.untie_embeddings_and_output_weights = untie
        self.sequence_parallel = config.sequence_parallel
        padded_vocab_size = config.required_padded_vocab_size()

        if self.pre_process:
            self.embedding = Embedding(self.hidden_size, padded_vocab_size, config.max_position_embeddings,
                                       config.hidden_dropout, config, self.num_tokentypes,
                                       config.embedding_weights_in_fp32)
            self._embedding_key = "embedding"

        position_embedding_type = config.position_embedding_type
        if position_embedding_type not in ("learned_absolute", "rope", "none"):
            raise ValueError("--position-embedding-type must be learned_absolute, rope or none, "
                             f"got {position_embedding_type!r}")
        self.use_rotary_position_embeddings = position_embedding_type == "rope"
        if self.use_rotary_position_embeddings:
            self.rotary_pos_emb = RotaryEmbedding(
                config.kv_channels, config.rotary_percent, rotary_interleaved=config.rotary_interleaved,
                seq_len_interpolation_factor=config.rotary_seq_len_interpolation_factor,
                rotary_base=config.rotary_base, rope_scaling=config.use_rope_scaling,
                rope_scaling_factor=config.rope_scaling_factor)

        model_type = ModelType.encoder_and_decoder if encoder_decoder else ModelType.encoder_or_decoder
        if self.add_encoder:
            self.encoder = ParallelTransformer(config, model_type=model_type,
                                               self_attn_mask_type=self.encoder_attn_mask_type,
                                               pre_process=self.pre_process, post_process=self.post_process)
            self._encoder_key = "encoder"
        else:
            self.encoder = None
        self.decoder = None
        if self.add_decoder:
            decoder_config = config
            if config.decoder_num_layers is not None and config.decoder_num_layers != config.num_layers:
                decoder_config = dataclasses.replace(config, num_layers=config.decoder_num_layers)
            self.decoder = ParallelTransformer(decoder_config, model_type=model_type, layer_type=LayerType.decoder,
                                               self_attn_mask_type=self.decoder_attn_mask_type,
                                               pre_process=self.pre_process, post_process=self.post_process)
            self._decoder_key = "decoder"

        if self.post_process:
            if self.add_pooler:
                self.pooler = Pooler(self.hidden_size, self.init_method, config=config)
                self._pooler_key = "pooler"
            if self.untie_embeddings_and_output_weights:
                self.output_layer = tensor_parallel.ColumnParallelLinear(
                    config.hidden_size, padded_vocab_size, config=config, init_method=self.init_method, bias=False)
                self._output_layer_key = "output_layer"

    def set_input_tensor(self, input_tensor):
        """See megatron.core.pipeline_parallel: the schedule hands each stage its received activation."""
        if not isinstance(input_tensor, list):
            input_tensor = [input_tensor]
        if self.add_encoder:
            assert len(input_tensor) == 1, "input_tensor should only be length 1 for a stage with an encoder"
            self.encoder.set_input_tensor(input_tensor[0])
        elif self.add_decoder and len(input_tensor) == 2:  # decoder stage after the split: [decoder, encoder]
            self.decoder.set_input_tensor(input_tensor[0])
            self.encoder_hidden_state = input_tensor[1]
        elif self.add_decoder:  # the split stage: its decoder input is its embedding
            assert len(input_tensor) == 1, "input_tensor must have either length 1 or 2"
            self.decoder.set_input_tensor(None)
            self.encoder_hidden_state = input_tensor[0]
        else:
            assert len(input_tensor) == 1, "input_tensor should only be length 1 for an encoder-only model"
            self.encoder_hidden_state = input_tensor[0]

    def _rotary_seq_len(self, enc_input_ids, inference_params):
        if inference_params is not None:
            return inference_params.max_sequence_length
        if enc_input_ids is not None:
            return enc_input_ids.size(1)
        hidden = self.encoder.input_tensor
        tp = parallel_state.get_tensor_model_parallel_world_size()
        return hidden.size(0) * (tp if self.sequence_parallel else 1)

    def forward(self, enc_input_ids, enc_position_ids, enc_attn_mask, dec_input_ids=None, dec_position_ids=None,
                dec_attn_mask=None, retriever_input_ids=None, retriever_position_ids=None, retriever_attn_mask=None,
                enc_dec_attn_mask=None, tokentype_ids=None, inference_params=None, pooling_sequence_index=0,
                enc_hidden_states=None, output_enc_hidden=False):
        if retriever_input_ids is not None:
            raise NotImplementedError("retro (retriever_input_ids) is not implemented")
        encoder_input = None
        if self.pre_process and self.add_encoder and enc_hidden_states is None:
            encoder_input = self.embedding(enc_input_ids, enc_position_ids, tokentype_ids=tokentype_ids)

        rotary_pos_emb = None
        if self.use_rotary_position_embeddings and self.add_encoder:
            rotary_pos_emb = self.rotary_pos_emb(self._rotary_seq_len(enc_input_ids, inference_params))

        if enc_hidden_states is None:
            if self.encoder is not None:
                encoder_output = self.encoder(encoder_input, enc_attn_mask, inference_params=inference_params,
                                              rotary_pos_emb=rotary_pos_emb)
            else:
                encoder_output = self.encoder_hidden_state
        else:
            encoder_output = enc_hidden_states

        if not self.add_decoder or output_enc_hidden:
            if self.post_process and self.add_pooler:
                pooled_output = self.pooler(encoder_output, pooling_sequence_index)
                return encoder_output, pooled_output
            return encoder_output

        decoder_input = None
        if self.pre_process:
            decoder_input = self.embedding(dec_input_ids, dec_position_ids)
        decoder_rotary = None
        if self.use_rotary_position_embeddings:
            decoder_rotary = self.rotary_pos_emb(dec_input_ids.size(1))
        decoder_output = self.decoder(decoder_input, dec_attn_mask, encoder_output=encoder_output,
                                      enc_dec_attn_mask=enc_dec_attn_mask, inference_params=inference_params,
                                      rotary_pos_emb=decoder_rotary)
        return decoder_output, encoder_output

    def state_dict_for_save_checkpoint(self, prefix="", keep_vars=False):
        """Megatron's nested checkpoint layout: ``{'embedding': ..., 'encoder': ..., 'pooler': ..., 'output_layer': ...}``."""
        state_dict_ = {}
        if self.pre_process:
            state_dict_[self._embedding_key] = self.embedding.state_dict_for_save_checkpoint(prefix=prefix,
                                                                                            keep_vars=keep_vars)
        if self.add_encoder:
            state_dict_[self._encoder_key] = self.encoder.state_dict_for_save_checkpoint(prefix=prefix,
                                                                                        keep_vars=keep_vars)
        if self.add_decoder:
            state_dict_[self._decoder_key] = self.decoder.state_dict_for_save_checkpoint(prefix=prefix,
                                                                                        keep_vars=keep_vars)
        if self.post_process:
            if self.add_pooler:
                state_dict_[self._pooler_key] = self.pooler.state_dict_for_save_checkpoint(prefix=prefix,
                                                                                          keep_vars=keep_vars)
            if self.untie_embeddings_and_output_weights:
                state_dict_[self._output_layer_key] = self.output_layer.state_dict(prefix=prefix, keep_vars=keep_vars)
        return state_dict_


def get_language_model(config, num_tokentypes, add_pooler, encoder_attn_mask_type, add_encoder=True, add_decoder=False,
                       decoder_attn_mask_type=AttnMaskType.causal, pre_process=True, post_process=True, *,
                       encoder_decoder: bool = False):
    """Megatron's factory: ``(TransformerLanguageModel, 'language_model')``."""
    if config.init_method is None or config.output_layer_init_method is None:
        raise ValueError("config.init_method and config.output_layer_init_method must be set")
    language_model = TransformerLanguageModel(
        config, encoder_attn_mask_type, num_tokentypes=num_tokentypes, add_encoder=add_encoder,
        add_decoder=add_decoder, decoder_attn_mask_type=decoder_attn_mask_type, add_pooler=add_pooler,
        pre_process=pre_process, post_process=post_process, encoder_decoder=encoder_decoder)
    return language_model, "language_model"


__all__ = ["Embedding", "Pooler", "TransformerLanguageModel", "get_language_model", "parallel_lm_logits",
           "get_linear_layer", "logits_or_loss"]
