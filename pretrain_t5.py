"""Pretrain T5 (Megatron-LM's entry point): ``torchrun pretrain_t5.py <Megatron flags>``.

Span-corruption loss of an encoder-decoder transformer: per micro-batch ``sum(loss * loss_mask) / sum(loss_mask)``
over the decoder positions (the schedule divides the returned sum by the token count). megatron-core's T5Model by
default, the legacy ``megatron.model.T5Model`` with ``--use-legacy-models``; ``--pipeline-model-parallel-split-rank``
puts the encoder on the stages before it and the decoder on the others.
"""
import dataclasses
from functools import partial

import torch

from megatron.core import tensor_parallel
from megatron.core.datasets.t5_dataset import T5MaskedWordPieceDataset
from megatron.core.enums import ModelType
from megatron.training import get_args, get_timers, pretrain, print_rank_0
from megatron.training.arguments import core_transformer_config_from_args
from megatron.training.datasets_provider import t5_train_valid_test_datasets_provider
from megatron.training.errors import exit_on_configuration_error


def model_provider(pre_process=True, post_process=True, add_encoder=True, add_decoder=True):
    """The T5 model of this pipeline stage."""
    args = get_args()
    config = core_transformer_config_from_args(args)
    print_rank_0("building T5 model ...")
    if args.use_legacy_models:
        from megatron.legacy.model import T5Model

        return T5Model(config=config, num_tokentypes=0, parallel_output=True, pre_process=pre_process,
                       post_process=post_process, add_encoder=add_encoder, add_decoder=add_decoder)
    from megatron.core.models.T5 import T5Model
    from megatron.core.models.T5.t5_spec import (get_t5_decoder_with_local_block_spec,
                                                 get_t5_decoder_with_transformer_engine_block_spec,
                                                 get_t5_encoder_with_local_block_spec,
                                                 get_t5_encoder_with_transformer_engine_block_spec)

    encoder_config = config
    # The decoder has --decoder-num-layers layers (default: the encoder's --num-layers).
    decoder_layers = args.decoder_num_layers if args.decoder_num_layers is not None else args.num_layers
    decoder_config = dataclasses.replace(config, num_layers=decoder_layers) if decoder_layers != config.num_layers \
        else config
    if args.transformer_impl == "transformer_engine":
        encoder_spec = get_t5_encoder_with_transformer_engine_block_spec(args.num_layers)
        decoder_spec = get_t5_decoder_with_transformer_engine_block_spec(decoder_layers)
    else:
        encoder_spec = get_t5_encoder_with_local_block_spec(args.num_layers)
        decoder_spec = get_t5_decoder_with_local_block_spec(decoder_layers)
    return T5Model(config=decoder_config, encoder_config=encoder_config, transformer_encoder_layer_spec=encoder_spec,
                   transformer_decoder_layer_spec=decoder_spec, vocab_size=args.padded_vocab_size,
                   max_sequence_length=args.max_position_embeddings, pre_process=pre_process,
                   post_process=post_process, fp16_lm_cross_entropy=args.fp16_lm_cross_entropy, parallel_output=True,
                   share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                   position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
                   seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor,
                   add_encoder=add_encoder, add_decoder=add_decoder)


def get_batch(data_iterator):
    """Read a micro-batch on TP rank 0, broadcast it over the tensor-parallel group and build the masks.

    Returns ``tokens_enc, tokens_dec, loss_mask, labels, enc_mask, dec_mask, enc_dec_mask``; masks are boolean,
    True = masked: ``[b,1,se,se]``, ``[b,1,sd,sd]``, ``[b,1,sd,se]`` (``[b,s,s]`` for the legacy model).
    """
    keys = ["text_enc", "text_dec", "labels", "loss_mask", "enc_mask", "dec_mask"]
    data = next(data_iterator) if data_iterator is not None else None
    b = tensor_parallel.broadcast_data(keys, data, torch.int64)
    tokens_enc, tokens_dec = b["text_enc"].long(), b["text_dec"].long()
    labels, loss_mask = b["labels"].long(), b["loss_mask"].float()
    enc_mask, dec_mask, enc_dec_mask = T5MaskedWordPieceDataset.config_attention_mask(
        tokens_enc, tokens_dec, b["enc_mask"] < 0.5, b["dec_mask"] < 0.5, use_local=True)
    if get_args().use_legacy_models:
        enc_mask, dec_mask, enc_dec_mask = enc_mask[:, 0], dec_mask[:, 0], enc_dec_mask[:, 0]
    return tokens_enc, tokens_dec, loss_mask, labels, enc_mask, dec_mask, enc_dec_mask


def loss_func(loss_mask, output_tensor):
    """(sum of the masked per-token losses, number of loss tokens, {'lm loss': [sum, count]})."""
    losses = output_tensor.float().reshape(-1)
    loss_mask = loss_mask.reshape(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.detach().view(1), num_tokens.view(1).float()])}


def forward_step(data_iterator, model):
    """One micro-batch of T5."""
    timers = get_timers()
    timers("batch generator", log_level=2).start()
    tokens_enc, tokens_dec, loss_mask, lm_labels, enc_mask, dec_mask, enc_dec_mask = get_batch(data_iterator)
    timers("batch generator").stop()
    output_tensor = model(tokens_enc, tokens_dec, enc_mask, dec_mask, enc_dec_mask, lm_labels=lm_labels)
    return output_tensor, partial(loss_func, loss_mask)


def train_valid_test_datasets_provider(train_val_test_num_samples):
    """T5 datasets from --data-path / --split (span corruption, --encoder-seq-length / --decoder-seq-length)."""
    return t5_train_valid_test_datasets_provider(train_val_test_num_samples)



@exit_on_configuration_error()
def main():
    pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_and_decoder, forward_step,
             args_defaults={"tokenizer_type": "BertWordPieceLowerCase"})


if __name__ == "__main__":
    main()
