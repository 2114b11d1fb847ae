"""TransformerConfig: the shape and numerics of a transformer, with Megatron's fields and rules."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F

from megatron.core.config_cli import flag
from megatron.core.fp8_utils import fp8_recipe_from_config
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.transformer.enums import AttnBackend
from megatron.core.utils import init_method_normal, scaled_init_method_normal


RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")


def check_recompute_modules(modules, moe_grouped_gemm: bool, multi_latent_attention: bool = False) -> None:
    """ValueError unless every name of ``modules`` (selective recompute) is one this library recomputes."""
    invalid = [m for m in modules if m not in RECOMPUTE_MODULES]
    if invalid:
        raise ValueError(f"--recompute-modules: invalid choices {invalid}; allowed: {', '.join(RECOMPUTE_MODULES)}")
    if "moe_act" in modules and not moe_grouped_gemm:
        raise ValueError("--recompute-modules moe_act is only supported with --moe-grouped-gemm")
    if "mla_up_proj" in modules and not multi_latent_attention:
        raise ValueError("--recompute-modules mla_up_proj recomputes multi-latent attention's up projections: it "
                         "needs --multi-latent-attention")


def _as_list(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def check_moe_routing(load_balancing_type, aux_loss_coeff, topk: int, score_function: str, pre_softmax: bool) -> None:
    """ValueError for routing settings megatron-core refuses: sinkhorn with another balancing type or an aux loss,
    and top-1 softmax routing without pre-softmax (the softmax over one logit has a zero gradient)."""
    types = _as_list(load_balancing_type)
    if "sinkhorn" in types and (types != ["sinkhorn"] or any(_as_list(aux_loss_coeff))):
        raise ValueError("--moe-router-load-balancing-type sinkhorn balances without an aux loss: use it alone, with "
                         "--moe-aux-loss-coeff 0")
    if topk == 1 and score_function == "softmax" and not pre_softmax and "sinkhorn" not in types:
        raise ValueError("--moe-router-topk 1 with softmax scores takes the softmax over one logit, whose gradient is "
                         "zero: pass --moe-router-pre-softmax (as Megatron requires)")


def is_layer_window_attention(window_size: Optional[Tuple[int, int]], window_attn_skip_freq: Union[int, List[int], None],
                              layer_number: int) -> bool:
    """Whether layer ``layer_number`` (1-based) uses sliding-window attention: never without ``window_size``;
    every layer when ``window_attn_skip_freq`` is None; with an int N the layers whose number is not a multiple of
    N; with a list, the layers whose entry is truthy (entry ``layer_number - 1``)."""
    if not window_size:
        return False
    if window_attn_skip_freq is None:
        return True
    if isinstance(window_attn_skip_freq, int):
        return layer_number % window_attn_skip_freq != 0
    if isinstance(window_attn_skip_freq, (list, tuple)):
        return bool(window_attn_skip_freq[layer_number - 1])
    raise ValueError(f"window_attn_skip_freq must be None, an int or a list, got {window_attn_skip_freq!r}")


@dataclass
class TransformerConfig(ModelParallelConfig):
    """Transformer settings; derived sizes are filled and contradictions rejected in ``__post_init__``."""

    # Model architecture
    num_layers: int = flag(0, "Number of transformer layers.", default=None)
    hidden_size: int = flag(0, "Transformer hidden size.", default=None)
    num_attention_heads: int = flag(0, "Number of attention heads.", default=None)
    num_query_groups: Optional[int] = flag(None, "Number of key/value groups with --group-query-attention.",
                                                 default=1)
    ffn_hidden_size: Optional[int] = flag(None, "Hidden size of the MLP; 4 * hidden-size if not given (2/3 of that, "
                                                "rounded down to a multiple of 64, with --swiglu).")
    kv_channels: Optional[int] = flag(None, "Projection size per attention head; hidden-size // num-attention-heads "
                                            "if not given.")
    hidden_dropout: float = flag(0.1, "Dropout on the hidden states.")
    attention_dropout: float = flag(0.1, "Dropout after the attention softmax.")
    fp32_residual_connection: bool = flag(False, "Keep the residual connection in fp32.")
    apply_residual_connection_post_layernorm: bool = flag(False, "Take the residual from after the layer norm "
                                                                 "(original BERT).")
    layernorm_epsilon: float = flag(1e-5, "Epsilon of every LayerNorm / RMSNorm (today's spelling; "
                                          "--layernorm-epsilon is the 2023 one).",
                                          arg_names=("--norm-epsilon", "--layernorm-epsilon",))
    layernorm_zero_centered_gamma: bool = flag(False, "Zero-centred layer-norm gamma (weight + 1), for numerical "
                                                      "stability.", arg_names=("--apply-layernorm-1p",))
    add_bias_linear: bool = flag(True, "Drop the biases of the linear layers.", arg_names=("--disable-bias-linear",))
    gated_linear_unit: bool = False
    activation_func: Callable = F.gelu

    # Initialization
    init_method: Optional[Callable] = None
    output_layer_init_method: Optional[Callable] = None
    init_method_std: float = flag(0.02, "Standard deviation of the normal weight initialisation.")
    # Build the weights on the meta device (no storage); the fully sharded wrapper draws them unit by unit, the
    # same values as without it (megatron/core/distributed/fsdp/meta_init.py).
    init_model_with_meta_device: bool = flag(False, "Build the model on the meta device and draw the weights "
                                                    "shard by shard (Megatron-FSDP or FSDP2; the same weights as "
                                                    "without it), so that no rank ever holds the whole model.")

    # Mixed precision
    apply_query_key_layer_scaling: bool = flag(True, "Scale Q * K^T by 1 / layer-number before the softmax and back "
                                                     "after it (computes the softmax in fp32).", default=False)
    attention_softmax_in_fp32: bool = True

    # Fusions
    bias_gelu_fusion: bool = False
    masked_softmax_fusion: bool = False
    persist_layer_norm: bool = False
    bias_dropout_fusion: bool = False
    # megatron-core's newer fusion fields (--bias-swiglu-fusion, --no-rope-fusion, --cross-entropy-loss-fusion):
    # bias + SwiGLU of a gated MLP, rotary embedding, vocab-parallel cross entropy as torch.compile'd kernels.
    bias_activation_fusion: bool = False
    apply_rope_fusion: bool = False
    cross_entropy_loss_fusion: bool = flag(False, "Fused vocab-parallel cross entropy (compiled kernels, one "
                                                  "all-reduce).")

    # Activation recomputation
    recompute_granularity: Optional[str] = flag(None, "Recompute whole transformer layers (full) or the parts "
                                                      "--recompute-modules names (selective).",
                                                      choices=("full", "selective"))
    recompute_method: Optional[str] = flag(None, "uniform: recompute groups of layers; block: recompute the first "
                                                 "layers of each stage.", choices=("uniform", "block"))
    recompute_num_layers: Optional[int] = flag(None, "Layers per recompute group (uniform) or recomputed layers per "
                                                     "stage (block); needed with --recompute-granularity full.")
    distribute_saved_activations: Optional[bool] = flag(None, "Split recomputed activations across the "
                                                              "tensor-parallel group.", default=False)
    # Selective recompute (recompute_granularity="selective"): what each layer recomputes in backward instead of
    # keeping its activations. None means ["core_attn"]; see _validate_recompute_modules.
    recompute_modules: Optional[List[str]] = flag(None, "With --recompute-granularity selective: what each layer "
                                                        "recomputes in backward, any of core_attn (default), mlp, "
                                                        "moe, shared_experts, moe_act (with --moe-grouped-gemm), "
                                                        "layernorm, mla_up_proj (with --multi-latent-attention).",
                                                  nargs="*")

    # FP8 (--fp8-format e4m3|hybrid): GEMMs of the linear layers in FP8, see megatron/core/fp8_utils.py
    fp8: Optional[str] = flag(None, "FP8 format of the linear layers' GEMMs (per-tensor scaling here).",
                                    arg_names=("--fp8-format",), choices=("e4m3", "hybrid"))
    fp8_recipe: str = flag("delayed", "FP8 scaling recipe (delayed: amax history; tensorwise: current scaling; mxfp8 "
                                      "and blockwise: block scaling; custom: a user quantizer factory).",
                                      choices=("tensorwise", "delayed", "mxfp8", "blockwise", "custom"))
    fp8_margin: int = flag(0, "Scaling margin for FP8.")
    fp8_interval: int = flag(1, "Scaling update interval for FP8.")
    fp8_amax_history_len: int = flag(1, "Number of steps of amax history kept.")
    fp8_amax_compute_algo: str = flag("most_recent", "How the FP8 amax is computed from its history.",
                                                     choices=("most_recent", "max"))
    fp8_wgrad: bool = flag(True, "Compute the weight gradients in higher precision under FP8.")
    # megatron-core's per-layer FP8 exemption (fp8_utils.is_first_last_bf16_layer): the transformer block builds the
    # first / last num_layers_at_{start,end}_in_bf16 global layers without FP8.
    first_last_layers_bf16: bool = flag(False, "With FP8, keep the first and last layers of the model in bf16 "
                                               "(--num-layers-at-start-in-bf16 / --num-layers-at-end-in-bf16).")
    num_layers_at_start_in_bf16: int = flag(1, "Layers at the start of the model kept in bf16 with "
                                               "--first-last-layers-bf16.")
    num_layers_at_end_in_bf16: int = flag(1, "Layers at the end of the model kept in bf16 with "
                                             "--first-last-layers-bf16.")

    normalization: str = flag("LayerNorm", "Normalization layer type.", choices=("LayerNorm", "RMSNorm"))
    # --qk-layernorm: normalise each head's queries and keys (the config's normalization) before RoPE/scores.
    qk_layernorm: bool = flag(False, "Normalise each head's queries and keys (with --normalization) before attention; "
                                     "with --multi-latent-attention, the query and key/value latents.")

    # Attention implementation (--attention-backend): AttnBackend by name. auto/fused: SDPA where the mask allows
    # (explicit softmax otherwise); flash: SDPA (PyTorch's flash kernel on CUDA) or the flash-attn package with
    # use_flash_attn; unfused/local: the explicit baddbmm + masked-softmax path.
    attention_backend: Union[AttnBackend, str] = flag(
        AttnBackend.auto, "Attention implementation: auto/fused/flash use torch SDPA where the mask allows, "
        "unfused/local the explicit masked softmax.")
    # --transformer-impl: "local" (this library's modules) or "transformer_engine" (TE modules, not built here).
    transformer_impl: str = flag("local", "Which transformer implementation to use (transformer_engine and "
                                          "inference_optimized run local, with a log line, because this library "
                                          "builds its layers from its own modules).", default="transformer_engine",
                                          choices=("local", "transformer_engine", "inference_optimized"))
    use_flash_attn: bool = False                 # --use-flash-attn: the flash-attn package's kernel
    # --cp-comm-type: how attention communicates across the context-parallel group ("p2p" ring or "all_gather";
    # a list gives one value per layer). None means "p2p". See megatron/core/transformer/context_parallel.py.
    cp_comm_type: Optional[Union[str, List[str]]] = None

    # Language-model settings read by the legacy model classes (megatron-core's GPTModel/BERTModel take the
    # same values as constructor arguments). Names equal the argparse destinations of Megatron's flags.
    padded_vocab_size: Optional[int] = None      # vocabulary padded by --make-vocab-size-divisible-by x TP
    max_position_embeddings: Optional[int] = None
    position_embedding_type: str = "learned_absolute"  # --position-embedding-type {learned_absolute, rope, none}
    add_position_embedding: bool = True          # --no-position-embedding (deprecated; needs rope)
    rotary_percent: float = 1.0
    rotary_base: int = 10000
    # RoFormer pairs (x[2i], x[2i+1]) instead of rotate-half
    rotary_interleaved: bool = flag(False, "Rotate adjacent channel pairs (RoFormer) instead of the two halves of "
                                           "each head.")
    rotary_seq_len_interpolation_factor: Optional[float] = None
    use_rope_scaling: bool = False               # Llama-3.x frequency scaling of inv_freq
    rope_scaling_factor: float = 8.0
    # YaRN (position_embedding_type "yarn", and multi-latent attention's rotary): factor s, attention concentration
    # g(s, mscale) / g(s, mscale_all_dim), original context, correction range (megatron/core/transformer/rotary.py).
    rotary_scaling_factor: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    yarn_correction_range_round_to_int: bool = True
    # Multi-latent attention (DeepSeek-V2/V3): MLATransformerConfig sets it and holds the latent sizes.
    multi_latent_attention: bool = flag(False, "Multi-latent attention (DeepSeek-V2/V3; sizes from the mla group of "
                                               "flags).")
    # Multi-token prediction (DeepSeek-V3): mtp_num_layers depths after the decoder on the last pipeline stage, their
    # mean loss scaled by mtp_loss_scaling_factor (megatron/core/transformer/multi_token_prediction.py).
    mtp_num_layers: Optional[int] = flag(None, "Multi-token prediction: depths after the decoder on the last pipeline "
                                               "stage, each predicting one token further (needs "
                                               "--position-embedding-type rope or none).")
    mtp_loss_scaling_factor: float = flag(0.1, "Multi-token prediction: the mean MTP loss over the depths is scaled by "
                                               "this factor.")
    untie_embeddings_and_output_weights: bool = False
    openai_gelu: bool = False
    onnx_safe: Optional[bool] = None
    squared_relu: bool = False
    embedding_weights_in_fp32: bool = False
    fp16_lm_cross_entropy: bool = False
    standalone_embedding_stage: bool = False
    output_bert_embeddings: bool = False
    # bias on the QKV projection only
    add_qkv_bias: bool = flag(False, "Give the QKV projection a bias even with --disable-bias-linear (Qwen2 / "
                                     "Qwen2.5).")
    # Encoder-decoder (T5): --decoder-num-layers, the decoder's layer count (None: num_layers, the encoder's).
    decoder_num_layers: Optional[int] = None

    # Mixture of experts (megatron-core's field names; --num-experts sets num_moe_experts). See
    # megatron/core/transformer/moe/ for the math.
    num_moe_experts: Optional[int] = None
    moe_layer_freq: Union[int, List[int]] = 1     # every N-th layer (int) or a 0/1 pattern per layer
    # per-expert FFN width (default ffn_hidden_size)
    moe_ffn_hidden_size: Optional[int] = flag(None, "Hidden size of each expert's MLP (--ffn-hidden-size if not "
                                                    "given).")
    moe_shared_expert_intermediate_size: Optional[int] = flag(None, "Total hidden size of the shared experts (none if "
                                                                    "not given).")
    moe_shared_expert_gate: bool = flag(False, "Gate the shared experts' output.")
    moe_shared_expert_overlap: bool = flag(False, "Accepted for Megatron's scripts (needs the alltoall dispatcher and "
                                                  "shared experts): the shared experts give the same result but are "
                                                  "not overlapped with the token dispatch in this library.")
    moe_grouped_gemm: bool = flag(False, "Compute the local experts with grouped GEMMs.")
    moe_use_legacy_grouped_gemm: bool = False     # GroupedMLP is the only grouped implementation here
    moe_router_load_balancing_type: Union[str, List[str]] = "aux_loss"
    moe_router_topk: int = flag(2, "Experts each token is routed to (k).")
    moe_router_pre_softmax: bool = flag(False, "Softmax over all experts before the top-k selection.")
    moe_router_num_groups: Optional[int] = flag(None, "Expert groups (group-limited routing).")
    moe_router_group_topk: Optional[int] = flag(None, "Groups selected per token.")
    moe_router_topk_scaling_factor: Optional[float] = flag(None, "Scale the top-k routing probabilities by this "
                                                                 "factor.")
    moe_router_score_function: str = flag("softmax", "Router score function.",
                                                     choices=("softmax", "sigmoid", "sqrtsoftplus"))
    moe_router_dtype: Optional[str] = flag(None, "Data type of the router's GEMM, routing and probability weighting.",
                                                 choices=("fp32", "fp64"))
    moe_router_enable_expert_bias: bool = flag(False, "Aux-loss-free load balancing with a per-expert bias (sigmoid "
                                                      "scores only).")
    moe_router_bias_update_rate: float = flag(1e-3, "Update rate of the expert bias.")
    moe_router_fusion: bool = flag(False, "Fused router kernels (Transformer Engine).")
    moe_router_force_load_balancing: bool = flag(
        False, "Benchmarking only: route on random logits (normal draws from the expert-parallel RNG stream) so "
               "every expert gets a balanced load; the gradient passes straight through to the router.")
    moe_enable_routing_replay: bool = flag(
        False, "Give every MoE router a RouterReplay (megatron.core.transformer.moe.router_replay) that can record "
               "its top-k choices or replay given ones; routing is unchanged until an action is set through that "
               "API.")
    moe_aux_loss_coeff: Union[float, List[float]] = 0.0
    moe_z_loss_coeff: Optional[float] = flag(None, "Coefficient of the router z-loss.")
    moe_input_jitter_eps: Optional[float] = flag(None, "Multiply the router input by U(1-eps, 1+eps).")
    moe_token_dispatcher_type: str = flag("allgather", "How tokens are dispatched to the experts.",
                                                       choices=("allgather", "alltoall", "flex"))
    moe_per_layer_logging: bool = flag(False, "Log the MoE losses of every layer.")
    moe_expert_capacity_factor: Optional[float] = flag(None, "Expert capacity factor (dropless if not given; a "
                                                             "negative value means not given).")
    moe_pad_expert_input_to_capacity: bool = flag(False, "Pad each expert's input to its capacity (needs "
                                                         "--moe-expert-capacity-factor).")
    moe_token_drop_policy: str = flag("probs", "Which tokens are dropped over capacity: lowest probability, or last "
                                               "positions.", choices=("probs", "position"))
    moe_layer_recompute: bool = flag(False, "Recompute the MoE layers in backward.")
    moe_permute_fusion: bool = flag(False, "Fused token permutation (Transformer Engine).")
    # Experts computed on a latent width (Nemotron-3): fc1_latent_proj [latent, h] before the dispatch,
    # fc2_latent_proj [h, latent] after the combine; the router and the shared experts see the hidden states.
    moe_latent_size: Optional[int] = flag(None, "Compute the experts on this latent width (fc1/fc2 latent "
                                                "projections around them).")

    # Hybrid Mamba models (megatron/core/ssm/): the layer pattern (one symbol per layer; megatron/core/ssm/
    # mamba_hybrid_layer_allocation.py), the Mamba-2 mixer sizes N (state), P (head dim), G (groups), H (heads; None:
    # 2h/P). is_hybrid_model scales the output-projection init by 1/sqrt(L) instead of 1/sqrt(2L).
    hybrid_layer_pattern: Optional[str] = flag(
        None, "One character per layer: M Mamba, * attention, - MLP, E MoE; | separates pipeline segments. Makes the "
              "model hybrid; --num-layers follows from it.")
    is_hybrid_model: bool = flag(False, "A hybrid Mamba model (needs --hybrid-layer-pattern); output projections are "
                                        "initialised with std / sqrt(num-layers).")
    mamba_state_dim: int = flag(128, "State dimension N of the Mamba-2 mixer.")
    mamba_head_dim: int = flag(64, "Head dimension P of the Mamba-2 mixer.")
    mamba_num_groups: int = flag(8, "Groups G of B and C in the Mamba-2 mixer.")
    mamba_num_heads: Optional[int] = flag(None, "Heads H of the Mamba-2 mixer (2 x hidden-size / mamba-head-dim if "
                                                "not given).")
    use_mamba_mem_eff_path: bool = flag(True, "Megatron's unfused Mamba training path (the same PyTorch math here).",
                                        arg_names=("--disable-mamba-mem-eff-path",))
    mamba_training_ssm_states_dtype: Optional[str] = flag(
        None, "Data type of the Mamba scan's inter-chunk states in training (fp32 if not given).",
        choices=("fp32", "bf16"))

    # Today's model families (gpt-oss, Llama 4); see megatron/core/transformer/attention_variants.py for the math.
    # Gated MLPs: y = act(min(a, c)) * (clamp(l, -c, c) + glu_linear_offset), c = activation_func_clamp_value (None:
    # no clamp); --quick-geglu is activation_func = quick_gelu with a gated unit.
    glu_linear_offset: float = flag(0.0, "Add this to the linear half of a gated MLP: act(gate) * (linear + offset).")
    activation_func_clamp_value: Optional[float] = flag(None, "Clamp a gated MLP's gate to <= C and its linear half "
                                                              "to [-C, C] (gpt-oss: 7).")
    # Attention sinks: vanilla (none), off-by-one (a zero logit), learnable (a per-head logit, softmax_offset).
    softmax_type: str = flag("vanilla", "Attention sinks: none (vanilla), a zero logit (off-by-one), or a learned "
                                        "logit per head (learnable, softmax_offset) that joins each softmax row.",
                                        choices=("vanilla", "off-by-one", "learnable"))
    # Sliding-window attention: query i sees keys i - left .. i + right (-1: unbounded) on the layers
    # window_attn_skip_freq selects (None: all; N: those whose number is not a multiple of N; a 0/1 list per layer).
    window_size: Optional[Tuple[int, int]] = None
    window_attn_skip_freq: Optional[Union[int, List[int]]] = None
    # Llama 4: NoPE layers (no_rope_freq: every N-th layer counted from 1, or a 0/1 list with 1 = no RoPE), the
    # weightless L2 norm of each head's queries and keys (qk_l2_norm; Megatron normalises every layer, Hugging Face
    # Llama 4 only its RoPE layers: qk_l2_norm_rope_layers_only, which its bridge sets), and the routing weight
    # applied to the expert's input instead of its output (moe_apply_probs_on_input, top-1 routing).
    no_rope_freq: Optional[Union[int, List[int]]] = None
    qk_l2_norm: bool = flag(False, "Normalise each head's queries and keys by their RMS (no weight) before attention, in "
                                   "every layer (Llama 4; replaces --qk-layernorm).")
    qk_l2_norm_rope_layers_only: bool = False
    moe_apply_probs_on_input: bool = flag(False, "Multiply each token's expert input by its routing weight and take "
                                                 "the expert output as it is (Llama 4; needs --moe-router-topk 1).")
    # megatron-core: whether each layer takes its own config (config.get_config_for_layer(layer_number)); True only
    # on a HeterogeneousTransformerConfig (Nemotron-NAS / Llama-Nemotron per-block JSON).
    heterogeneous_block_specs: bool = False
    # megatron-core's config logger (megatron.core.config_logger): models, DDP and the optimizers dump their
    # constructor arguments (and a model its initial state dict and each forward's inputs and logits) there.
    config_logger_dir: str = flag("", "When non-empty, dump the configs of the entry points (models, DDP, optimizers), "
                                      "the model's initial state dict and every forward's inputs and logits to this "
                                      "directory, one file per rank and call.")

    # megatron-core's experimental attention variants: "dsa", DeepSeek sparse attention (DeepSeek-V3.2;
    # megatron/core/transformer/experimental_attention_variant/dsa.py), the core attention of multi-latent attention;
    # "gated_delta_net", Gated DeltaNet linear attention (Qwen3-Next; megatron/core/ssm/gated_delta_net.py) on the
    # layers linear_attention_freq selects (int N: every layer but each N-th; or a 0/1 list, 1 = GDN; its flag is
    # defined in megatron/training/arguments/model_args.py). HEAD's "gdn" / "gdn2" values are not available.
    experimental_attention_variant: Optional[str] = flag(
        None, "Experimental attention: dsa (DeepSeek sparse attention inside multi-latent attention) or "
              "gated_delta_net (Gated DeltaNet linear attention on the layers --linear-attention-freq selects).",
        choices=("gdn", "gdn2", "dsa", "gated_delta_net"))
    linear_attention_freq: Optional[Union[int, List[int]]] = None
    linear_conv_kernel_dim: int = flag(4, "Gated DeltaNet: kernel width of the causal depthwise convolution.")
    linear_key_head_dim: int = flag(128, "Gated DeltaNet: query / key head dimension.")
    linear_value_head_dim: int = flag(128, "Gated DeltaNet: value head dimension.")
    linear_num_key_heads: int = flag(16, "Gated DeltaNet: query / key heads.")
    linear_num_value_heads: int = flag(32, "Gated DeltaNet: value heads (a multiple of the key heads).")
    dsa_indexer_n_heads: Optional[int] = flag(None, "DeepSeek sparse attention: the indexer's heads.")
    dsa_indexer_head_dim: Optional[int] = flag(None, "DeepSeek sparse attention: the indexer's head dimension.")
    dsa_indexer_topk: Optional[int] = flag(None, "DeepSeek sparse attention: keys each query attends to.")
    dsa_indexer_loss_coeff: Optional[float] = flag(None, "DeepSeek sparse attention: coefficient of the indexer's KL "
                                                         "loss (0 or unset: the indexer does not train).")
    dsa_indexer_use_sparse_loss: bool = flag(False, "DeepSeek sparse attention: the indexer's KL loss over the "
                                                    "selected keys only.")

    def __post_init__(self):
        super().__post_init__()
        self._validate_model_settings()
        if self.cp_comm_type is not None:
            values = [self.cp_comm_type] if isinstance(self.cp_comm_type, str) else list(self.cp_comm_type)
            if not isinstance(self.cp_comm_type, str) and len(values) != self.num_layers:
                raise ValueError(f"cp_comm_type lists {len(values)} values; give one, or one per layer "
                                 f"({self.num_layers})")
            bad = [v for v in values if v not in ("p2p", "all_gather", "a2a", "a2a+p2p")]
            if bad:
                raise ValueError(f"cp_comm_type {bad[0]!r} is not one of p2p, all_gather, a2a, a2a+p2p")

        if self.fp16 and self.bf16:
            raise ValueError(f"Only one of self.fp16: {self.fp16} and self.bf16 {self.bf16} should be True.")

        if self.num_attention_heads % self.tensor_model_parallel_size != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"tensor_model_parallel_size ({self.tensor_model_parallel_size})."
            )

        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size

        if self.kv_channels is None:
            if self.num_attention_heads == 0:
                raise ValueError("num_attention_heads must be set (> 0) to derive kv_channels")
            self.kv_channels = self.hidden_size // self.num_attention_heads

        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads

        if self.num_query_groups % self.tensor_model_parallel_size != 0:
            raise ValueError(
                f"num_query_groups ({self.num_query_groups}) must be a multiple of "
                f"tensor_model_parallel_size ({self.tensor_model_parallel_size})."
            )
        if self.num_attention_heads % self.num_query_groups != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_query_groups ({self.num_query_groups})."
            )

        if self.apply_query_key_layer_scaling:
            self.attention_softmax_in_fp32 = True

        if self.fp8 is not None:
            fp8_recipe_from_config(self)  # raises a ValueError naming the flag for an invalid combination
            self._validate_first_last_bf16()

        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"normalization must be 'LayerNorm' or 'RMSNorm', got {self.normalization!r}")

        self._validate_recompute_modules()
        if self.recompute_granularity is not None:
            if self.recompute_granularity not in ("full", "selective"):
                raise ValueError(
                    f'When using recompute_granuarlity: {self.recompute_granularity} must be "full" or "selective".'
                )
            if self.recompute_method is not None:
                if self.recompute_method not in ("block", "uniform"):
                    raise ValueError(f'recompute_method: {self.recompute_method} must be "block" or "uniform".')
            elif self.recompute_granularity != "selective":
                raise ValueError(
                    f'Using recompute_granularity: {self.recompute_granularity} so recompute_method must be "block" or "uniform"'
                )
            if self.recompute_granularity != "selective" and self.recompute_num_layers is None:
                raise ValueError(
                    f"When using recompute_granularity: {self.recompute_granularity} recompute_num_layers must be between "
                    f"1 and num_layers_per_pipeline_rank: "
                    f"{self.num_layers // self.pipeline_model_parallel_size}"
                )
            if self.recompute_granularity == "selective" and self.recompute_num_layers is not None:
                raise ValueError(
                    f"When using recompute_granularity: {self.recompute_granularity} recompute_num_layers must be None."
                )
            if self.distribute_saved_activations and self.sequence_parallel:
                raise ValueError(
                    f"distribute_saved_activations: {self.distribute_saved_activations} must be false when "
                    f"sequence parallel is enabled: {self.sequence_parallel}"
                )

        if self.virtual_pipeline_model_parallel_size is not None:
            if self.num_layers % self.virtual_pipeline_model_parallel_size != 0:
                raise ValueError(
                    f"num_layers: {self.num_layers} must be divisible by virtual_model_parallel_size "
                    f"{self.virtual_pipeline_model_parallel_size}"
                )

        if self.bias_gelu_fusion:
            if not self.add_bias_linear:
                raise ValueError("When bias_gelu_fusion is True, add_bias_linear must also be True.")
            if self.activation_func is not F.gelu:
                raise ValueError("When bias_gelu_fusion is True, activation_func must be F.gelu.")

        self._validate_moe()
        self._validate_attention_variants()
        self._validate_llama4_settings()
        self._validate_moe_overlap()

        if self.init_method is None:
            self.init_method = init_method_normal(self.init_method_std)
        if self.output_layer_init_method is None:
            self.output_layer_init_method = scaled_init_method_normal(self.init_method_std, max(self.num_layers, 1),
                                                                      multiplier=1.0 if self.is_hybrid_model else 2.0)

    def _validate_moe_overlap(self):
        """megatron-core's conditions of ``overlap_moe_expert_parallel_comm`` (its combined 1F1B schedule) that are
        not about speed: the alltoall (or flex) dispatcher, no layer recompute, no shared-expert overlap, at most
        one MTP depth, virtual stages with PP > 1. (Its EP > 1 and bf16 / fp16 conditions are not required here.)"""
        if not self.overlap_moe_expert_parallel_comm:
            return
        problems = []
        if self.moe_token_dispatcher_type not in ("alltoall", "flex"):
            problems.append("the alltoall or flex token dispatcher")
        if self.recompute_granularity == "full" or self.recompute_method is not None \
                or self.recompute_num_layers is not None:
            problems.append("no full recompute (recompute_granularity / recompute_method / recompute_num_layers)")
        if self.moe_shared_expert_overlap:
            problems.append("moe_shared_expert_overlap off")
        if (self.mtp_num_layers or 0) > 1:
            problems.append("at most one multi-token prediction layer")
        if self.pipeline_model_parallel_size > 1 and self.virtual_pipeline_model_parallel_size is None:
            problems.append("virtual_pipeline_model_parallel_size when pipeline_model_parallel_size > 1")
        if problems:
            raise ValueError("overlap_moe_expert_parallel_comm needs " + "; ".join(problems))

    def _validate_first_last_bf16(self):
        """megatron-core's rules for --first-last-layers-bf16 under FP8: not with delayed scaling, and each count in
        [0, layers per pipeline stage]."""
        if not self.first_last_layers_bf16:
            return
        if self.fp8_recipe == "delayed":
            raise ValueError("Delayed scaling does not support first / last layer in BF16: --first-last-layers-bf16 "
                             "needs --fp8-recipe tensorwise")
        per_stage = self.num_layers // self.pipeline_model_parallel_size
        for name in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
            if not 0 <= getattr(self, name) <= per_stage:
                raise ValueError(f"{name} ({getattr(self, name)}) must be between 0 and number of layers per "
                                 f"pipeline stage ({per_stage}).")

    def _validate_moe(self):
        """megatron-core's MoE checks (the flags are also checked in validate_args, before any process group)."""
        if self.num_moe_experts is None:
            return
        if self.num_moe_experts <= 0:
            raise ValueError(f"num_moe_experts must be > 0, got {self.num_moe_experts}")
        if self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        if self.num_moe_experts % self.expert_model_parallel_size != 0:
            raise ValueError(f"num_moe_experts ({self.num_moe_experts}) must be divisible by "
                             f"expert_model_parallel_size ({self.expert_model_parallel_size})")
        if self.moe_router_topk > self.num_moe_experts:
            raise ValueError(f"moe_router_topk ({self.moe_router_topk}) must be <= num_moe_experts "
                             f"({self.num_moe_experts})")
        if self.moe_router_score_function not in ("softmax", "sigmoid"):
            raise ValueError(f"moe_router_score_function must be softmax or sigmoid, got "
                             f"{self.moe_router_score_function!r}")
        check_moe_routing(self.moe_router_load_balancing_type, self.moe_aux_loss_coeff, self.moe_router_topk,
                          self.moe_router_score_function, self.moe_router_pre_softmax)
        if self.moe_router_enable_expert_bias and self.moe_router_score_function != "sigmoid":
            raise ValueError("moe_router_enable_expert_bias needs moe_router_score_function='sigmoid'")
        if self.moe_router_num_groups is not None:
            if self.num_moe_experts % self.moe_router_num_groups or not self.moe_router_group_topk:
                raise ValueError("group-limited routing needs num_moe_experts divisible by moe_router_num_groups "
                                 "and moe_router_group_topk set")
            if self.moe_router_group_topk > self.moe_router_num_groups:
                raise ValueError(f"moe_router_group_topk ({self.moe_router_group_topk}) must be <= "
                                 f"moe_router_num_groups ({self.moe_router_num_groups})")
        elif self.moe_router_group_topk is not None:
            raise ValueError("moe_router_group_topk needs moe_router_num_groups (group-limited routing)")
        if self.moe_pad_expert_input_to_capacity and self.moe_expert_capacity_factor is None:
            raise ValueError("moe_pad_expert_input_to_capacity needs moe_expert_capacity_factor")
        if self.add_bias_linear and (self.expert_tensor_parallel_size or 1) > 1:
            raise ValueError("expert biases need expert_tensor_parallel_size 1 (pass --disable-bias-linear)")
        if self.moe_grouped_gemm and self.fp16:
            raise ValueError("moe_grouped_gemm supports bf16 and fp32 parameters, not fp16")

    def _validate_attention_variants(self):
        self._validate_dsa()
        if self.softmax_type not in ("vanilla", "off-by-one", "learnable"):
            raise ValueError(f"softmax_type must be vanilla, off-by-one or learnable, got {self.softmax_type!r}")
        if self.window_size is not None:
            self.window_size = tuple(int(v) for v in self.window_size)
            if len(self.window_size) != 2 or any(v < -1 for v in self.window_size):
                raise ValueError(f"window_size must be (left, right) with values >= -1 (-1: unbounded), got "
                                 f"{self.window_size}")
        freq = self.window_attn_skip_freq
        if isinstance(freq, (list, tuple)) and len(freq) != self.num_layers:
            raise ValueError(f"window_attn_skip_freq lists {len(freq)} layers; the model has {self.num_layers}")
        if isinstance(freq, int) and freq < 1:
            raise ValueError(f"window_attn_skip_freq must be >= 1, got {freq}")
        if self.activation_func_clamp_value is not None and self.activation_func_clamp_value <= 0:
            raise ValueError(f"activation_func_clamp_value must be > 0, got {self.activation_func_clamp_value}")
        if (self.glu_linear_offset or self.activation_func_clamp_value is not None) and not self.gated_linear_unit:
            raise ValueError("glu_linear_offset / activation_func_clamp_value apply to a gated linear unit: set "
                             "gated_linear_unit (--swiglu or --quick-geglu)")

    def _validate_dsa(self):
        variant = self.experimental_attention_variant
        if variant is None:
            return
        if variant not in ("dsa", "gated_delta_net"):
            raise ValueError(f"experimental_attention_variant must be 'dsa' or 'gated_delta_net', got {variant!r}")
        if variant == "gated_delta_net":
            freq = self.linear_attention_freq
            if freq is None:
                raise ValueError("Gated DeltaNet (experimental_attention_variant='gated_delta_net') needs "
                                 "linear_attention_freq (the GDN / attention layer pattern)")
            if isinstance(freq, (list, tuple)) and len(freq) != self.num_layers:
                raise ValueError(f"linear_attention_freq lists {len(freq)} layers; the model has {self.num_layers}")
            if self.linear_num_value_heads % self.linear_num_key_heads:
                raise ValueError(f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                                 f"linear_num_key_heads ({self.linear_num_key_heads})")
            if self.context_parallel_size > 1:
                raise ValueError("Gated DeltaNet does not support context parallelism (context_parallel_size)")
            return
        if not self.multi_latent_attention:
            raise ValueError("DeepSeek sparse attention (experimental_attention_variant='dsa') needs multi-latent "
                             "attention (MLATransformerConfig)")
        for name in ("dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk"):
            if not getattr(self, name) or getattr(self, name) <= 0:
                raise ValueError(f"DeepSeek sparse attention needs {name} > 0, got {getattr(self, name)}")
        if self.dsa_indexer_head_dim < getattr(self, "qk_pos_emb_head_dim", 0):
            raise ValueError(f"dsa_indexer_head_dim ({self.dsa_indexer_head_dim}) must hold the rotary part "
                             f"qk_pos_emb_head_dim ({self.qk_pos_emb_head_dim})")
        if self.context_parallel_size > 1:
            raise ValueError("DeepSeek sparse attention does not support context parallelism (context_parallel_size)")
        if self.apply_rope_fusion:
            raise ValueError("DeepSeek sparse attention does not support RoPE fusion (apply_rope_fusion)")

    def _validate_llama4_settings(self):
        freq = self.no_rope_freq
        if isinstance(freq, int):
            if freq < 1 or self.num_layers % freq:
                raise ValueError(f"no_rope_freq {freq} must be >= 1 and divide num_layers ({self.num_layers})")
        elif freq is not None and len(freq) != self.num_layers:
            raise ValueError(f"no_rope_freq lists {len(freq)} layers; the model has {self.num_layers}")
        if self.qk_l2_norm and self.qk_layernorm:
            raise ValueError("qk_l2_norm and qk_layernorm both normalise the queries and keys: set only one")
        if self.moe_apply_probs_on_input and self.num_moe_experts is not None and self.moe_router_topk != 1:
            raise ValueError(f"moe_apply_probs_on_input needs moe_router_topk 1 (one weight per token), got "
                             f"{self.moe_router_topk}")

    def is_no_rope_layer(self, layer_number: int) -> bool:
        """Whether global layer ``layer_number`` (1-based) attends without rotary embeddings (``no_rope_freq``)."""
        freq = self.no_rope_freq
        if freq is None:
            return False
        if isinstance(freq, int):
            return layer_number % freq == 0
        return bool(freq[layer_number - 1])

    def is_window_attention_layer(self, layer_number: int) -> bool:
        """Whether global layer ``layer_number`` (1-based) attends within ``window_size`` (see the field)."""
        return is_layer_window_attention(self.window_size, self.window_attn_skip_freq, layer_number)

    def is_moe_layer(self, layer_number: int) -> bool:
        """Whether global layer ``layer_number`` (1-based) has an MoE MLP (``moe_layer_freq``)."""
        if self.num_moe_experts is None:
            return False
        freq = self.moe_layer_freq
        if isinstance(freq, int):
            return (layer_number - 1) % freq == 0
        return bool(freq[layer_number - 1])

    def required_padded_vocab_size(self) -> int:
        """``padded_vocab_size`` for the legacy model classes, with a clear error when it is not set."""
        if self.padded_vocab_size is None:
            raise ValueError("the model needs padded_vocab_size: pass --vocab-size/--vocab-file (training scripts), "
                             "or TransformerConfig(padded_vocab_size=...) when building the model directly")
        return self.padded_vocab_size

    def recomputes(self, module: str) -> bool:
        """Whether selective recompute covers ``module`` (one of ``RECOMPUTE_MODULES``) in each layer."""
        return self.recompute_granularity == "selective" and module in self.recompute_modules

    def _validate_recompute_modules(self):
        """Selective recompute as megatron-core names it: ``recompute_modules`` (default ``["core_attn"]``) lists
        what each layer recomputes in backward: ``core_attn`` (softmax(QK^T)V), ``mlp`` (a dense MLP), ``moe`` (the
        whole MoE layer, dispatch and combine included), ``shared_experts``, ``moe_act`` (the grouped experts'
        activation), ``layernorm`` (the layer's input and pre-MLP norms), ``mla_up_proj`` (multi-latent attention's
        latent norms, up projections and RoPE). The deprecated ``moe_layer_recompute`` means selective recompute with
        ``moe`` added."""
        if self.recompute_modules is None:
            self.recompute_modules = ["core_attn"]
        self.recompute_modules = list(self.recompute_modules)
        if self.moe_layer_recompute:
            if self.recompute_granularity == "full":
                raise ValueError("moe_layer_recompute (--moe-layer-recompute) cannot be combined with full recompute "
                                 "granularity: drop one of them")
            self.recompute_granularity = "selective"
            if "moe" not in self.recompute_modules:
                self.recompute_modules.append("moe")
        if self.recompute_granularity == "selective":
            check_recompute_modules(self.recompute_modules, self.moe_grouped_gemm, self.multi_latent_attention)

    def _validate_model_settings(self):
        """Normalise ``attention_backend`` to :class:`AttnBackend` and reject contradictory model settings."""
        if isinstance(self.attention_backend, str):
            try:
                self.attention_backend = AttnBackend[self.attention_backend]
            except KeyError:
                raise ValueError(f"attention_backend must be one of {[b.name for b in AttnBackend]}, "
                                 f"got {self.attention_backend!r}") from None
        elif not isinstance(self.attention_backend, AttnBackend):
            raise ValueError(f"attention_backend must be an AttnBackend, got {self.attention_backend!r}")
        if self.transformer_impl not in ("local", "transformer_engine"):
            raise ValueError(f"transformer_impl must be 'local' or 'transformer_engine', got {self.transformer_impl!r}")
        if self.position_embedding_type not in ("learned_absolute", "rope", "yarn", "none"):
            raise ValueError("position_embedding_type must be 'learned_absolute', 'rope', 'yarn' or 'none', "
                             f"got {self.position_embedding_type!r}")
        if self.rotary_scaling_factor <= 0:
            raise ValueError(f"rotary_scaling_factor must be > 0, got {self.rotary_scaling_factor}")
        if self.position_embedding_type == "yarn" and self.rotary_interleaved:
            raise ValueError("YaRN (position_embedding_type 'yarn') does not support rotary_interleaved")
        if self.mtp_num_layers:
            if self.position_embedding_type not in ("rope", "none"):
                raise ValueError("multi-token prediction (mtp_num_layers) needs position_embedding_type 'rope' or "
                                 f"'none', got {self.position_embedding_type!r}")
            if self.mtp_num_layers < 0:
                raise ValueError(f"mtp_num_layers must be >= 0, got {self.mtp_num_layers}")
        if not 0.0 < self.rotary_percent <= 1.0:
            raise ValueError(f"rotary_percent must be in (0, 1], got {self.rotary_percent}")
        if self.rope_scaling_factor <= 0:
            raise ValueError(f"rope_scaling_factor must be > 0, got {self.rope_scaling_factor}")
        if self.rotary_seq_len_interpolation_factor is not None and self.rotary_seq_len_interpolation_factor <= 0:
            raise ValueError("rotary_seq_len_interpolation_factor must be > 0, "
                             f"got {self.rotary_seq_len_interpolation_factor}")
        if self.padded_vocab_size is not None and self.padded_vocab_size <= 0:
            raise ValueError(f"padded_vocab_size must be > 0, got {self.padded_vocab_size}")


