"""Flags that describe a training run: training, learning rate, checkpointing, mixed precision, validation.

Names, types, defaults and destinations follow Megatron-LM's
``megatron/training/arguments.py`` (https://github.com/NVIDIA/Megatron-LM).
"""
from __future__ import annotations


def _add_training_args(parser):
    group = parser.add_argument_group(title="training")

    group.add_argument("--micro-batch-size", type=int, default=None,
                       help="Batch size per model instance (local batch size).")
    group.add_argument("--batch-size", type=int, default=None, help="Deprecated: use --micro-batch-size.")
    group.add_argument("--global-batch-size", type=int, default=None,
                       help="Training batch size; micro-batch-size * data-parallel size if not given.")
    group.add_argument("--rampup-batch-size", nargs="*", default=None,
                       help="Batch-size ramp-up: <start batch size> <batch size increment> <ramp-up samples>.")
    group.add_argument("--step-batch-size-schedule", type=str, default=None,
                       help="Step-wise global batch size: 'THRESHOLD:BS' pairs separated by spaces or commas, "
                            "thresholds in consumed tokens with optional K/M/B/T suffixes (e.g. '0:16 2.4B:320'); "
                            "the first threshold must be 0. --global-batch-size, if given, must equal the last BS.")
    group.add_argument("--manual-gc", action="store_true",
                       help="Disable Python's automatic garbage collector and collect only at the points given by "
                            "--manual-gc-interval and around evaluation, the same on every rank.")
    group.add_argument("--manual-gc-interval", type=int, default=0,
                       help="With --manual-gc: run a full gc.collect() every this many iterations (0: never).")
    group.add_argument("--no-manual-gc-eval", "--disable-manual-gc-eval", action="store_false", dest="manual_gc_eval",
                       help="With --manual-gc: do not collect before and after each periodic evaluation.")
    group.add_argument("--recompute-activations", action="store_true",
                       help="Recompute activations (selective granularity).")
    group.add_argument("--profile", action="store_true",
                       help="Profile iterations --profile-step-start..--profile-step-end: nsys ranges (CUDA), or "
                            "with --use-pytorch-profiler a PyTorch profiler trace in --tensorboard-dir.")
    group.add_argument("--profile-step-start", type=int, default=10, help="Global step at which to start profiling.")
    group.add_argument("--profile-step-end", type=int, default=12, help="Global step at which to stop profiling.")
    group.add_argument("--profile-ranks", nargs="+", type=int, default=[],
                       help="Global ranks to profile (default: all ranks).")
    group.add_argument("--use-pytorch-profiler", action="store_true",
                       help="With --profile: use torch.profiler and write TensorBoard traces to --tensorboard-dir.")
    group.add_argument("--checkpoint-activations", action="store_true",
                       help="Deprecated: use --recompute-activations or --recompute-granularity.")
    group.add_argument("--train-iters", type=int, default=None,
                       help="Total number of iterations to train (exclusive with --train-samples).")
    group.add_argument("--train-samples", type=int, default=None,
                       help="Total number of samples to train (exclusive with --train-iters).")
    group.add_argument("--log-interval", type=int, default=100, help="Report loss and timing every this many iterations.")
    group.add_argument("--exit-interval", type=int, default=None,
                       help="Exit when the iteration is divisible by this value.")
    group.add_argument("--exit-duration-in-mins", type=float, default=None,
                       help="Save and exit after this many minutes (a fraction is accepted).")
    group.add_argument("--exit-signal-handler", action="store_true",
                       help="Save a checkpoint and exit when SIGTERM is received.")
    group.add_argument("--tensorboard-dir", type=str, default=None, help="Write TensorBoard logs to this directory.")
    group.add_argument("--no-masked-softmax-fusion", action="store_false", dest="masked_softmax_fusion",
                       help="Do not fuse scaling, masking and softmax.")
    group.add_argument("--no-bias-gelu-fusion", action="store_false", dest="bias_gelu_fusion",
                       help="Do not fuse the bias add and GeLU.")
    group.add_argument("--no-bias-dropout-fusion", action="store_false", dest="bias_dropout_fusion",
                       help="Do not fuse the bias add and dropout.")
    # Newer Megatron-LM fusion flags (both spellings accepted; the compiled kernels run on CUDA).
    group.add_argument("--bias-gelu-fusion", action="store_true", dest="bias_gelu_fusion",
                       help="Fuse the bias add and GeLU (the default).")
    group.add_argument("--no-bias-swiglu-fusion", action="store_false", dest="bias_swiglu_fusion",
                       help="Do not fuse the bias add and SwiGLU of a --swiglu MLP.")
    group.add_argument("--bias-swiglu-fusion", action="store_true", dest="bias_swiglu_fusion",
                       help="Fuse the bias add and SwiGLU of a --swiglu MLP (the default).")
    group.add_argument("--no-rope-fusion", action="store_false", dest="apply_rope_fusion",
                       help="Do not fuse the rotary position embedding into one kernel.")
    group.add_argument("--apply-rope-fusion", action="store_true", dest="apply_rope_fusion",
                       help="Fuse the rotary position embedding into one kernel (the default).")
    group.add_argument("--enable-cuda-graph", action="store_true",
                       help="Capture the transformer layers' forward in CUDA graphs (performance only: not captured "
                            "here, said once in the log).")
    group.add_argument("--external-cuda-graph", action="store_true",
                       help="CUDA graphs captured by the training script (performance only: not captured here).")
    group.set_defaults(bias_gelu_fusion=True, bias_swiglu_fusion=True, apply_rope_fusion=True)
    group.add_argument("--use-flash-attn", action="store_true", help="Use FlashAttention when available.")
    group.add_argument("--deterministic-mode", action="store_true",
                       help="Choose code that has deterministic execution. This usually means slower execution, "
                            "but is good for debugging and testing (see megatron/training/deterministic.py).")
    group.add_argument("--optimizer", type=str, default="adam",
                       choices=["adam", "sgd", "muon", "dist_muon", "lion", "soap", "adaptive_muon"],
                       help="Optimizer (adam or sgd; the others are not available).")
    group.add_argument("--dataloader-type", type=str, default=None, choices=["single", "cyclic", "external"],
                       help="Single pass or cyclic data loader ('single' if not given).")
    group.add_argument("--no-async-tensor-model-parallel-allreduce", action="store_false",
                       dest="async_tensor_model_parallel_allreduce",
                       help="Do not overlap the input-gradient all-reduce with the weight-gradient GEMM.")
    group.add_argument("--no-persist-layer-norm", action="store_true",
                       help="Do not use apex's persistent fused layer-norm kernel (performance only: never used here).")
    group.add_argument("--no-gradient-accumulation-fusion", action="store_false", dest="gradient_accumulation_fusion",
                       help="Do not fuse weight-gradient computation with accumulation into main_grad.")
    group.add_argument("--use-legacy-models", action="store_true",
                       help="Build the legacy megatron.legacy.model classes instead of megatron.core's models "
                            "(needs --ckpt-format torch).")
    group.add_argument("--use-mcore-models", action="store_true", dest="deprecated_use_mcore_models",
                       help="Deprecated no-op: megatron.core's models are the default.")
    return parser


