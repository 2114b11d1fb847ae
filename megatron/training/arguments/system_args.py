"""Flags about the job rather than the model: distributed, data, autoresume, logging, inference.

Names, types, defaults and destinations follow Megatron-LM's
``megatron/training/arguments.py`` (https://github.com/NVIDIA/Megatron-LM).
"""
from __future__ import annotations

from megatron.tokenizer.tokenizer import TOKENIZER_TYPES  # the one table of tokenizer names


def _add_distributed_args(parser):
    group = parser.add_argument_group(title="distributed")

    group.add_argument("--pipeline-model-parallel-split-rank", type=int, default=None,
                       help="Pipeline rank where the decoder starts (encoder-decoder models).")
    group.add_argument("--model-parallel-size", type=int, default=None,
                       help="Deprecated: use --tensor-model-parallel-size.")
    group.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                       help="Layers per virtual pipeline stage (interleaved schedule).")
    group.add_argument("--overlap-p2p-communication", action="store_true", dest="overlap_p2p_comm", default=True,
                       help="Pipeline send/receive as separate isend/irecv calls (2023 spelling; the default now).")
    group.add_argument("--no-overlap-p2p-communication", action="store_false", dest="overlap_p2p_comm",
                       help="Pipeline send/receive batched into one batch_isend_irecv call.")
    group.add_argument("--cp-comm-type", nargs="+", type=str, default=["p2p"],
                       help="Context-parallel communication per layer (one value for all, or one per layer): "
                            "p2p, all_gather, a2a or a2a+p2p.")
    group.add_argument("--distributed-backend", default="nccl", choices=["nccl", "gloo"],
                       help="torch.distributed backend (gloo is used whenever CUDA is not available).")
    group.add_argument("--distributed-timeout-minutes", type=float, default=10,
                       help="Timeout of torch.distributed collectives, in minutes (a fraction is accepted: 0.25 is "
                            "15 s). A failed or killed rank ends every rank well within it (see fault_handling.py).")
    group.add_argument("--hang-timeout-minutes", type=float, default=5.0,
                       help="A rank whose training progress (iteration, micro-batch, phase) stops for this long while "
                            "the others go on or wait for it is named by every rank, prints its Python stack, and "
                            "the job exits 1 (see hang_detection.py); keep it below --distributed-timeout-minutes "
                            "and above the longest checkpoint save. Fractions accepted; 0 turns it off.")
    group.add_argument("--log-straggler", action="store_true",
                       help="At every log interval, print the slowest and fastest ranks by their compute time per "
                            "iteration (waits in collectives excluded); one small all-gather per log interval.")
    group.add_argument("--straggler-minmax-count", type=int, default=1,
                       help="Number of slowest and fastest ranks the --log-straggler report lists.")
    group.add_argument("--DDP-impl", default="local", choices=["local", "torch"],
                       help="Data-parallel implementation.")
    group.add_argument("--no-contiguous-buffers-in-local-ddp", action="store_false",
                       dest="use_contiguous_buffers_in_local_ddp",
                       help="Do not keep gradients in one contiguous buffer in local DDP.")
    group.add_argument("--no-scatter-gather-tensors-in-pipeline", action="store_false",
                       dest="scatter_gather_tensors_in_pipeline",
                       help="Send whole tensors between pipeline stages instead of tensor-parallel slices.")
    group.add_argument("--local-rank", "--local_rank", type=int, default=0,
                       help="Local rank passed by the launcher (torchrun sets LOCAL_RANK, which wins).")
    group.add_argument("--lazy-mpu-init", action="store_true",
                       help="Defer process-group creation to an external launcher (returns a continuation).")
    group.add_argument("--empty-unused-memory-level", default=0, type=int, choices=[0, 1, 2],
                       help="Release cached accelerator memory each iteration: 0 never, 1 moderately, 2 aggressively.")
    group.add_argument("--standalone-embedding-stage", action="store_true",
                       help="Give the input embedding a pipeline stage of its own.")
    group.add_argument("--use-distributed-optimizer", action="store_true",
                       help="Shard the optimizer state across data-parallel ranks.")
    group.add_argument("--overlap-grad-reduce", action="store_true",
                       help="Overlap the data-parallel gradient reduction with the backward pass (bucketed).")
    group.add_argument("--ddp-bucket-size", type=int, default=None,
                       help="Elements per gradient bucket with --overlap-grad-reduce (default 40M).")
    group.add_argument("--overlap-param-gather", action="store_true",
                       help="Distributed optimizer: all-gather the updated parameters bucket by bucket during the "
                            "next forward pass instead of right after the optimizer step.")
    group.add_argument("--overlap-param-gather-with-optimizer-step", action="store_true",
                       help="Start the first model chunk's parameter all-gather right after its optimizer step "
                            "(interleaved pipeline only).")
    group.add_argument("--no-align-param-gather", action="store_false", dest="align_param_gather",
                       help="Interleaved pipeline: let each chunk's forward hooks launch the parameter all-gathers "
                            "instead of the schedule launching them at aligned points.")
    group.add_argument("--fake-process-group", action="store_true",
                       help="Run this one process as rank RANK of a WORLD_SIZE-rank job with a fake process group: "
                            "every collective returns at once without moving data (values are meaningless, shapes "
                            "and memory are real). Builds that rank's groups, model shard and optimizer and runs its "
                            "iterations, to check a large layout and its memory on one machine (docs/reliability.md).")
    return parser


