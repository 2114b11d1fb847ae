"""Flags that describe the model: network size, regularization, initialization, Transformer Engine, retro.

Names, types, defaults and destinations follow Megatron-LM's ``megatron/training/arguments.py``
(https://github.com/NVIDIA/Megatron-LM); each function adds one argument
group and returns the parser, as Megatron's ``_add_*_args`` do.
"""
from __future__ import annotations


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
                       choices=["learned_absolute", "rope"], help="Position embedding type.")
    group.add_argument("--use-rotary-position-embeddings", action="store_true",
                       help="Deprecated: use --position-embedding-type rope.")
    group.add_argument("--rotary-percent", type=float, default=1.0,
                       help="Fraction of each head's dimensions that rotary embeddings rotate.")
    group.add_argument("--rotary-seq-len-interpolation-factor", type=int, default=None,
                       help="Sequence-length interpolation factor for rotary embeddings.")
    group.add_argument("--no-position-embedding", action="store_false", dest="add_position_embedding",
                       help="Deprecated: disable the position embedding (only with rope).")
    group.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                       help="Pad the vocabulary to a multiple of this value times the tensor-parallel size.")
    group.add_argument("--layernorm-epsilon", type=float, default=1e-5, help="Layer-norm epsilon.")
    group.add_argument("--apply-layernorm-1p", action="store_true",
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
    group.add_argument("--no-fp8-wgrad", action="store_false", dest="fp8_wgrad",
                       help="Compute the weight gradients in higher precision under FP8.")
    group.add_argument("--transformer-impl", default="local", choices=["local", "transformer_engine"],
                       help="Which transformer implementation to use.")
    group.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"],
                       help="Normalization layer type.")
    return parser


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
