"""Build the GPT of this rank from Megatron's flags and load ``--load`` into it (server and one-shot tools)."""
from __future__ import annotations

from megatron.core import parallel_state


def add_text_generate_args(parser):
    """Megatron's text-generation flags, plus ``--port``/``--host`` of the server and ``--prompt``."""
    group = parser.add_argument_group(title="text generation")
    group.add_argument("--temperature", type=float, default=1.0, help="Sampling temperature.")
    group.add_argument("--top_p", type=float, default=0.0, help="Top p sampling.")
    group.add_argument("--top_k", type=int, default=0, help="Top k sampling.")
    group.add_argument("--out-seq-length", type=int, default=1024, help="Size of the output generated text.")
    group.add_argument("--port", type=int, default=5000, help="HTTP port of the text generation server.")
    group.add_argument("--host", type=str, default="0.0.0.0", help="Address the server listens on.")
    group.add_argument("--prompt", type=str, action="append", default=None,
                       help="tools/generate_text.py: a prompt to complete (repeat for several).")
    group.add_argument("--greedy", action="store_true", help="tools/generate_text.py: argmax decoding.")
    # The checkpoint's format is read from --load (torch_dist, pretrain_gpt.py's default, or torch).
    parser.set_defaults(auto_detect_ckpt_format=True)
    return parser


def model_provider(pre_process=True, post_process=True):
    """The GPT that pretrain_gpt.py builds (megatron-core's, or the legacy one with --use-legacy-models), with
    full-vocabulary logits (``parallel_output=False``), as for inference."""
    from megatron.training import get_args, print_rank_0
    from megatron.training.arguments import core_transformer_config_from_args

    args = get_args()
    config = core_transformer_config_from_args(args)
    print_rank_0("building GPT model ...")
    if not args.use_legacy_models:
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(qk_layernorm=args.qk_layernorm),
                        vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                        pre_process=pre_process, post_process=post_process, parallel_output=False,
                        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                        position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
                        rotary_base=args.rotary_base, rope_scaling=args.use_rope_scaling,
                        rope_scaling_factor=args.rope_scaling_factor,
                        seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor)
    from megatron.legacy.model import GPTModel

    return GPTModel(config, num_tokentypes=0, parallel_output=False, pre_process=pre_process,
                    post_process=post_process)


def initialize_and_load(argv=None):
    """``initialize_megatron`` with the generation flags, then the model with ``--load`` applied (or random
    weights without ``--load``). Returns the model (one chunk)."""
    from megatron.training import get_args, get_model, initialize_megatron, print_rank_0
    from megatron.training.checkpointing import load_checkpoint
    from megatron.training.errors import ConfigurationError

    initialize_megatron(extra_args_provider=add_text_generate_args,
                        args_defaults={"tokenizer_type": "GPT2BPETokenizer", "no_load_rng": True,
                                       "no_load_optim": True, "micro_batch_size": 1},
                        argv=argv)
    args = get_args()
    if args.virtual_pipeline_model_parallel_size is not None:
        raise ConfigurationError("Interleaved pipeline schedule is not yet supported for text generation: drop "
                                 "--num-layers-per-virtual-pipeline-stage (the checkpoint loads without it)")
    model = get_model(model_provider, wrap_with_ddp=False)
    if args.load is not None:
        load_checkpoint(model, None, None, strict=True)
    else:
        print_rank_0("WARNING: no --load given: generating from randomly initialised weights")
    assert len(model) == 1
    model[0].eval()
    return model[0]


def is_driver_rank() -> bool:
    """Global rank 0 (first pipeline stage, TP rank 0) drives generation and serves HTTP."""
    return parallel_state.is_pipeline_first_stage() and parallel_state.get_tensor_model_parallel_rank() == 0 \
        and parallel_state.get_data_parallel_rank() == 0
