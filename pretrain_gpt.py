"""Pretrain GPT (Megatron-LM's entry point): ``torchrun pretrain_gpt.py <Megatron flags>``."""
from functools import partial

import torch

from megatron.core import tensor_parallel
from megatron.core.enums import ModelType
from megatron.core.utils import get_batch_on_this_cp_rank
from megatron.post_training.arguments import add_modelopt_args
from megatron.training import get_args, get_timers, pretrain, print_rank_0
from megatron.training.arguments import core_transformer_config_from_args
from megatron.training.datasets_provider import gpt_train_valid_test_datasets_provider
from megatron.training.errors import exit_on_configuration_error


def model_provider(pre_process=True, post_process=True):
    """The GPT model of this pipeline stage: megatron-core's GPTModel (the legacy one with --use-legacy-models)."""
    args = get_args()
    if args.is_hybrid_model:  # --hybrid-layer-pattern: megatron-core's MambaModel (as pretrain_mamba.py builds)
        from megatron.training.models.hybrid import hybrid_model_provider

        return hybrid_model_provider(pre_process, post_process)
    config = core_transformer_config_from_args(args)
    print_rank_0("building GPT model ...")
    if not args.use_legacy_models:
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_decoder_block_spec,
            get_gpt_layer_local_spec,
            get_gpt_mtp_block_spec,
        )

        if getattr(config, "heterogeneous_block_specs", False):  # --heterogeneous-layers-config-path
            from megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs import (
                get_gpt_heterogeneous_layer_spec)

            layer_spec = get_gpt_heterogeneous_layer_spec(config, use_te=False)
        elif config.experimental_attention_variant is not None:  # Gated DeltaNet / DeepSeek sparse attention
            from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
                get_transformer_block_with_experimental_attention_variant_spec)

            layer_spec = get_transformer_block_with_experimental_attention_variant_spec(config)
        elif args.num_experts:
            layer_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
        else:
            layer_spec = get_gpt_layer_local_spec(qk_layernorm=args.qk_layernorm,
                                                  multi_latent_attention=args.multi_latent_attention)
        return GPTModel(config=config, transformer_layer_spec=layer_spec,
                        vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                        pre_process=pre_process, post_process=post_process,
                        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy, parallel_output=True,
                        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                        position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
                        rotary_base=args.rotary_base, rope_scaling=args.use_rope_scaling,
                        rope_scaling_factor=args.rope_scaling_factor,
                        seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor,
                        mtp_block_spec=get_gpt_mtp_block_spec(config, layer_spec))
    from megatron.legacy.model import GPTModel

    return GPTModel(config, num_tokentypes=0, parallel_output=True, pre_process=pre_process,
                    post_process=post_process)


def get_batch(data_iterator):
    """Read a micro-batch on TP rank 0, broadcast it to the rest of the tensor-parallel group, and keep this
    context-parallel rank's chunks of every sequence (megatron.core.utils.get_batch_on_this_cp_rank)."""
    args = get_args()
    data = next(data_iterator) if data_iterator is not None else None
    ints = tensor_parallel.broadcast_data(["tokens", "labels", "position_ids"], data, torch.int64)
    floats = tensor_parallel.broadcast_data(["loss_mask"], data, torch.float32)
    attention_mask = None
    if args.reset_attention_mask:
        # Document-level masks differ per sample; otherwise the model applies the causal mask itself.
        mask = {"attention_mask": data["attention_mask"].to(torch.int64)} if data is not None else None
        attention_mask = tensor_parallel.broadcast_data(["attention_mask"], mask, torch.int64)["attention_mask"].bool()
    batch = get_batch_on_this_cp_rank({"tokens": ints["tokens"], "labels": ints["labels"],
                                       "loss_mask": floats["loss_mask"], "attention_mask": attention_mask,
                                       "position_ids": ints["position_ids"]})
    return batch["tokens"], batch["labels"], batch["loss_mask"], batch["attention_mask"], batch["position_ids"]


def loss_func(loss_mask, output_tensor):
    """(sum of the masked per-token losses, number of unmasked tokens, {'lm loss': [sum, count]}).

    The schedule turns the sum into the micro-batch's token mean (or, with --calculate-per-token-loss, lets
    finalize_model_grads divide by the global token count); the log reports sum / count over the global batch.
    """
    losses = output_tensor.float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses.view(-1) * loss_mask)
    num_tokens = loss_mask.sum().detach().to(torch.int)
    reporting_loss = torch.cat([loss.detach().view(1), num_tokens.view(1).float()])
    return loss, num_tokens, {"lm loss": reporting_loss}


def forward_step(data_iterator, model):
    """One micro-batch: the schedule calls ``loss_func(output_tensor)`` on the last stage."""
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)
    timers("batch-generator").stop()
    # Multi-token prediction weights its losses with the loss mask (megatron-core models).
    extra = {"loss_mask": loss_mask} if get_args().mtp_num_layers else {}
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels, **extra)
    return output_tensor, partial(loss_func, loss_mask)


def train_valid_test_datasets_provider(train_val_test_num_samples):
    """GPT datasets from --data-path / --split (or --mock-data)."""
    return gpt_train_valid_test_datasets_provider(train_val_test_num_samples)


@exit_on_configuration_error()
def main():
    # Megatron-LM adds its ModelOpt flags here when ModelOpt is installed; they need no ModelOpt in this library.
    pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder, forward_step,
             extra_args_provider=add_modelopt_args, args_defaults={"tokenizer_type": "GPT2BPETokenizer"})


if __name__ == "__main__":
    main()
