"""Pretrain BERT (Megatron-LM's entry point): ``torchrun pretrain_bert.py <Megatron flags>``.

Masked-language-model loss plus, unless ``--bert-no-binary-head``, the sentence-order prediction loss.
"""
from functools import partial

import torch
import torch.nn.functional as F

from megatron.core import tensor_parallel
from megatron.core.enums import ModelType
from megatron.training import get_args, get_timers, pretrain, print_rank_0
from megatron.training.arguments import core_transformer_config_from_args
from megatron.training.datasets_provider import bert_train_valid_test_datasets_provider
from megatron.training.errors import exit_on_configuration_error


def model_provider(pre_process=True, post_process=True):
    """The BERT model of this pipeline stage: megatron-core's BertModel (the legacy one with --use-legacy-models)."""
    args = get_args()
    config = core_transformer_config_from_args(args)
    print_rank_0("building BERT model ...")
    num_tokentypes = 2 if args.bert_binary_head else 0
    if not args.use_legacy_models:
        from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
        from megatron.core.models.bert.bert_model import BertModel

        return BertModel(config=config, num_tokentypes=num_tokentypes, transformer_layer_spec=bert_layer_local_spec,
                         vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                         pre_process=pre_process, post_process=post_process,
                         fp16_lm_cross_entropy=args.fp16_lm_cross_entropy, parallel_output=True,
                         share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                         position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
                         seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor,
                         add_binary_head=args.bert_binary_head, return_embeddings=args.output_bert_embeddings)
    from megatron.legacy.model import BertModel

    return BertModel(config=config, num_tokentypes=num_tokentypes, add_binary_head=args.bert_binary_head,
                     parallel_output=True, pre_process=pre_process, post_process=post_process)


def get_batch(data_iterator):
    """Read a micro-batch on TP rank 0 and broadcast it to the tensor-parallel group."""
    keys = ["text", "types", "labels", "is_random", "loss_mask", "padding_mask"]
    data = next(data_iterator) if data_iterator is not None else None
    b = tensor_parallel.broadcast_data(keys, data, torch.int64)
    return (b["text"].long(), b["types"].long(), b["is_random"].long(), b["loss_mask"].float(),
            b["labels"].long(), b["padding_mask"].long())


def loss_func(loss_mask, sentence_order, output_tensor):
    """(loss sum, number of masked tokens n, report) with report values ``[sum, count]``.

    loss sum = sum of the masked-token MLM losses + (binary head) the sentence-order loss times ``max(n, 1)``,
    so that the schedule's division by ``max(n, 1)`` gives Megatron's ``lm mean + sop mean``; a micro-batch
    without masked tokens contributes zero MLM loss instead of 0/0. Reported: 'lm loss' [MLM sum, n] and
    'sop loss' [sop mean x valid samples, valid samples].
    """
    lm_loss_, sop_logits = output_tensor
    lm_loss_ = lm_loss_.float()
    loss_mask = loss_mask.float().reshape(-1)
    lm_loss = torch.sum(lm_loss_.view(-1) * loss_mask)
    num_tokens = loss_mask.sum().detach().to(torch.int)
    report = {"lm loss": torch.cat([lm_loss.detach().view(1), num_tokens.view(1).float()])}
    if sop_logits is None:
        return lm_loss, num_tokens, report
    sop_loss = F.cross_entropy(sop_logits.view(-1, 2).float(), sentence_order.view(-1), ignore_index=-1)
    num_sentences = (sentence_order.view(-1) != -1).sum().float()
    report["sop loss"] = torch.cat([(sop_loss.detach() * num_sentences).view(1), num_sentences.view(1)])
    loss = lm_loss + sop_loss * num_tokens.clamp(min=1).float()
    return loss, num_tokens, report


def forward_step(data_iterator, model):
    """One micro-batch of BERT."""
    args = get_args()
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    tokens, types, sentence_order, loss_mask, lm_labels, padding_mask = get_batch(data_iterator)
    timers("batch-generator").stop()
    if not args.bert_binary_head:
        types = None
    output_tensor = model(tokens, padding_mask, tokentype_ids=types, lm_labels=lm_labels)
    return output_tensor, partial(loss_func, loss_mask, sentence_order)


def train_valid_test_datasets_provider(train_val_test_num_samples):
    """BERT datasets from --data-path / --split."""
    return bert_train_valid_test_datasets_provider(train_val_test_num_samples)


@exit_on_configuration_error()
def main():
    pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder, forward_step,
             args_defaults={"tokenizer_type": "BertWordPieceLowerCase"})


if __name__ == "__main__":
    main()
