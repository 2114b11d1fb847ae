"""megatron-core's BertModel (``megatron.core.models.bert.BertModel``) over the one transformer implementation.

Same computation as Megatron's legacy ``BertModel`` with megatron-core names: ``embedding``, ``encoder``,
``pooler``, ``lm_head.{dense,layer_norm}``, ``output_layer`` (its ``bias`` is the legacy ``lm_head.bias``),
``binary_head``.
"""
from __future__ import annotations

import torch

from megatron.core import tensor_parallel
from megatron.core.enums import ModelType
from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
from megatron.core.models.common.embedding import LanguageModelEmbedding
from megatron.core.models.common.language_model import Pooler, get_linear_layer
from megatron.core.models.gpt.gpt_model import LanguageModule
from megatron.core.models.legacy.bert_model import _mean_pooled_embeddings, bert_extended_attention_mask, bert_position_ids
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.norms import LayerNorm, param_device
from megatron.core.transformer.rotary import RotaryEmbedding
from megatron.core.transformer.transformer_block import TransformerBlock


class BertLMHead(MegatronModule):
    """megatron-core: ``BertLMHead(hidden_size, config)``: dense -> gelu -> LayerNorm (logits in ``output_layer``)."""

    def __init__(self, hidden_size, config):
        super().__init__(config=config)
        self.dense = get_linear_layer(hidden_size, hidden_size, config.init_method, config=config)
        setattr(self.dense.weight, "sequence_parallel", config.sequence_parallel)
        setattr(self.dense.bias, "sequence_parallel", config.sequence_parallel)
        self.layer_norm = LayerNorm(hidden_size, eps=config.layernorm_epsilon, sequence_parallel=config.sequence_parallel,
                                    params_dtype=config.params_dtype, param_device_=param_device(config))
        self.gelu = torch.nn.functional.gelu

    def forward(self, hidden_states):
        return self.layer_norm(self.gelu(self.dense(hidden_states)))


class BertModel(LanguageModule):
    """``BertModel(config, num_tokentypes, transformer_layer_spec, vocab_size, max_sequence_length, pre_process=True,
    post_process=True, fp16_lm_cross_entropy=False, parallel_output=True, share_embeddings_and_output_weights=False,
    position_embedding_type='learned_absolute', rotary_percent=1.0, seq_len_interpolation_factor=None,
    add_binary_head=True, return_embeddings=False, vp_stage=None, pg_collection=None)``; ``forward(input_ids, attention_mask, tokentype_ids=None,
    lm_labels=None, inference_params=None) -> (logits or loss, binary_logits)``."""

    def __init__(self, config, num_tokentypes, transformer_layer_spec=None, vocab_size=None, max_sequence_length=None,
                 pre_process=True, post_process=True, fp16_lm_cross_entropy=False, parallel_output=True,
                 share_embeddings_and_output_weights=False, position_embedding_type="learned_absolute",
                 rotary_percent=1.0, seq_len_interpolation_factor=None, add_binary_head=True, return_embeddings=False,
                 vp_stage=None, pg_collection=None):
        # The collection's groups (else parallel_state's): ``tp`` splits the vocabulary and every layer, ``pp`` places
        # the stage's layers, ``embd`` ties the first and last stage's word embeddings.
        super().__init__(config, pg_collection, share_embeddings_and_output_weights=share_embeddings_and_output_weights)
        if vocab_size is None:
            raise ValueError("BertModel needs vocab_size")
        if return_embeddings:
            assert post_process and add_binary_head, "return_embeddings needs post_process and add_binary_head"
        self.pre_process = pre_process
        self.post_process = post_process
        self.fp16_lm_cross_entropy = fp16_lm_cross_entropy
        self.parallel_output = parallel_output
        self.position_embedding_type = position_embedding_type
        self.add_binary_head = add_binary_head
        self.return_embeddings = return_embeddings
        self.model_type = ModelType.encoder_or_decoder
        spec = transformer_layer_spec if transformer_layer_spec is not None else bert_layer_local_spec

        if self.pre_process:
            self.embedding = LanguageModelEmbedding(config, vocab_size, max_sequence_length,
                                                    position_embedding_type=position_embedding_type,
                                                    num_tokentypes=num_tokentypes, tp_group=self.tp_group)
        if position_embedding_type == "rope":
            self.rotary_pos_emb = RotaryEmbedding(config.kv_channels, rotary_percent,
                                                  rotary_interleaved=config.rotary_interleaved,
                                                  seq_len_interpolation_factor=seq_len_interpolation_factor)
        self.encoder = TransformerBlock(config, spec=spec, pre_process=pre_process, post_process=post_process,
                                        pg_collection=pg_collection, vp_stage=vp_stage)
        if self.post_process:
            self.lm_head = BertLMHead(config.hidden_size, config)
            self.output_layer = tensor_parallel.ColumnParallelLinear(
                config.hidden_size, vocab_size, config=config, init_method=config.init_method, bias=True,
                skip_bias_add=False, gather_output=not self.parallel_output,
                skip_weight_param_allocation=pre_process and share_embeddings_and_output_weights,
                tp_group=self.tp_group, reuse_cpu_output_buffer=True)
            self.binary_head = None
            if self.add_binary_head:
                self.binary_head = get_linear_layer(config.hidden_size, 2, config.init_method, config=config)
                self.pooler = Pooler(config.hidden_size, config.init_method, config=config)
        if self.pre_process or self.post_process:
            self.setup_embeddings_and_output_layer()

    def set_input_tensor(self, input_tensor):
        if not isinstance(input_tensor, list):
            input_tensor = [input_tensor]
        assert len(input_tensor) == 1, "input_tensor should only be length 1 for bert"
        self.encoder.set_input_tensor(input_tensor[0])

    def forward(self, input_ids, attention_mask, tokentype_ids=None, lm_labels=None, inference_params=None):
        extended_attention_mask = bert_extended_attention_mask(attention_mask)
        hidden_states = None
        if self.pre_process:
            hidden_states = self.embedding(input_ids=input_ids, position_ids=bert_position_ids(input_ids),
                                           tokentype_ids=tokentype_ids)
        rotary_pos_emb = None
        if self.position_embedding_type == "rope":
            rotary_pos_emb = self.rotary_pos_emb(input_ids.size(1))
        hidden_states = self.encoder(hidden_states, extended_attention_mask, inference_params=inference_params,
                                     rotary_pos_emb=rotary_pos_emb)
        if not self.post_process:
            return hidden_states
        pooled_output = self.pooler(hidden_states, 0) if self.add_binary_head else None
        if self.return_embeddings:
            return _mean_pooled_embeddings(hidden_states, attention_mask)
        output_weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        logits, _ = self.output_layer(self.lm_head(hidden_states), weight=output_weight)
        binary_logits = self.binary_head(pooled_output) if self.binary_head is not None else None
        if lm_labels is None:
            return logits.transpose(0, 1).contiguous(), binary_logits
        return self.compute_language_model_loss(lm_labels, logits), binary_logits
