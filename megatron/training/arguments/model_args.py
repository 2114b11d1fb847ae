"""Flags that describe the model: network size, regularization, initialization, Transformer Engine, retro.

Names, types, defaults and destinations follow Megatron-LM's ``megatron/training/arguments.py``
(https://github.com/NVIDIA/Megatron-LM); each function adds one argument
group and returns the parser, as Megatron's ``_add_*_args`` do.
"""
from __future__ import annotations

import argparse


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

    group.add_argument("--encoder-num-layers", type=int, default=None,
                       help="Number of encoder transformer layers (alternative to --num-layers).")
    group.add_argument("--decoder-num-layers", type=int, default=None, help="Number of decoder transformer layers.")
    group.add_argument("--group-query-attention", action="store_true", help="Use grouped-query attention.")
    group.add_argument("--max-position-embeddings", type=int, default=None,
                       help="Largest sequence length the position embedding supports.")
    group.add_argument("--position-embedding-type", type=str, default="learned_absolute",
                       choices=["learned_absolute", "rope", "yarn", "mrope", "relative", "none"],
                       help="Position embedding type (yarn: RoPE with YaRN frequencies, --rotary-scaling-factor; "
                            "mrope and relative are not available).")
    group.add_argument("--use-rotary-position-embeddings", action="store_true",
                       help="Deprecated: use --position-embedding-type rope.")
    group.add_argument("--rotary-percent", type=float, default=1.0,
                       help="Fraction of each head's dimensions that rotary embeddings rotate.")
    group.add_argument("--rotary-seq-len-interpolation-factor", type=int, default=None,
                       help="Sequence-length interpolation factor for rotary embeddings.")
    group.add_argument("--rotary-base", type=int, default=10000, help="Base of the rotary embedding frequencies.")
    group.add_argument("--use-rope-scaling", action="store_true",
                       help="Apply Llama-3.x frequency scaling to the rotary embedding.")
    group.add_argument("--rope-scaling-factor", type=float, default=8.0,
                       help="Frequency scaling factor of --use-rope-scaling.")
    group.add_argument("--yarn-original-max-position-embeddings", type=int, default=None,
                       help="YaRN (--position-embedding-type yarn): original context length (4096 if not given).")
    group.add_argument("--yarn-beta-fast", type=float, default=None,
                       help="YaRN: rotations of the fastest kept frequency (32 if not given).")
    group.add_argument("--yarn-beta-slow", type=float, default=None,
                       help="YaRN: rotations of the slowest interpolated frequency (1 if not given).")
    group.add_argument("--yarn-correction-range-round-to-int", action="store_true", default=None,
                       help="YaRN: round the correction range to integers (the default).")
    group.add_argument("--no-yarn-correction-range-round-to-int", action="store_false",
                       dest="yarn_correction_range_round_to_int", help="YaRN: keep the correction range fractional.")
    group.add_argument("--no-position-embedding", action="store_false", dest="add_position_embedding",
                       help="Deprecated: disable the position embedding (only with rope).")
    group.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                       help="Pad the vocabulary to a multiple of this value times the tensor-parallel size.")
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


def _add_mla_args(parser):
    """Multi-latent attention sizes (Megatron-LM HEAD's "mla" group; megatron/core/transformer/
    multi_latent_attention.py)."""
    group = parser.add_argument_group(title="mla")

    group.add_argument("--q-lora-rank", type=int, default=None,
                       help="Rank of the query latent (none: queries projected straight from the hidden state).")
    group.add_argument("--kv-lora-rank", type=int, default=32, help="Rank of the key/value latent.")
    group.add_argument("--qk-head-dim", type=int, default=128, help="Query/key head size without position embedding.")
    group.add_argument("--qk-pos-emb-head-dim", type=int, default=64,
                       help="Query/key head size with the rotary position embedding (one shared key head).")
    group.add_argument("--v-head-dim", type=int, default=128, help="Value head size.")
    group.add_argument("--rotary-scaling-factor", type=float, default=1.0, help="YaRN rotary scaling factor.")
    group.add_argument("--mscale", type=float, default=1.0, help="YaRN mscale (attention concentration numerator).")
    group.add_argument("--mscale-all-dim", type=float, default=0.0,
                       help="YaRN mscale_all_dim (concentration denominator; multi-latent attention also scales its "
                            "softmax by its square).")
    group.add_argument("--rope-type", type=str, default=None, choices=["rope", "yarn"],
                       help="Rotary type of multi-latent attention (yarn if not given).")
    return parser


def _add_regularization_args(parser):
    group = parser.add_argument_group(title="regularization")

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
    group.add_argument("--init-method-xavier-uniform", action="store_true",
                       help="Use Xavier uniform weight initialisation.")
    return parser


def _add_transformer_engine_args(parser):
    group = parser.add_argument_group(title="Transformer-Engine")

    group.add_argument("--fp8-param-gather", action="store_true",
                       help="Keep the parameters in FP8 and all-gather them in FP8 (needs the distributed optimizer).")
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

    group.add_argument("--moe-layer-freq", type=layer_pattern, default=1,
                       help="Every N-th layer is an MoE layer (int N), or a 0/1 list expression per layer.")
    group.add_argument("--moe-use-legacy-grouped-gemm", action="store_true",
                       help="Use the legacy GroupedMLP (grouped_gemm package) for --moe-grouped-gemm.")
    group.add_argument("--moe-router-load-balancing-type", nargs="+", type=str, default="aux_loss",
                       choices=["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "quantile_balancing", "none"],
                       help="Load-balancing strategy (several: one --moe-aux-loss-coeff each).")
    group.add_argument("--moe-aux-loss-coeff", type=float, nargs="+", default=0.0,
                       help="Coefficient(s) of the auxiliary load-balancing loss (0 disables it).")
    return parser


def _add_hybrid_args(group):
    """Hybrid Mamba models: the deprecated alias of --hybrid-layer-pattern (the other hybrid flags are generated from
    their TransformerConfig fields)."""
    group.add_argument("--hybrid-override-pattern", type=str, default=None,
                       help="Deprecated alias of --hybrid-layer-pattern.")


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
