"""megatron.model.gpt_model (legacy path): ``GPTModel(config, num_tokentypes=0, parallel_output=True, ...)``."""
from megatron.core.models.common.language_model import logits_or_loss, parallel_lm_logits
from megatron.core.models.legacy import gpt_model as _gpt


class GPTModel(_gpt.GPTModel):
    def __init__(self, config, num_tokentypes=0, parallel_output=True, pre_process=True, post_process=True):
        super().__init__(config, num_tokentypes, parallel_output, pre_process, post_process)


def post_language_model_processing(lm_output, labels, logit_weights, parallel_output, fp16_lm_cross_entropy):
    from megatron.legacy.model.global_args import args_as_parallel_config

    output = parallel_lm_logits(lm_output, logit_weights, parallel_output, config=args_as_parallel_config())
    return logits_or_loss(output, labels, fp16_lm_cross_entropy)