def _add_learning_rate_args(parser):
    group = parser.add_argument_group(title="learning rate")

    group.add_argument("--lr", type=float, default=None, help="Peak learning rate.")
    group.add_argument("--lr-decay-style", type=str, default="linear",
                       choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
                       help="Learning rate decay (WSD is not available).")
    group.add_argument("--lr-decay-iters", type=int, default=None,
                       help="Iterations to decay over (--train-iters if not given).")
    group.add_argument("--lr-decay-samples", type=int, default=None,
                       help="Samples to decay over (--train-samples if not given).")
    group.add_argument("--lr-warmup-fraction", type=float, default=None,
                       help="Fraction of the decay steps used for linear warmup.")
    group.add_argument("--lr-warmup-iters", type=int, default=0, help="Iterations of linear warmup.")
    group.add_argument("--lr-warmup-samples", type=int, default=0, help="Samples of linear warmup.")
    group.add_argument("--lr-warmup-init", type=float, default=0.0, help="Learning rate at the start of warmup.")
    group.add_argument("--warmup", type=int, default=None, help="Deprecated: use --lr-warmup-fraction.")
    group.add_argument("--min-lr", type=float, default=0.0, help="Learning rate floor of the decay.")
    group.add_argument("--decoupled-lr", type=float, default=None,
                       help="Separate peak learning rate for the input embedding and output layer weights.")
    group.add_argument("--decoupled-min-lr", type=float, default=None,
                       help="Minimum learning rate of the input embedding and output layer weights "
                            "(--min-lr if not given).")
    group.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler", action="store_true",
                       help="Use the scheduler values from the flags, ignoring those in the checkpoint.")
    group.add_argument("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler",
                       action="store_true",
                       help="Use the scheduler values from the checkpoint, ignoring the flags.")
    return parser


