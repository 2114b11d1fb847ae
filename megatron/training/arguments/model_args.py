"""Flags that describe the model: network size, regularization, initialization, Transformer Engine, retro.

Names, types, defaults and destinations follow Megatron-LM's ``megatron/training/arguments.py``
(https://github.com/NVIDIA/Megatron-LM); each function adds one argument
group and returns the parser, as Megatron's ``_add_*_args`` do.
"""
from __future__ import annotations

import argparse


def _attn_backend(name: str):
    """``--attention-backend NAME`` -> megatron.core's ``AttnBackend`` member of that name (HEAD's type)."""
    from megatron.core.transformer.enums import AttnBackend

    try:
        return AttnBackend[name]
    except KeyError:
        raise argparse.ArgumentTypeError(
            f"invalid choice {name!r} (choose from {', '.join(b.name for b in AttnBackend)})") from None


def int_pair(value: str):
    """``"127,0"`` or ``"(127,0)"`` -> ``(127, 0)`` (HEAD's type of ``--window-size``)."""
    try:
        return tuple(int(v) for v in value.strip("()").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by a comma, e.g. 127,0; got {value!r}") from None


def layer_pattern(value: str):
    """An int N, or a Python list expression of 0/1 per layer such as ``"([0]+[1]*23)"`` (HEAD's per-layer
    frequency options: ``--moe-layer-freq``, ``--no-rope-freq``, ``--window-attn-skip-freq`` ...)."""
    try:
        return int(value)
    except ValueError:
        pass
    try:
        pattern = _eval_layer_pattern(value)
    except (ValueError, SyntaxError, TypeError):
        pattern = None
    if not isinstance(pattern, list) or not all(v in (0, 1) for v in pattern):
        raise argparse.ArgumentTypeError(f"expected an integer or a list expression of 0/1 such as '([0]+[1]*23)', "
                                         f"got {value!r}")
    return pattern


def _add_network_size_args(parser):
    group = parser.add_argument_group(title="network size")

    group.add_argument("--num-layers", type=int, default=None, help="Number of transformer layers.")
    group.add_argument("--encoder-num-layers", type=int, default=None,
                       help="Number of encoder transformer layers (alternative to --num-layers).")
    group.add_argument("--decoder-num-layers", type=int, default=None, help="Number of decoder transformer layers.")
    group.add_argument("--hidden-size", type=int, default=None, help="Transformer hidden size.")
    group.add_argument("--ffn-hidden-size", type=int, default=None,
                       help="Hidden size of the MLP; 4 * hidden-size if not given (2/3 of that, rounded down to "
                            "a multiple of 64, with --swiglu).")
    group.add_argument("--num-attention-heads", type=int, default=None, help="Number of attention heads.")
    group.add_argument("--kv-channels", type=int, default=None,
                       help="Projection size per attention head; hidden-size // num-attention-heads if not given.")
    group.add_argument("--group-query-attention", action="store_true", help="Use grouped-query attention.")
    group.add_argument("--num-query-groups", type=int, default=1,
                       help="Number of key/value groups with --group-query-attention.")
    group.add_argument("--max-position-embeddings", type=int, default=None,
                       help="Largest sequence length the position embedding supports.")
    group.add_argument("--position-embedding-type", type=str, default="learned_absolute",
                       choices=["learned_absolute", "rope", "yarn", "mrope", "relative", "none"],
                       help="Position embedding type (yarn, mrope and relative are not available).")
    group.add_argument("--use-rotary-position-embeddings", action="store_true",
                       help="Deprecated: use --position-embedding-type rope.")
    group.add_argument("--rotary-percent", type=float, default=1.0,
                       help="Fraction of each head's dimensions that rotary embeddings rotate.")
    group.add_argument("--rotary-seq-len-interpolation-factor", type=int, default=None,
                       help="Sequence-length interpolation factor for rotary embeddings.")
    group.add_argument("--rotary-base", type=int, default=10000, help="Base of the rotary embedding frequencies.")
    group.add_argument("--rotary-interleaved", action="store_true",
                       help="Rotate adjacent channel pairs (RoFormer) instead of the two halves of each head.")
    group.add_argument("--use-rope-scaling", action="store_true",
                       help="Apply Llama-3.x frequency scaling to the rotary embedding.")
    group.add_argument("--rope-scaling-factor", type=float, default=8.0,
                       help="Frequency scaling factor of --use-rope-scaling.")
    group.add_argument("--qk-layernorm", action="store_true",
                       help="Normalise each head's queries and keys (with --normalization) before attention.")
    group.add_argument("--add-qkv-bias", action="store_true",
                       help="Give the QKV projection a bias even with --disable-bias-linear (Qwen2 / Qwen2.5).")
    group.add_argument("--attention-backend", type=_attn_backend, default=_attn_backend("auto"),
                       choices=list(_attn_backend("auto").__class__), metavar="{flash,fused,unfused,local,auto}",
                       help="Attention implementation: auto/fused/flash use torch SDPA where the mask allows, "
                            "unfused/local the explicit masked softmax.")
    group.add_argument("--no-position-embedding", action="store_false", dest="add_position_embedding",
                       help="Deprecated: disable the position embedding (only with rope).")
    group.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                       help="Pad the vocabulary to a multiple of this value times the tensor-parallel size.")
    group.add_argument("--norm-epsilon", "--layernorm-epsilon", type=float, default=1e-5, dest="layernorm_epsilon",
                       help="Epsilon of every LayerNorm / RMSNorm (today's spelling; --layernorm-epsilon is the 2023 "
                            "one).")
    group.add_argument("--apply-layernorm-1p", action="store_true", dest="layernorm_zero_centered_gamma",
                       help="Zero-centred layer-norm gamma (weight + 1), for numerical stability.")
    group.add_argument("--apply-residual-connection-post-layernorm", action="store_true",
                       help="Take the residual from after the layer norm (original BERT).")
    group.add_argument("--openai-gelu", action="store_true", help="Use OpenAI's tanh approximation of GeLU.")
    group.add_argument("--squared-relu", action="store_true", help="Use squared ReLU as the MLP activation.")
    group.add_argument("--swiglu", action="store_true", help="Use the gated SwiGLU MLP.")
    group.add_argument("--onnx-safe", type=bool, required=False,
                       help="Use workarounds for known problems with the Torch ONNX exporter.")
    group.add_argument("--bert-no-binary-head", action="store_false", dest="bert_binary_head",
                       help="Disable BERT's binary (sentence-order) head.")
    group.add_argument("--num-experts", type=int, default=None, help="Number of experts in a mixture-of-experts MLP.")
    group.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                       help="Do not tie the input embedding and the output layer weights.")
    group.add_argument("--embedding-weights-in-fp32", action="store_true",
                       help="Keep the embedding weights in fp32 under mixed precision.")
    _add_hybrid_args(group)
    return parser