def _add_rerun_machine_args(parser):
    """The rerun state machine (megatron/core/rerun_state_machine.py) and its checks."""
    group = parser.add_argument_group(title="rerun engine")
    group.add_argument("--rerun-mode", type=str, default="validate_results",
                       choices=["disabled", "validate_results", "report_stats"],
                       help="validate_results: re-run an iteration whose loss or gradients fail a check, to tell a "
                            "transient fault (exit 17) from a reproducible result (checkpoint, exit 16, resume on "
                            "another device); report_stats: re-run every iteration once and report the run-to-run "
                            "differences; disabled: a failed check stops the run.")
    group.add_argument("--error-injection-rate", type=int, default=0,
                       help="Inject an error about once every this many validations (0: never), to test the rerun "
                            "state machine.")
    group.add_argument("--error-injection-type", type=str, default="transient_error",
                       choices=["correct_result", "transient_error", "persistent_error"],
                       help="What an injected error looks like on the re-runs.")
    group.add_argument("--check-for-spiky-loss", action="store_true",
                       help="Re-run an iteration whose local loss is at least 10x the largest of the first 100 "
                            "(non-fatal).")
    group.add_argument("--check-for-nan-in-loss-and-grad", "--check-for-nan-in-grad", action="store_true",
                       dest="check_for_nan_in_loss_and_grad",
                       help="Check every rank's local loss and gradients (before the data-parallel reduction) for "
                            "NaN/Inf (the default; with --fp16 only NaN: Inf is an overflow that skips the step). "
                            "--check-for-nan-in-grad is an older name of this flag.")
    group.add_argument("--no-check-for-nan-in-loss-and-grad", action="store_false",
                       dest="check_for_nan_in_loss_and_grad", help="Do not check for NaN/Inf.")
    group.add_argument("--check-for-large-grads", action="store_true",
                       help="Re-run an iteration whose local gradient norm is at least 10x the largest of the first "
                            "100 (non-fatal).")
    group.add_argument("--result-rejected-tracker-filename", type=str, default=None,
                       help="Append every rejected result and re-run verdict to this file; at start-up an iteration "
                            "whose bad result reproduced twice for the same rank is skipped.")
    group.add_argument("--iterations-to-skip", nargs="+", type=int, default=[],
                       help="Iterations that run a dummy step (the data iterator advances, nothing is trained).")
    group.set_defaults(check_for_nan_in_loss_and_grad=True)
    return parser