def _add_checkpointing_args(parser):
    group = parser.add_argument_group(title="checkpointing")

    group.add_argument("--save", type=str, default=None, help="Directory to save checkpoints to.")
    group.add_argument("--save-interval", "--persistent-save-interval", type=int, default=None,
                       help="Save a checkpoint every this many iterations.")
    group.add_argument("--no-save-optim", action="store_true", default=None, help="Do not save the optimizer state.")
    group.add_argument("--no-save-rng", action="store_true", default=None, help="Do not save the RNG state.")
    group.add_argument("--load", type=str, default=None, help="Directory containing a checkpoint to load.")
    group.add_argument("--no-load-optim", action="store_true", default=None, help="Do not load the optimizer state.")
    group.add_argument("--no-load-rng", action="store_true", default=None, help="Do not load the RNG state.")
    group.add_argument("--finetune", action="store_true",
                       help="Load model weights only; reset iteration, optimizer and RNG state.")
    group.add_argument("--use-checkpoint-args", action="store_true",
                       help="Override model flags with those stored in the checkpoint given by --load.")
    group.add_argument("--exit-on-missing-checkpoint", action="store_true",
                       help="Exit instead of training from scratch when --load has no checkpoint.")
    group.add_argument("--ckpt-step", type=int, default=None,
                       help="Load the checkpoint of this iteration instead of the one the tracker file names.")
    group.add_argument("--pretrained-checkpoint", type=str, default=None,
                       help="Checkpoint to start a finetune from when --load holds none (implies --finetune).")
    group.add_argument("--ckpt-format", type=str, default="torch_dist",
                       choices=["torch", "torch_dist", "torch_dcp", "fsdp_dtensor"],
                       help="Checkpoint format: distributed, reshardable, Megatron-LM's layout (torch_dist, the "
                            "default) or one file per model-parallel rank (torch).")
    group.add_argument("--async-save", action="store_true",
                       help="Write torch_dist checkpoints in a background thread; finished before the next save, "
                            "a load, or the end of training.")
    group.add_argument("--dist-ckpt-strictness", type=str, default="assume_ok_unexpected",
                       choices=["assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected", "raise_all",
                                "return_unexpected", "return_all", "ignore_all"],
                       help="torch_dist load: what to do with keys this model needs that the checkpoint lacks "
                            "(unexpected) and checkpoint keys the model does not use (missing).")
    group.add_argument("--auto-detect-ckpt-format", action="store_true",
                       help="Load whichever format --load holds (metadata.json: torch_dist; mp_rank_*: torch), "
                            "whatever --ckpt-format says (which still decides the format of saves).")
    group.add_argument("--ckpt-fully-parallel-save", action="store_true", dest="ckpt_fully_parallel_save_deprecated",
                       help="Deprecated no-op (fully parallel save is the default).")
    group.add_argument("--no-ckpt-fully-parallel-save", action="store_false", dest="ckpt_fully_parallel_save",
                       help="torch_dist: accepted for Megatron compatibility; here every distinct chunk is written "
                            "once by one of the ranks holding it (DCP de-duplication) either way.")
    group.add_argument("--ckpt-fully-parallel-load", action="store_true",
                       help="torch_dist: accepted for Megatron compatibility; every rank reads only its own chunks "
                            "either way.")
    group.add_argument("--ckpt-assume-constant-structure", action="store_true",
                       help="torch_dist: accepted for Megatron compatibility; save plans are recomputed every save.")
    group.add_argument("--dist-ckpt-optim-fully-reshardable", action="store_true",
                       help="torch_dist: the distributed optimizer is always saved in Megatron's fully_reshardable "
                            "form here (optimizer.state.{param,exp_avg,exp_avg_sq}.<key>), with or without it.")
    group.add_argument("--use-persistent-ckpt-worker", action="store_true",
                       help="--async-save: accepted for Megatron compatibility; the background save is a thread.")
    return parser


def _add_mixed_precision_args(parser):
    group = parser.add_argument_group(title="mixed precision")

    group.add_argument("--loss-scale", type=float, default=None,
                       help="Static loss scale (a power of 2 helps convergence); dynamic if not given.")
    group.add_argument("--initial-loss-scale", type=float, default=2 ** 32, help="Initial dynamic loss scale.")
    group.add_argument("--min-loss-scale", type=float, default=1.0, help="Minimum dynamic loss scale.")
    group.add_argument("--loss-scale-window", type=float, default=1000,
                       help="Iterations without overflow before the dynamic loss scale grows.")
    group.add_argument("--hysteresis", type=int, default=2, help="Hysteresis of the dynamic loss scale.")
    group.add_argument("--no-query-key-layer-scaling", action="store_false", dest="apply_query_key_layer_scaling",
                       default=False, help="Do not scale Q * K^T by 1 / layer-number (the default now; the 2023 "
                                           "default was to scale: --apply-query-key-layer-scaling).")
    group.add_argument("--attention-softmax-in-fp32", action="store_true",
                       help="Compute the attention softmax in fp32.")
    group.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                       help="Accumulate and all-reduce gradients in fp32.")
    group.add_argument("--grad-reduce-in-bf16", action="store_true",
                       help="With --bf16: keep the gradient buffer in bf16, so micro-batch accumulation and the "
                            "data-parallel reduction run in bf16 (fp32 otherwise).")
    group.add_argument("--fp16-lm-cross-entropy", action="store_true",
                       help="Compute the unreduced cross entropy of the LM head in fp16.")
    return parser


def _add_validation_args(parser):
    group = parser.add_argument_group(title="validation")

    group.add_argument("--eval-iters", type=int, default=100, help="Iterations per validation/test evaluation.")
    group.add_argument("--eval-interval", type=int, default=None,
                       help="Evaluate every this many iterations (not given: only after training).")
    group.add_argument("--skip-train", action="store_true", help="Only evaluate; do not train.")
    return parser