def _add_regularization_args(parser):
    group = parser.add_argument_group(title="regularization")

    group.add_argument("--attention-dropout", type=float, default=0.1, help="Dropout after the attention softmax.")
    group.add_argument("--hidden-dropout", type=float, default=0.1, help="Dropout on the hidden states.")
    group.add_argument("--weight-decay", type=float, default=0.01, help="L2 weight decay coefficient.")
    group.add_argument("--start-weight-decay", type=float,
                       help="Initial weight decay with a non-constant --weight-decay-incr-style.")
    group.add_argument("--end-weight-decay", type=float,
                       help="Final weight decay with a non-constant --weight-decay-incr-style.")
    group.add_argument("--weight-decay-incr-style", type=str, default="constant",
                       choices=["constant", "linear", "cosine"], help="Weight decay schedule.")
    group.add_argument("--clip-grad", type=float, default=1.0, help="Clip gradients to this global L2 norm.")
    group.add_argument("--adam-beta1", type=float, default=0.9, help="Adam beta1.")
    group.add_argument("--adam-beta2", type=float, default=0.999, help="Adam beta2.")
    group.add_argument("--adam-eps", type=float, default=1e-08, help="Adam epsilon.")
    group.add_argument("--sgd-momentum", type=float, default=0.9, help="Momentum of the SGD optimizer.")
    return parser


def _add_initialization_args(parser):
    group = parser.add_argument_group(title="initialization")

    group.add_argument("--seed", type=int, default=1234, help="Random seed for python, numpy and torch.")
    group.add_argument("--data-parallel-random-init", action="store_true",
                       help="Initialise the model differently on each data-parallel rank.")
    group.add_argument("--init-method-std", type=float, default=0.02,
                       help="Standard deviation of the normal weight initialisation.")
    group.add_argument("--init-method-xavier-uniform", action="store_true",
                       help="Use Xavier uniform weight initialisation.")
    return parser