def _add_data_args(parser):
    group = parser.add_argument_group(title="data and dataloader")

    group.add_argument("--data-path", nargs="*", default=None,
                       help="One dataset prefix, or weights and prefixes: w1 p1 w2 p2 ...")
    group.add_argument("--split", type=str, default=None,
                       help="Train/validation/test split as comma-separated weights, e.g. '90,5,5' ('969, 30, 1' "
                            "with --data-path when not given, with a warning).")
    group.add_argument("--train-data-path", nargs="*", default=None, help="Training dataset prefix(es).")
    group.add_argument("--valid-data-path", nargs="*", default=None, help="Validation dataset prefix(es).")
    group.add_argument("--test-data-path", nargs="*", default=None, help="Test dataset prefix(es).")
    group.add_argument("--data-cache-path", default=None, help="Directory for the dataset index caches.")
    group.add_argument("--mock-data", action="store_true",
                       help="Train on generated tokens instead of --data-path (for testing).")
    group.add_argument("--no-mmap-bin-files", action="store_false", dest="mmap_bin_files",
                       help="Read the .bin files with open/seek/read per sample instead of memory-mapping them.")
    group.add_argument("--no-create-attention-mask-in-dataloader", action="store_false",
                       dest="create_attention_mask_in_dataloader",
                       help="Samples carry no attention_mask; the model applies the causal mask itself.")
    group.add_argument("--vocab-size", type=int, default=None, help="Vocabulary size (with NullTokenizer).")
    group.add_argument("--padded-vocab-size", type=int, default=None,
                       help="Rows of the embedding and output layer, used as given (no padding by "
                            "--make-vocab-size-divisible-by); must hold the tokenizer's vocabulary and divide by "
                            "--tensor-model-parallel-size.")
    group.add_argument("--no-pad-vocab-size", "--disable-pad-vocab-size", action="store_false", dest="pad_vocab_size",
                       help="Do not pad the vocabulary (the embedding has exactly the tokenizer's rows; they must "
                            "divide by --tensor-model-parallel-size).")
    group.add_argument("--vocab-file", type=str, default=None, help="Vocabulary file.")
    group.add_argument("--merge-file", type=str, default=None, help="BPE merge file.")
    group.add_argument("--vocab-extra-ids", type=int, default=0,
                       help="Number of extra sentinel tokens added to the vocabulary (T5).")
    group.add_argument("--seq-length", type=int, default=None, help="Maximum sequence length to process.")
    group.add_argument("--encoder-seq-length", type=int, default=None,
                       help="Encoder sequence length (alternative to --seq-length).")
    group.add_argument("--decoder-seq-length", type=int, default=None, help="Decoder sequence length.")
    group.add_argument("--retriever-seq-length", type=int, default=256,
                       help="Sequence length of the biencoder retriever model.")
    group.add_argument("--sample-rate", type=float, default=1.0,
                       help="Fraction of the input data used for training (0, 1].")
    group.add_argument("--mask-prob", type=float, default=0.15, help="Probability of masking a token (BERT).")
    group.add_argument("--short-seq-prob", type=float, default=0.1,
                       help="Probability of producing a short sequence (BERT).")
    group.add_argument("--mmap-warmup", action="store_true", help="Warm up the memory-mapped dataset files.")
    group.add_argument("--num-workers", type=int, default=2, help="Data loader worker processes.")
    group.add_argument("--tokenizer-type", type=str, default=None,
                       choices=list(TOKENIZER_TYPES) + ["MultimodalTokenizer", "NullMultimodalTokenizer", "SFTTokenizer"],
                       help="Tokenizer (the multimodal and SFT tokenizers are not available).")
    group.add_argument("--tokenizer-model", type=str, default=None,
                       help="SentencePiece model file, Hugging Face tokenizer directory, or TikTokenizer JSON "
                            "vocabulary.")
    group.add_argument("--trust-remote-code", action="store_true",
                       help="Let a Hugging Face tokenizer directory run its own code (transformers' trust_remote_code).")
    group.add_argument("--tiktoken-pattern", type=str, default=None, choices=["v1", "v2"],
                       help="Pre-tokenisation pattern of TikTokenizer.")
    group.add_argument("--tiktoken-num-special-tokens", type=int, default=1000,
                       help="Number of special-token ids before the BPE ids of TikTokenizer.")
    group.add_argument("--tiktoken-special-tokens", type=str, nargs="+", default=None,
                       help="TikTokenizer's special tokens (must include <unk>, <s>, </s>).")
    group.add_argument("--data-impl", type=str, default="infer", choices=["mmap", "infer"],
                       help="Indexed dataset implementation.")
    group.add_argument("--reset-position-ids", action="store_true", help="Restart position ids after each EOD token.")
    group.add_argument("--reset-attention-mask", action="store_true",
                       help="Do not attend across EOD tokens (documents).")
    group.add_argument("--eod-mask-loss", action="store_true", help="Exclude EOD tokens from the loss.")
    return parser


