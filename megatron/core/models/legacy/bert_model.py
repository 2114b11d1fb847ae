"""Megatron's legacy BERT model API (``megatron.model.BertModel``): pre-LN encoder, MLM head, binary (SOP) head."""
from __future__ import annotations

import torch

from megatron.core import tensor_parallel
from megatron.core.models.common.language_model import (
    get_language_model,
    get_linear_layer,
    logits_or_loss,
    parallel_lm_logits,
)
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.activations import erf_gelu, openai_gelu
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.norms import LayerNorm, param_device


def bert_extended_attention_mask(attention_mask):
    """``[b, s]`` padding mask (1 = token) -> ``[b, 1, s, s]`` boolean mask, True where query or key is padding."""
    attention_mask_b1s = attention_mask.unsqueeze(1)
    attention_mask_bs1 = attention_mask.unsqueeze(2)
    attention_mask_bss = attention_mask_b1s * attention_mask_bs1
    extended_attention_mask = attention_mask_bss.unsqueeze(1)
    return extended_attention_mask < 0.5


def bert_position_ids(token_ids):
    seq_length = token_ids.size(1)
    position_ids = torch.arange(seq_length, dtype=torch.long, device=token_ids.device)
    return position_ids.unsqueeze(0).expand_as(token_ids)


class BertLMHead(MegatronModule):
    """``BertLMHead(mpu_vocab_size, hidden_size, config, parallel_output)``: dense -> gelu -> LayerNorm -> logits
    against the (tied) word embeddings plus a vocabulary-parallel bias."""

    def __init__(self, mpu_vocab_size, hidden_size, config, parallel_output):
        super().__init__(config=config)
        self.bias = torch.nn.Parameter(torch.zeros(mpu_vocab_size, dtype=config.params_dtype,
                                                   device=param_device(config)))
        tensor_parallel.set_tensor_model_parallel_attributes(self.bias, True, 0, 1)
        self.parallel_output = parallel_output
        self.dense = get_linear_layer(hidden_size, hidden_size, config.init_method, config=config)
        # Replicated, but sees different tokens per rank under sequence parallelism: grads need a TP all-reduce.
        setattr(self.dense.weight, "sequence_parallel", config.sequence_parallel)
        setattr(self.dense.bias, "sequence_parallel", config.sequence_parallel)
        self.layernorm = LayerNorm(hidden_size, eps=config.layernorm_epsilon, sequence_parallel=config.sequence_parallel,
                                   params_dtype=config.params_dtype, param_device_=param_device(config))
        self.gelu = torch.nn.functional.gelu
        if config.openai_gelu:
            self.gelu = openai_gelu
        elif config.onnx_safe:
            self.gelu = erf_gelu

    def forward(self, hidden_states, word_embeddings_weight):
        hidden_states = self.dense(hidden_states)
        hidden_states = self.gelu(hidden_states)
        hidden_states = self.layernorm(hidden_states)
        return parallel_lm_logits(hidden_states, word_embeddings_weight, self.parallel_output, bias=self.bias,
                                  config=self.config)


class BertModel(MegatronModule):
    """``BertModel(config, num_tokentypes=2, add_binary_head=True, parallel_output=True, pre_process=True,
    post_process=True)``; ``forward(bert_model_input [b, s], attention_mask [b, s] (1 = token),
    tokentype_ids=None, lm_labels=None)`` -> ``(lm_logits [b, s, V/tp] or lm_loss [b, s], binary_logits [b, 2])``."""

    def __init__(self, config, num_tokentypes=2, add_binary_head=True, parallel_output=True, pre_process=True,
                 post_process=True):
        if config.untie_embeddings_and_output_weights:
            raise ValueError("BertModel does not support --untie-embeddings-and-output-weights")
        super().__init__(config=config)
        self.fp16_lm_cross_entropy = config.fp16_lm_cross_entropy
        self.add_binary_head = add_binary_head
        self.parallel_output = parallel_output
        self.pre_process = pre_process
        self.post_process = post_process
        self.return_embeddings = config.output_bert_embeddings
        if self.return_embeddings:
            assert self.post_process and self.add_binary_head, "--output-bert-embeddings needs the pooler (binary head)"

        self.language_model, self._language_model_key = get_language_model(
            config=config, num_tokentypes=num_tokentypes, add_pooler=self.add_binary_head,
            encoder_attn_mask_type=AttnMaskType.padding, pre_process=self.pre_process,
            post_process=self.post_process)
        self.initialize_word_embeddings()
        if self.post_process:
            self.lm_head = BertLMHead(self.shared_embedding_or_output_weight().size(0), config.hidden_size, config,
                                      parallel_output)
            self._lm_head_key = "lm_head"
            self.binary_head = None
            if self.add_binary_head:
                self.binary_head = get_linear_layer(config.hidden_size, 2, config.init_method, config=config)
                self._binary_head_key = "binary_head"

    def set_input_tensor(self, input_tensor):
        self.language_model.set_input_tensor(input_tensor)

    def forward(self, bert_model_input, attention_mask, tokentype_ids=None, lm_labels=None):
        extended_attention_mask = bert_extended_attention_mask(attention_mask)
        input_ids = bert_model_input
        position_ids = bert_position_ids(input_ids)
        lm_output = self.language_model(input_ids, position_ids, extended_attention_mask, tokentype_ids=tokentype_ids)

        pooled_output = None
        if self.post_process and self.add_binary_head:
            lm_output, pooled_output = lm_output
            if self.return_embeddings:
                return _mean_pooled_embeddings(lm_output, attention_mask)
        if not self.post_process:
            return lm_output

        lm_logits = self.lm_head(lm_output, self.shared_embedding_or_output_weight())
        binary_logits = self.binary_head(pooled_output) if self.binary_head is not None else None
        loss_or_logits = logits_or_loss(lm_logits, lm_labels, self.fp16_lm_cross_entropy,
                                        fused=getattr(self.config, "cross_entropy_loss_fusion", False))
        return loss_or_logits, binary_logits

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """megatron-core's checkpoint keys and sharding (:mod:`megatron.core.models.legacy.sharded`)."""
        from megatron.core.models.legacy.sharded import legacy_sharded_state_dict

        return legacy_sharded_state_dict(self, "bert", prefix, sharded_offsets, metadata)

    def state_dict_for_save_checkpoint(self, prefix="", keep_vars=False):
        state_dict_ = {self._language_model_key: self.language_model.state_dict_for_save_checkpoint(
            prefix=prefix, keep_vars=keep_vars)}
        if self.post_process:
            state_dict_[self._lm_head_key] = self.lm_head.state_dict_for_save_checkpoint(prefix=prefix,
                                                                                        keep_vars=keep_vars)
            if self.add_binary_head:
                state_dict_[self._binary_head_key] = self.binary_head.state_dict(prefix=prefix, keep_vars=keep_vars)
        if self.post_process and not self.pre_process:
            state_dict_[self._word_embeddings_for_head_key] = self.word_embeddings.state_dict(prefix=prefix,
                                                                                            keep_vars=keep_vars)
        return state_dict_


def _mean_pooled_embeddings(lm_output, attention_mask):
    """``--output-bert-embeddings``: per sample, the mean hidden state over its tokens without [CLS] and [SEP]."""
    embeddings = torch.transpose(lm_output, 0, 1)
    masks = torch.sum(attention_mask, dim=1)
    output = torch.zeros(embeddings.shape[0], embeddings.shape[2], dtype=torch.float32, device=embeddings.device)
    for i, (embedding, mask) in enumerate(zip(embeddings, masks)):
        output[i, :] = torch.mean(embedding[1: mask - 1], dim=0)
    return output