def _add_transformer_engine_args(parser):
    group = parser.add_argument_group(title="Transformer-Engine")

    group.add_argument("--fp8-format", default=None, choices=["e4m3", "hybrid"], dest="fp8",
                       help="FP8 format (Transformer Engine only).")
    group.add_argument("--fp8-margin", type=int, default=0, help="Scaling margin for FP8.")
    group.add_argument("--fp8-interval", type=int, default=1, help="Scaling update interval for FP8.")
    group.add_argument("--fp8-amax-history-len", type=int, default=1, help="Number of steps of amax history kept.")
    group.add_argument("--fp8-amax-compute-algo", default="most_recent", choices=["most_recent", "max"],
                       help="How the FP8 amax is computed from its history.")
    group.add_argument("--no-fp8-wgrad", "--disable-fp8-wgrad", action="store_false", dest="fp8_wgrad",
                       help="Compute the weight gradients in higher precision under FP8.")
    group.add_argument("--fp8-recipe", default="delayed", choices=["tensorwise", "delayed", "mxfp8", "blockwise",
                                                                   "custom"],
                       help="FP8 scaling recipe (delayed: amax history; tensorwise: current scaling; mxfp8 and "
                            "blockwise: block scaling; custom: a user quantizer factory).")
    group.add_argument("--fp8-param-gather", action="store_true",
                       help="Keep the parameters in FP8 and all-gather them in FP8 (needs the distributed optimizer).")
    group.add_argument("--transformer-impl", default="transformer_engine",
                       choices=["local", "transformer_engine", "inference_optimized"],
                       help="Which transformer implementation to use (transformer_engine and inference_optimized run "
                            "local, with a log line, because this library builds its layers from its own modules).")
    group.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"],
                       help="Normalization layer type.")
    return parser


def _eval_layer_pattern(value: str):
    """Evaluate a list expression made only of list literals of ints, ``+`` and ``* int`` (no names, no calls)."""
    import ast

    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.List):
            return [walk(e) for e in node.elts]
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = walk(node.left), walk(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ValueError(f"unsupported element in {value!r}")

    return walk(ast.parse(value.strip(), mode="eval"))


def _add_moe_args(parser):
    """Mixture-of-experts flags (Megatron-LM 0.16.1 names, types and defaults; megatron/core/transformer/moe/,
    docs/moe.md). The few settings without an implementation stop in validate_args with one line
    (megatron/training/arguments/unimplemented.py)."""
    group = parser.add_argument_group(title="moe")

    group.add_argument("--expert-model-parallel-size", type=int, default=1, help="Expert model parallel size (EP).")
    group.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                       help="Tensor parallel size of the experts (--tensor-model-parallel-size if not given).")
    group.add_argument("--moe-layer-freq", type=layer_pattern, default=1,
                       help="Every N-th layer is an MoE layer (int N), or a 0/1 list expression per layer.")
    group.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                       help="Hidden size of each expert's MLP (--ffn-hidden-size if not given).")
    group.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                       help="Total hidden size of the shared experts (none if not given).")
    group.add_argument("--moe-shared-expert-gate", action="store_true", help="Gate the shared experts' output.")
    group.add_argument("--moe-shared-expert-overlap", action="store_true",
                       help="Overlap the shared experts with the token dispatch (alltoall dispatcher only).")
    group.add_argument("--moe-grouped-gemm", action="store_true", help="Compute the local experts with grouped GEMMs.")
    group.add_argument("--moe-use-legacy-grouped-gemm", action="store_true",
                       help="Use the legacy GroupedMLP (grouped_gemm package) for --moe-grouped-gemm.")
    group.add_argument("--moe-layer-recompute", action="store_true", help="Recompute the MoE layers in backward.")
    group.add_argument("--moe-router-load-balancing-type", nargs="+", type=str, default="aux_loss",
                       choices=["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "quantile_balancing", "none"],
                       help="Load-balancing strategy (several: one --moe-aux-loss-coeff each).")
    group.add_argument("--moe-router-dtype", type=str, default=None, choices=["fp32", "fp64"],
                       help="Data type of the router's GEMM, routing and probability weighting.")
    group.add_argument("--moe-router-fusion", action="store_true", help="Fused router kernels (Transformer Engine).")
    group.add_argument("--moe-router-score-function", type=str, default="softmax",
                       choices=["softmax", "sigmoid", "sqrtsoftplus"],
                       help="Router score function.")
    group.add_argument("--moe-router-topk", type=int, default=2, help="Experts each token is routed to (k).")
    group.add_argument("--moe-router-pre-softmax", action="store_true",
                       help="Softmax over all experts before the top-k selection.")
    group.add_argument("--moe-router-num-groups", type=int, default=None, help="Expert groups (group-limited routing).")
    group.add_argument("--moe-router-group-topk", type=int, default=None, help="Groups selected per token.")
    group.add_argument("--moe-router-topk-scaling-factor", type=float, default=None,
                       help="Scale the top-k routing probabilities by this factor.")
    group.add_argument("--moe-router-enable-expert-bias", action="store_true",
                       help="Aux-loss-free load balancing with a per-expert bias (sigmoid scores only).")
    group.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3,
                       help="Update rate of the expert bias.")
    group.add_argument("--moe-aux-loss-coeff", type=float, nargs="+", default=0.0,
                       help="Coefficient(s) of the auxiliary load-balancing loss (0 disables it).")
    group.add_argument("--moe-z-loss-coeff", type=float, default=None, help="Coefficient of the router z-loss.")
    group.add_argument("--moe-input-jitter-eps", type=float, default=None,
                       help="Multiply the router input by U(1-eps, 1+eps).")
    group.add_argument("--moe-per-layer-logging", action="store_true", help="Log the MoE losses of every layer.")
    group.add_argument("--moe-token-dispatcher-type", type=str, default="allgather",
                       choices=["allgather", "alltoall", "flex"], help="How tokens are dispatched to the experts.")
    group.add_argument("--moe-expert-capacity-factor", type=float, default=None,
                       help="Expert capacity factor (dropless if not given; a negative value means not given).")
    group.add_argument("--moe-pad-expert-input-to-capacity", action="store_true",
                       help="Pad each expert's input to its capacity (needs --moe-expert-capacity-factor).")
    group.add_argument("--moe-token-drop-policy", type=str, default="probs", choices=["probs", "position"],
                       help="Which tokens are dropped over capacity: lowest probability, or last positions.")
    group.add_argument("--moe-permute-fusion", action="store_true", help="Fused token permutation (Transformer Engine).")
    group.add_argument("--moe-latent-size", type=int, default=None,
                       help="Compute the experts on this latent width (fc1/fc2 latent projections around them).")
    return parser