def _add_autoresume_args(parser):
    group = parser.add_argument_group(title="autoresume")

    group.add_argument("--adlr-autoresume", action="store_true", help="Enable ADLR autoresume.")
    group.add_argument("--adlr-autoresume-interval", type=int, default=1000,
                       help="Check for an autoresume request every this many iterations.")
    return parser


def _add_logging_args(parser):
    group = parser.add_argument_group(title="logging")

    group.add_argument("--log-params-norm", action="store_true", help="Log the norm of the parameters.")
    group.add_argument("--log-num-zeros-in-grad", action="store_true", help="Log the number of zeros in the gradient.")
    group.add_argument("--log-throughput", action="store_true", help="Log the throughput per GPU (TFLOP/s).")
    group.add_argument("--timing-log-level", type=int, default=0, choices=range(0, 3),
                       help="Which timers to record: 0 iteration only, 1 + coarse phases, 2 + fine-grained.")
    group.add_argument("--no-barrier-with-level-1-timing", action="store_false", dest="barrier_with_L1_time",
                       help="Do not synchronise ranks before level-1 timers.")
    group.add_argument("--timing-log-option", type=str, default="minmax", choices=["max", "minmax", "all"],
                       help="Report timers as the max, the (min, max), or every rank's value.")
    group.add_argument("--tensorboard-log-interval", type=int, default=1, help="TensorBoard logging interval.")
    group.add_argument("--tensorboard-queue-size", type=int, default=1000,
                       help="Events TensorBoard queues before flushing to disk.")
    group.add_argument("--log-timers-to-tensorboard", action="store_true", help="Write timers to TensorBoard.")
    group.add_argument("--log-batch-size-to-tensorboard", action="store_true",
                       help="Write the batch size to TensorBoard.")
    group.add_argument("--no-log-learnig-rate-to-tensorboard", action="store_false",
                       dest="log_learning_rate_to_tensorboard",
                       help="Do not write the learning rate to TensorBoard (flag spelled as in Megatron-LM).")
    group.add_argument("--no-log-loss-scale-to-tensorboard", "--disable-log-loss-scale-to-tensorboard",
                       action="store_false",
                       dest="log_loss_scale_to_tensorboard", help="Do not write the loss scale to TensorBoard.")
    group.add_argument("--log-validation-ppl-to-tensorboard", action="store_true",
                       help="Write the validation perplexity to TensorBoard.")
    group.add_argument("--log-memory-to-tensorboard", action="store_true", help="Write memory usage to TensorBoard.")
    group.add_argument("--log-world-size-to-tensorboard", action="store_true",
                       help="Write the world size to TensorBoard.")
    group.add_argument("--wandb-project", type=str, default=None,
                       help="Weights & Biases project (optional; needs wandb).")
    group.add_argument("--wandb-exp-name", type=str, default=None, help="Weights & Biases run name.")
    group.add_argument("--wandb-save-dir", type=str, default=None, help="Directory for Weights & Biases files.")
    return parser


def _add_inference_args(parser):
    group = parser.add_argument_group(title="inference")

    group.add_argument("--inference-batch-times-seqlen-threshold", type=int, default=-1,
                       help="Above this batch * sequence length, inference pipelines micro-batches (performance "
                            "only: generation runs the whole batch at once here).")
    group.add_argument("--max-tokens-to-oom", type=int, default=12000,
                       help="Maximum number of tokens generated before running out of memory is likely (not "
                            "available: no such limit here).")
    group.add_argument("--output-bert-embeddings", action="store_true", help="Output BERT embeddings.")
    group.add_argument("--bert-embedder-type", default="megatron", choices=["megatron", "huggingface"],
                       help="Which BERT embedder to use.")
    return parser
