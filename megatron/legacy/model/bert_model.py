"""megatron.model.bert_model (legacy path): ``BertModel(config, num_tokentypes=2, add_binary_head=True, ...)``."""
from megatron.core.models.common.language_model import logits_or_loss
from megatron.core.models.legacy import bert_model as _bert
from megatron.core.models.legacy.bert_model import bert_extended_attention_mask, bert_position_ids  # noqa: F401


class BertLMHead(_bert.BertLMHead):
    def __init__(self, mpu_vocab_size, hidden_size, config, parallel_output):
        super().__init__(mpu_vocab_size, hidden_size, config, parallel_output)


class BertModel(_bert.BertModel):
    def __init__(self, config, num_tokentypes=2, add_binary_head=True, parallel_output=True, pre_process=True,
                 post_process=True):
        super().__init__(config, num_tokentypes, add_binary_head, parallel_output, pre_process,
                         post_process)


def post_language_model_processing(lm_output, pooled_output, lm_head, binary_head, lm_labels, logit_weights,
                                   fp16_lm_cross_entropy):
    lm_logits = lm_head(lm_output, logit_weights)
    binary_logits = binary_head(pooled_output) if binary_head is not None else None
    return logits_or_loss(lm_logits, lm_labels, fp16_lm_cross_entropy), binary_logits
