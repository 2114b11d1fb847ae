"""Helpers for the generation tests: a tiny GPT with layout-independent weights inside a dist_harness rank."""
from __future__ import annotations

import os

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

NUM_LAYERS = 4
TINY_GPT = [
    "--num-layers", str(NUM_LAYERS), "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "64",
    "--max-position-embeddings", "64", "--micro-batch-size", "1", "--hidden-dropout", "0.0",
    "--attention-dropout", "0.0", "--seed", "1234", "--tokenizer-type", "GPT2BPETokenizer",
    "--vocab-file", os.path.join(REPO, "data/tokenizers/gpt2/vocab.json"),
    "--merge-file", os.path.join(REPO, "data/tokenizers/gpt2/merges.txt"), "--distributed-backend", "gloo",
]
PROMPTS = ["The quick brown fox", "def open(path):\n    return"]


def build_tiny_gpt(tp=1, pp=1, parallel_output=True, extra=()):
    """initialize_megatron + this rank's GPT chunk, every parameter set from its global name (same weights in
    every TP/PP layout). ``parallel_output=True`` keeps vocab-parallel logits so the generator must gather."""
    from helpers.train_helpers import deterministic_init

    from megatron.inference.checkpoint_model import add_text_generate_args
    from megatron.training import get_model, initialize_megatron

    initialize_megatron(extra_args_provider=add_text_generate_args,
                        argv=TINY_GPT + ["--tensor-model-parallel-size", str(tp),
                                         "--pipeline-model-parallel-size", str(pp), *extra])

    def provider(pre_process=True, post_process=True):
        # The model pretrain_gpt.py builds (megatron-core's GPTModel unless --use-legacy-models is in extra).
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.legacy.model import GPTModel as LegacyGPTModel
        from megatron.training import get_args
        from megatron.training.arguments import core_transformer_config_from_args

        args = get_args()
        config = core_transformer_config_from_args(args)
        if args.use_legacy_models:
            return LegacyGPTModel(config, parallel_output=parallel_output, pre_process=pre_process,
                                  post_process=post_process)
        return GPTModel(config, get_gpt_layer_local_spec(), args.padded_vocab_size, args.max_position_embeddings,
                        pre_process=pre_process, post_process=post_process, parallel_output=parallel_output,
                        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights)

    model = get_model(provider, wrap_with_ddp=False)[0]
    deterministic_init(model, NUM_LAYERS)
    return model.eval()


def full_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """Unsharded single-rank reference: logits ``[b, s, V]`` of the whole sequence, no KV cache."""
    from megatron.core.transformer.fusions import causal_mask

    seq = tokens.size(1)
    position_ids = torch.arange(seq).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        return model(tokens, position_ids, causal_mask(seq, seq)).float()