@dataclass
class MLATransformerConfig(TransformerConfig):
    """megatron-core's configuration of multi-latent attention (``--multi-latent-attention``); defaults are
    megatron-core's (DeepSeek-V3's sizes), which differ from the flags' (``--kv-lora-rank`` 32, ``--q-lora-rank``
    None, ``--rotary-scaling-factor`` 1). See megatron/core/transformer/multi_latent_attention.py for the shapes."""

    multi_latent_attention: bool = True
    q_lora_rank: Optional[int] = 512             # r_q; None: queries straight from the hidden state
    kv_lora_rank: int = 512                      # r_kv
    qk_head_dim: int = 128                       # d_n: the no-position part of each query / key head
    qk_pos_emb_head_dim: int = 64                # d_r: the rotary part (one shared key head)
    v_head_dim: int = 128                        # d_v
    normalization: str = "RMSNorm"
    rope_type: str = "yarn"                      # 'yarn' or 'rope'
    rotary_scaling_factor: float = 40.0
    cache_mla_latents: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.rope_type not in ("rope", "yarn"):
            raise ValueError(f"rope_type must be 'rope' or 'yarn' for multi-latent attention, got {self.rope_type!r}")
        if self.num_query_groups != self.num_attention_heads:
            raise ValueError("multi-latent attention has one latent for all heads: drop grouped-query attention "
                             "(--group-query-attention / num_query_groups)")
        if self.rope_type == "yarn" and self.rotary_interleaved:
            raise ValueError("multi-latent attention with YaRN does not support rotary_interleaved "
                             "(--rotary-interleaved)")
        for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.qk_pos_emb_head_dim % 2:
            raise ValueError(f"qk_pos_emb_head_dim ({self.qk_pos_emb_head_dim}) must be even (rotary pairs)")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ValueError(f"q_lora_rank must be > 0 or None, got {self.q_lora_rank}")
        if self.cache_mla_latents:
            raise ValueError("cache_mla_latents (--cache-mla-latents) is a dynamic-inference option this library "
                             "does not implement: drop it")