def _add_hybrid_args(group):
    """Hybrid Mamba models (Megatron-LM HEAD's names, types and defaults; megatron/core/ssm/, pretrain_mamba.py), in
    the network-size group as in Megatron-LM 0.16."""

    group.add_argument("--hybrid-layer-pattern", type=str, default=None,
                       help="One character per layer: M Mamba, * attention, - MLP, E MoE; | separates pipeline "
                            "segments. Makes the model hybrid; --num-layers follows from it.")
    group.add_argument("--hybrid-override-pattern", type=str, default=None,
                       help="Deprecated alias of --hybrid-layer-pattern.")
    group.add_argument("--is-hybrid-model", action="store_true",
                       help="A hybrid Mamba model (needs --hybrid-layer-pattern); output projections are initialised "
                            "with std / sqrt(num-layers).")
    group.add_argument("--mamba-state-dim", type=int, default=128, help="State dimension N of the Mamba-2 mixer.")
    group.add_argument("--mamba-head-dim", type=int, default=64, help="Head dimension P of the Mamba-2 mixer.")
    group.add_argument("--mamba-num-groups", type=int, default=8, help="Groups G of B and C in the Mamba-2 mixer.")
    group.add_argument("--mamba-num-heads", type=int, default=None,
                       help="Heads H of the Mamba-2 mixer (2 x hidden-size / mamba-head-dim if not given).")
    group.add_argument("--disable-mamba-mem-eff-path", action="store_false", dest="use_mamba_mem_eff_path",
                       help="Megatron's unfused Mamba training path (the same PyTorch math here).")
    group.add_argument("--mamba-training-ssm-states-dtype", type=str, default=None, choices=["fp32", "bf16"],
                       help="Data type of the Mamba scan's inter-chunk states in training (fp32 if not given).")


def _add_retro_args(parser):
    group = parser.add_argument_group(title="retro")

    group.add_argument("--retro-workdir", default=None,
                       help="Retro working directory (holds args.json written by retro preprocessing).")
    group.add_argument("--retro-add-retriever", action="store_true", default=False,
                       help="Add a retriever to the GPT model (Retro).")
    group.add_argument("--retro-cyclic-train-iters", type=int, default=None,
                       help="Number of iterations after which the retro training data cycles.")
    group.add_argument("--retro-encoder-layers", type=int, default=2, help="Number of retro encoder layers.")
    group.add_argument("--retro-encoder-hidden-dropout", type=float, default=0.1,
                       help="Hidden dropout of the retro encoder.")
    group.add_argument("--retro-encoder-attention-dropout", type=float, default=0.1,
                       help="Attention dropout of the retro encoder.")
    group.add_argument("--retro-num-neighbors", type=int, default=2, help="Number of neighbours to retrieve.")
    group.add_argument("--retro-num-retrieved-chunks", type=int, default=2,
                       help="Number of chunks to retrieve from the retrieval database.")
    group.add_argument("--retro-return-doc-ids", action="store_true", help="Return document ids from the retriever.")

    # Megatron keeps every retro flag under one prefix; a flag added here without it is a bug in this file.
    for action in group._group_actions:
        if not action.dest.startswith("retro_"):
            raise AssertionError(f"retro flags must be named --retro-*: fix {', '.join(action.option_strings)}")
    return parser
