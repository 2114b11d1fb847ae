"""Megatron's legacy T5 model API (``megatron.model.T5Model``) over megatron.core's one transformer.

Same computation as :class:`megatron.core.models.T5.T5Model` (see its docstring for the math); the module tree is
``language_model.{embedding, encoder, decoder}`` + ``lm_head.bias`` and checkpoints use Megatron's legacy names
(``query_key_value``, ``inter_attention.{query,key_value,dense}``, ``post_inter_attention_layernorm`` ...), which
the layers apply at their state-dict boundary from :data:`megatron.core.models.conversion.keys.LEGACY_SUBMODULE_NAMES`.
Masks are ``[b, sq, sk]`` booleans, True = masked (``t5_extended_attention_mask`` adds the head dimension).
"""
from __future__ import annotations

import torch

from megatron.core import tensor_parallel
from megatron.core.models.T5.t5_model import t5_extended_attention_mask, t5_position_ids
from megatron.core.models.common.language_model import get_language_model, logits_or_loss, parallel_lm_logits
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.norms import param_device


class T5LMHead(MegatronModule):
    """``T5LMHead(mpu_vocab_size, parallel_output)``: logits against the tied word embedding plus a
    vocabulary-parallel ``bias`` (zeros, ``[V/tp]``)."""

    def __init__(self, mpu_vocab_size, parallel_output, *, config=None):
        super().__init__(config=config)
        kwargs = {} if config is None else {"dtype": config.params_dtype, "device": param_device(config)}
        self.bias = torch.nn.Parameter(torch.zeros(mpu_vocab_size, **kwargs))
        tensor_parallel.set_tensor_model_parallel_attributes(self.bias, True, 0, 1)
        self.parallel_output = parallel_output

    def forward(self, hidden_states, word_embeddings_weight):
        return parallel_lm_logits(hidden_states, word_embeddings_weight, self.parallel_output, bias=self.bias,
                                  config=self.config)


class T5Model(MegatronModule):
    """``T5Model(config, num_tokentypes=0, parallel_output=True, pre_process=True, post_process=True,
    add_encoder=True, add_decoder=True)``.

    ``forward(encoder_input_ids, decoder_input_ids, encoder_attn_mask, decoder_attn_mask, encoder_decoder_attn_mask,
    tokentype_ids=None, lm_labels=None, enc_hidden_states=None)`` returns logits ``[b, sd, V/tp]``, the per-token
    loss ``[b, sd]`` with ``lm_labels``, the decoder hidden states ``[sd, b, h]`` on inner decoder stages, or the
    encoder output ``[se, b, h]`` on encoder stages.
    """

    def __init__(self, config, num_tokentypes=0, parallel_output=True, pre_process=True, post_process=True,
                 add_encoder=True, add_decoder=True):
        super().__init__(config=config)
        self.fp16_lm_cross_entropy = config.fp16_lm_cross_entropy
        self.parallel_output = parallel_output
        self.pre_process = pre_process
        self.post_process = post_process
        self.add_encoder = add_encoder
        self.add_decoder = add_decoder
        self.language_model, self._language_model_key = get_language_model(
            config=config, num_tokentypes=num_tokentypes, add_pooler=False, add_encoder=add_encoder,
            add_decoder=add_decoder, encoder_attn_mask_type=AttnMaskType.padding, pre_process=pre_process,
            post_process=post_process, encoder_decoder=True)
        self.initialize_word_embeddings()
        if self.post_process and self.add_decoder:
            self.lm_head = T5LMHead(self.shared_embedding_or_output_weight().size(0), parallel_output, config=config)
            self._lm_head_key = "lm_head"

    def set_input_tensor(self, input_tensor):
        self.language_model.set_input_tensor(input_tensor)

    def forward(self, encoder_input_ids, decoder_input_ids, encoder_attn_mask, decoder_attn_mask,
                encoder_decoder_attn_mask, tokentype_ids=None, lm_labels=None, enc_hidden_states=None):
        encoder_attn_mask, decoder_attn_mask, encoder_decoder_attn_mask = t5_extended_attention_mask(
            [encoder_attn_mask, decoder_attn_mask, encoder_decoder_attn_mask])
        lm_output = self.language_model(
            encoder_input_ids, t5_position_ids(encoder_input_ids), encoder_attn_mask, decoder_input_ids,
            t5_position_ids(decoder_input_ids), decoder_attn_mask, enc_dec_attn_mask=encoder_decoder_attn_mask,
            tokentype_ids=tokentype_ids, enc_hidden_states=enc_hidden_states)
        if self.post_process and self.add_decoder:
            decoder_output, _ = lm_output
            logits = self.lm_head(decoder_output, self.shared_embedding_or_output_weight())
            return logits_or_loss(logits, lm_labels, self.fp16_lm_cross_entropy,
                                  fused=getattr(self.config, "cross_entropy_loss_fusion", False))
        if self.add_decoder and not self.add_encoder:
            decoder_output, _ = lm_output
            return decoder_output
        return lm_output

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """megatron-core's checkpoint keys and sharding (:mod:`megatron.core.models.legacy.sharded`)."""
        from megatron.core.models.legacy.sharded import legacy_sharded_state_dict

        return legacy_sharded_state_dict(self, "t5", prefix, sharded_offsets, metadata)

    def state_dict_for_save_checkpoint(self, prefix="", keep_vars=False):
        state_dict_ = {self._language_model_key: self.language_model.state_dict_for_save_checkpoint(
            prefix=prefix, keep_vars=keep_vars)}
        if self.post_process and self.add_decoder:
            state_dict_[self._lm_head_key] = self.lm_head.state_dict_for_save_checkpoint(prefix=prefix,
                                                                                        keep_vars=keep_vars)
            if not self.pre_process:  # the last stage's copy of the tied embedding
                state_dict_[self._word_embeddings_for_head_key] = self.word_embeddings.state_dict(
                    prefix=prefix, keep_vars=keep_vars)
        return state_dict_
