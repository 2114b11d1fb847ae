"""megatron.model.language_model (legacy path): legacy signatures; the free functions read the parallelism
flags (sequence parallel, async all-reduce, gradient fusion) from the global args."""
from megatron.core.models.common import embedding as _emb
from megatron.core.models.common import language_model as _lm
from megatron.core.transformer.enums import AttnMaskType
from megatron.legacy.model.global_args import args_as_parallel_config


def parallel_lm_logits(input_, word_embeddings_weight, parallel_output, bias=None):
    """Legacy signature; the sequence-parallel / async-allreduce / grad-fusion flags come from the global args."""
    return _lm.parallel_lm_logits(input_, word_embeddings_weight, parallel_output, bias,
                                  config=args_as_parallel_config())


class Pooler(_lm.Pooler):
    def __init__(self, hidden_size, init_method):
        super().__init__(hidden_size, init_method, config=None)
        self.sequence_parallel = args_as_parallel_config().sequence_parallel


class Embedding(_emb.Embedding):
    def __init__(self, hidden_size, vocab_size, max_sequence_length, embedding_dropout_prob, config, num_tokentypes=0,
                 embedding_weights_in_fp32=False):
        super().__init__(hidden_size, vocab_size, max_sequence_length, embedding_dropout_prob, config,
                         num_tokentypes, embedding_weights_in_fp32)


class TransformerLanguageModel(_lm.TransformerLanguageModel):
    def __init__(self, config, encoder_attn_mask_type, num_tokentypes=0, add_encoder=True, add_decoder=False,
                 decoder_attn_mask_type=AttnMaskType.causal, add_pooler=False, pre_process=True, post_process=True):
        super().__init__(config, encoder_attn_mask_type, num_tokentypes, add_encoder, add_decoder,
                         decoder_attn_mask_type, add_pooler, pre_process, post_process)


def get_language_model(config, num_tokentypes, add_pooler, encoder_attn_mask_type, add_encoder=True, add_decoder=False,
                       decoder_attn_mask_type=AttnMaskType.causal, pre_process=True, post_process=True):
    return _lm.get_language_model(config, num_tokentypes, add_pooler, encoder_attn_mask_type,
                                  add_encoder, add_decoder, decoder_attn_mask_type, pre_process, post_process)
