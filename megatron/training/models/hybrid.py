"""The hybrid Mamba model of the command line (``--hybrid-layer-pattern``): megatron-core's ``MambaModel`` with the
local ``mamba_stack_spec``. Used by ``pretrain_mamba.py`` (and ``pretrain_gpt.py`` when the pattern is given)."""
from __future__ import annotations

from megatron.training.arguments import core_transformer_config_from_args
from megatron.training.errors import ConfigurationError
from megatron.training.global_vars import get_args
from megatron.training.utils import print_rank_0


def hybrid_model_provider(pre_process: bool = True, post_process: bool = True, vp_stage=None):
    """This pipeline stage's (and virtual chunk's) ``MambaModel``."""
    from megatron.core.models.mamba import MambaModel
    from megatron.core.models.mamba.mamba_layer_specs import get_mamba_stack_spec

    args = get_args()
    if not args.hybrid_layer_pattern:
        raise ConfigurationError("a hybrid Mamba model needs --hybrid-layer-pattern (one character per layer: "
                                 "M Mamba, * attention, - MLP, E MoE)")
    config = core_transformer_config_from_args(args)
    print_rank_0(f"building hybrid Mamba model ({args.hybrid_layer_pattern}) ...")
    return MambaModel(config=config, mamba_stack_spec=get_mamba_stack_spec(args.moe_grouped_gemm),
                      vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                      pre_process=pre_process, post_process=post_process,
                      fp16_lm_cross_entropy=args.fp16_lm_cross_entropy, parallel_output=True,
                      share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                      position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
                      rotary_base=args.rotary_base,
                      seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor,
                      vp_stage=vp_stage, hybrid_layer_pattern=args.hybrid_layer_pattern)
