"""Megatron's legacy GPT model API (``megatron.model.GPTModel``) over megatron.core's one transformer."""
from __future__ import annotations

from megatron.core.models.common.language_model import get_language_model, logits_or_loss, parallel_lm_logits
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule


class GPTModel(MegatronModule):
    """``GPTModel(config, num_tokentypes=0, parallel_output=True, pre_process=True, post_process=True)``.

    ``forward(input_ids [b, s], position_ids [b, s], attention_mask (bool, True = masked), ..., labels=None,
    tokentype_ids=None, inference_params=None)`` returns logits ``[b, s, V/tp]`` (``[b, s, V]`` without
    ``parallel_output``), the per-token loss ``[b, s]`` when ``labels`` are given, or the hidden states
    ``[s, b, h]`` on stages other than the last.
    """

    def __init__(self, config, num_tokentypes=0, parallel_output=True, pre_process=True, post_process=True):
        untie = config.untie_embeddings_and_output_weights
        super().__init__(config=config, share_embeddings_and_output_weights=not untie)
        self.parallel_output = parallel_output
        self.pre_process = pre_process
        self.post_process = post_process
        self.fp16_lm_cross_entropy = config.fp16_lm_cross_entropy
        self.untie_embeddings_and_output_weights = untie

        self.language_model, self._language_model_key = get_language_model(
            config=config, num_tokentypes=num_tokentypes, add_pooler=False,
            encoder_attn_mask_type=AttnMaskType.causal, pre_process=self.pre_process,
            post_process=self.post_process)

        if not self.untie_embeddings_and_output_weights:
            self.initialize_word_embeddings()

    def set_input_tensor(self, input_tensor):
        self.language_model.set_input_tensor(input_tensor)

    def forward(self, input_ids, position_ids, attention_mask, retriever_input_ids=None, retriever_position_ids=None,
                retriever_attn_mask=None, labels=None, tokentype_ids=None, inference_params=None):
        lm_output = self.language_model(input_ids, position_ids, attention_mask,
                                        retriever_input_ids=retriever_input_ids,
                                        retriever_position_ids=retriever_position_ids,
                                        retriever_attn_mask=retriever_attn_mask, tokentype_ids=tokentype_ids,
                                        inference_params=inference_params)
        if not self.post_process:
            return lm_output
        weight = (self.language_model.output_layer.weight if self.untie_embeddings_and_output_weights
                  else self.shared_embedding_or_output_weight())
        logits = parallel_lm_logits(lm_output, weight, self.parallel_output, config=self.config)
        return logits_or_loss(logits, labels, self.fp16_lm_cross_entropy,
                              fused=getattr(self.config, "cross_entropy_loss_fusion", False))

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """megatron-core's checkpoint keys and sharding (:mod:`megatron.core.models.legacy.sharded`)."""
        from megatron.core.models.legacy.sharded import legacy_sharded_state_dict

        return legacy_sharded_state_dict(self, "gpt", prefix, sharded_offsets, metadata)

    def state_dict_for_save_checkpoint(self, prefix="", keep_vars=False):
        state_dict_ = {self._language_model_key: self.language_model.state_dict_for_save_checkpoint(
            prefix=prefix, keep_vars=keep_vars)}
        # The last stage's copy of the tied embedding.
        if self.post_process and not self.pre_process and not self.untie_embeddings_and_output_weights:
            state_dict_[self._word_embeddings_for_head_key] = self.word_embeddings.state_dict(prefix=prefix,
                                                                                            keep_vars=keep_vars)
        return state_dict_
