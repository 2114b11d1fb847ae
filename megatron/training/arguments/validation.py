"""``validate_args``: Megatron-LM's checks and derived values, in Megatron's order (``validate_args`` in
Megatron-LM's ``megatron/training/arguments.py``, https://github.com/NVIDIA/Megatron-LM).

Every user mistake raises :class:`ConfigurationError` with one line naming the flag(s) and the fix. Nothing
here needs a process group: the world size comes from the launcher's environment (``args.world_size``), so a
bad configuration fails before any rank waits on another. A few checks go beyond Megatron's own
``validate_args`` where Megatron would only fail later, deep inside model construction or training (heads vs.
TP size, layers vs. pipeline stages, batch ramp-up steps, recompute method); they are marked "(early)".
"""
from __future__ import annotations

import json
import os
import types

import torch

from megatron.core import device
from megatron.post_training.arguments import apply_modelopt_args
from megatron.tokenizer.vocab_padding import resolve_padded_vocab_size, unpadded_vocab_size
from megatron.training.arguments.fsdp_args import validate_fully_sharded
from megatron.training.arguments.mla_mtp_validation import validate_mla_and_mtp
from megatron.training.arguments.hybrid import validate_hybrid
from megatron.training.arguments.printing import _print_args
from megatron.training.arguments.model_variants import validate_model_variants
from megatron.training.arguments.registry import log_performance_only, refuse_not_available
from megatron.training.arguments.unimplemented import validate_unimplemented_features
from megatron.training.errors import ConfigurationError
from megatron.training.global_vars import get_retro_args, set_retro_args

# Deprecated flag -> what to use instead (Megatron's wording).
_REMOVED_FLAGS = {
    "batch_size": ("--batch-size", "use --micro-batch-size instead"),
    "warmup": ("--warmup", "use --lr-warmup-fraction instead"),
    "model_parallel_size": ("--model-parallel-size", "use --tensor-model-parallel-size instead"),
}


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigurationError(message)


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _log(args, message: str) -> None:
    if args.rank == 0 or getattr(args, "fake_process_group", False):  # a fake rank is the job's only process
        print(message, flush=True)


def validate_args(args, defaults={}):  # noqa: B006 - Megatron's signature; defaults is never mutated
    apply_modelopt_args(args, lambda message: _log(args, message))  # the configurations' ModelOpt flags, if added
    refuse_not_available(args)  # an option this library does not have: one line naming it (registry.py)
    log_performance_only(args, lambda message: _log(args, message))  # once: what runs instead (registry.py)
    validate_unimplemented_features(args)  # MoE, CP > 1, FP8: checked, then stop with one line
    _validate_parallel_sizes(args)
    _apply_deprecations(args)
    _apply_defaults(args, defaults)
    _apply_legacy_split(args)
    validate_fully_sharded(args)  # FSDP: Megatron's rules; Megatron-FSDP turns the distributed optimizer on
    _validate_batch_sizes(args)
    validate_hybrid(args)  # --hybrid-layer-pattern: derives --num-layers and the virtual pipeline size
    _set_virtual_pipeline_size(args)
    _set_precision(args)

    if args.dataloader_type is None:
        args.dataloader_type = "single"
    args.consumed_train_samples = 0
    args.consumed_valid_samples = 0
    # Only a data loader that yields sequences of different lengths sets this (it costs extra pipeline
    # communication to exchange shapes).
    args.variable_seq_lengths = False

    _validate_schedule_units(args)
    _validate_model_shape(args)
    _validate_lengths_and_misc(args)
    _validate_encoder_decoder(args)
    _set_weight_decay(args)
    _validate_recompute(args)
    _validate_sequence_parallel(args)
    _validate_features(args)
    validate_mla_and_mtp(args)
    validate_model_variants(args, lambda message: _log(args, message))  # gpt-oss / Llama 4 flags
    _validate_per_token_loss(args)
    _validate_decoupled_lr(args)
    _validate_param_gather(args)
    _validate_manual_gc(args)
    _validate_profiling(args)
    _validate_rerun_machine(args)
    _validate_paths(args)

    _set_padded_vocab_size(args)

    _print_args("arguments", args)
    retro_args = get_retro_args()
    if retro_args and args != retro_args:
        retro_only = {k: v for k, v in vars(retro_args).items() if k.startswith("retro")}
        _print_args("retro arguments", types.SimpleNamespace(**retro_only, rank=args.rank))
    return args


def _set_padded_vocab_size(args):
    """--padded-vocab-size as given, else the vocabulary --vocab-size stands for padded by
    --make-vocab-size-divisible-by x TP (unless --no-pad-vocab-size); tokenizers whose files define the vocabulary
    are padded when they are built. Checked before any process group exists."""
    unpadded = None if args.vocab_size is None else unpadded_vocab_size(args.tokenizer_type, args.vocab_size)
    _require(args.make_vocab_size_divisible_by > 0,
             f"--make-vocab-size-divisible-by must be > 0, got {args.make_vocab_size_divisible_by}")
    try:
        args.padded_vocab_size = resolve_padded_vocab_size(
            unpadded, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size, args.padded_vocab_size,
            args.pad_vocab_size, rank=args.rank)
    except ValueError as e:
        raise ConfigurationError(str(e)) from None


def _validate_parallel_sizes(args):
    world = args.world_size
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    _require(tp >= 1, f"--tensor-model-parallel-size must be >= 1, got {tp}")
    _require(pp >= 1, f"--pipeline-model-parallel-size must be >= 1, got {pp}")
    # Megatron clips both sizes to what the world can hold (a TP=8 recipe run on fewer ranks still starts).
    tp = args.tensor_model_parallel_size = min(tp, world)
    _require(world % tp == 0, f"--tensor-model-parallel-size ({tp}) must divide the world size ({world}): "
                              f"choose a divisor of {world}")
    pp = args.pipeline_model_parallel_size = min(pp, world // tp)
    args.transformer_pipeline_model_parallel_size = pp - 1 if args.standalone_embedding_stage else pp
    _require(world % (tp * pp) == 0,
             f"world size ({world}) must be a multiple of --tensor-model-parallel-size ({tp}) x "
             f"--pipeline-model-parallel-size ({pp}): change either size or the number of processes")
    cp = args.context_parallel_size
    _require(world % (tp * pp * cp) == 0,
             f"world size ({world}) must be a multiple of --tensor-model-parallel-size ({tp}) x "
             f"--pipeline-model-parallel-size ({pp}) x --context-parallel-size ({cp}): change a size or the number "
             "of processes")
    args.data_parallel_size = world // (tp * pp * cp)
    _log(args, "using world size: {}, data-parallel-size: {}, tensor-model-parallel size: {}, "
               "pipeline-model-parallel size: {} ".format(world, args.data_parallel_size, tp, pp)
         + ("context-parallel size: {} ".format(cp) if cp > 1 else ""))
    split = args.pipeline_model_parallel_split_rank
    if split is not None and pp == 1:
        # Megatron ignores the split without a pipeline (e.g. a PP=2 script clipped to one process).
        args.pipeline_model_parallel_split_rank = None
    elif split is not None:
        _require(1 <= split < pp,
                 f"--pipeline-model-parallel-split-rank ({split}) is outside the pipeline: the encoder takes stages "
                 f"[0, split) and the decoder [split, {pp}), so it must be in [1, {pp - 1}] "
                 f"(--pipeline-model-parallel-size {pp})")
        _require(args.num_layers_per_virtual_pipeline_stage is None,
                 "--pipeline-model-parallel-split-rank: interleaving is not supported with an encoder and decoder "
                 "model; drop --num-layers-per-virtual-pipeline-stage")
        _require(not args.standalone_embedding_stage,
                 "--pipeline-model-parallel-split-rank with --standalone-embedding-stage is not supported")


def _apply_deprecations(args):
    for dest, (flag, instead) in _REMOVED_FLAGS.items():
        _require(getattr(args, dest) is None, f"{flag} is no longer valid: {instead}")
        delattr(args, dest)
    deprecated_format = getattr(args, "dist_ckpt_format_deprecated", None)
    if getattr(args, "use_dist_ckpt_deprecated", False) or deprecated_format is not None:
        fmt = deprecated_format or "torch_dist"
        _require(fmt in ("torch_dist", "torch"), f"--dist-ckpt-format {fmt}: use --ckpt-format torch_dist or torch")
        _log(args, f"--use-dist-ckpt / --dist-ckpt-format are deprecated: using --ckpt-format {fmt}")
        args.ckpt_format = fmt
    _require(not args.checkpoint_activations,
             "--checkpoint-activations is no longer valid: use --recompute-activations, or, for more control, "
             "--recompute-granularity and --recompute-method")
    del args.checkpoint_activations
    if args.recompute_activations:
        args.recompute_granularity = "selective"
    del args.recompute_activations


def _apply_defaults(args, defaults):
    # A script's default only fills a flag the user left unset; an explicit flag wins, with a warning.
    for key, value in defaults.items():
        if getattr(args, key, None) is not None:
            _log(args, "WARNING: overriding default arguments for {key}:{v} with {key}:{v2}".format(
                key=key, v=value, v2=getattr(args, key)))
        else:
            setattr(args, key, value)


def _apply_legacy_split(args):
    # Today's --split has no default; with --data-path Megatron falls back to the 2023 one, with a warning.
    if args.split is None and args.data_path is not None:
        _log(args, "WARNING: Please specify --split when using --data-path. Using legacy default value of "
                   "\"969, 30, 1\"")
        args.split = "969, 30, 1"


def _validate_batch_sizes(args):
    mbs, dp = args.micro_batch_size, args.data_parallel_size
    _require(mbs is not None, "--micro-batch-size is required: pass the per-rank batch size, e.g. --micro-batch-size 1")
    _require(mbs > 0, f"--micro-batch-size must be > 0, got {mbs}")
    if args.step_batch_size_schedule is not None:
        _validate_step_batch_size_schedule(args)
        return
    if args.global_batch_size is None:
        args.global_batch_size = mbs * dp
        _log(args, "setting global batch size to {}".format(args.global_batch_size))
    gbs = args.global_batch_size
    _require(gbs > 0, f"--global-batch-size must be > 0, got {gbs}")

    if args.rampup_batch_size is None:
        _require(gbs % (mbs * dp) == 0,
                 f"--global-batch-size ({gbs}) must be a multiple of --micro-batch-size ({mbs}) x "
                 f"data-parallel size ({dp})")
        return
    _require(len(args.rampup_batch_size) == 3,
             "--rampup-batch-size expects 3 values: <start batch size> <batch size increment> <ramp-up samples>, "
             f"got {len(args.rampup_batch_size)}")
    try:
        start, increment, samples = (int(v) for v in args.rampup_batch_size)
    except ValueError:
        raise ConfigurationError(f"--rampup-batch-size values must be integers, got {args.rampup_batch_size}") from None
    _require(start > 0 and increment > 0 and samples >= 0,
             f"--rampup-batch-size needs start > 0, increment > 0 and samples >= 0, got {start} {increment} {samples}")
    _require(start <= gbs and (gbs - start) % increment == 0,
             f"--rampup-batch-size: --global-batch-size ({gbs}) minus the start batch size ({start}) must be a "
             f"non-negative multiple of the increment ({increment})")
    # (early) every batch size of the ramp is start + k * increment and must split into micro-batches.
    _require(start % (mbs * dp) == 0 and increment % (mbs * dp) == 0,
             f"--rampup-batch-size start ({start}) and increment ({increment}) must be multiples of "
             f"--micro-batch-size ({mbs}) x data-parallel size ({dp})")


def _validate_step_batch_size_schedule(args):
    """--step-batch-size-schedule (today's Megatron): a step function of the global batch size.

    Today's Megatron rejects --global-batch-size next to a schedule although its own gpt3 example passes both;
    here the pair is accepted when the schedule ends at that batch size. Without it the global batch size
    defaults to micro-batch x DP, as in Megatron (it only sizes --train-iters runs' datasets and LR steps).
    """
    from megatron.training.microbatches import parse_step_batch_size_schedule

    mbs, dp = args.micro_batch_size, args.data_parallel_size
    _require(args.rampup_batch_size is None,
             "--step-batch-size-schedule and --rampup-batch-size both change the batch size: pass only one")
    seq_length = args.seq_length or args.encoder_seq_length
    _require(seq_length, "--step-batch-size-schedule needs --seq-length (its thresholds are in tokens)")
    schedule = parse_step_batch_size_schedule(args.step_batch_size_schedule, seq_length)
    final = schedule[-1][1]
    if args.global_batch_size is not None:
        _require(args.global_batch_size == final,
                 f"--global-batch-size ({args.global_batch_size}) must equal the last batch size of "
                 f"--step-batch-size-schedule ({final}): make them agree or drop --global-batch-size")
    else:
        args.global_batch_size = mbs * dp
        _log(args, "setting global batch size to {}".format(args.global_batch_size))
    # (early) Megatron checks each batch size only when the schedule reaches it.
    for threshold, batch_size in schedule:
        _require(batch_size % (mbs * dp) == 0,
                 f"--step-batch-size-schedule batch size {batch_size} (from sample {threshold}) must be a multiple "
                 f"of --micro-batch-size ({mbs}) x data-parallel size ({dp})")


def _set_virtual_pipeline_size(args):
    stages_per_rank = getattr(args, "num_virtual_stages_per_pipeline_rank", None)
    if stages_per_rank is not None:  # today's spelling: the number of virtual stages, not their layer count
        _require(args.num_layers_per_virtual_pipeline_stage is None,
                 "--num-virtual-stages-per-pipeline-rank and --num-layers-per-virtual-pipeline-stage both set the "
                 "interleaved schedule: pass only one")
        _require(args.num_layers is not None and stages_per_rank > 0,
                 "--num-virtual-stages-per-pipeline-rank needs --num-layers and a value > 0")
        stages = args.transformer_pipeline_model_parallel_size * stages_per_rank
        _require(args.num_layers % stages == 0,
                 f"--num-layers ({args.num_layers}) must be divisible by pipeline stages "
                 f"({args.transformer_pipeline_model_parallel_size}) x --num-virtual-stages-per-pipeline-rank "
                 f"({stages_per_rank})")
        args.num_layers_per_virtual_pipeline_stage = args.num_layers // stages
    per_stage = args.num_layers_per_virtual_pipeline_stage
    if per_stage is None:
        if not args.is_hybrid_model:  # a hybrid pattern's '|' segments set it (validate_hybrid)
            args.virtual_pipeline_model_parallel_size = None
        return
    pp = args.pipeline_model_parallel_size
    _require(pp > 2, "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 2 "
                     f"(interleaved schedule), got {pp}")
    _require(args.num_layers is not None, "--num-layers-per-virtual-pipeline-stage needs --num-layers")
    _require(per_stage > 0, f"--num-layers-per-virtual-pipeline-stage must be > 0, got {per_stage}")
    _require(args.num_layers % per_stage == 0,
             f"--num-layers ({args.num_layers}) must be divisible by --num-layers-per-virtual-pipeline-stage "
             f"({per_stage})")
    stages = args.transformer_pipeline_model_parallel_size
    # (early) each pipeline stage must hold a whole number of virtual stages.
    _require(args.num_layers % stages == 0 and (args.num_layers // stages) % per_stage == 0,
             f"--num-layers ({args.num_layers}) / pipeline stages ({stages}) must be a multiple of "
             f"--num-layers-per-virtual-pipeline-stage ({per_stage})")
    args.virtual_pipeline_model_parallel_size = (args.num_layers // stages) // per_stage


def _set_precision(args):
    _require(not (args.fp16 and args.bf16), "--fp16 and --bf16 cannot be used together: pass only one")
    args.params_dtype = torch.float
    if args.fp16:
        args.params_dtype = torch.half
    if args.bf16:
        args.params_dtype = torch.bfloat16
        # bf16 has too few mantissa bits to accumulate gradients in, unless the user asks for it.
        if args.grad_reduce_in_bf16:
            args.accumulate_allreduce_grads_in_fp32 = False
            _log(args, "accumulate and reduce gradients in bfloat16 (--grad-reduce-in-bf16).")
        elif not args.accumulate_allreduce_grads_in_fp32:
            args.accumulate_allreduce_grads_in_fp32 = True
            _log(args, "accumulate and all-reduce gradients in fp32 for bfloat16 data type.")
    _log(args, "using {} for parameters ...".format(args.params_dtype))

    # fp32 main-grad buffers and the distributed optimizer both live in local DDP's contiguous buffer.
    fp32_grads = "--bf16 (which accumulates gradients in fp32)" if args.bf16 else "--accumulate-allreduce-grads-in-fp32"
    for flag, enabled in ((fp32_grads, args.accumulate_allreduce_grads_in_fp32),
                          ("--use-distributed-optimizer", args.use_distributed_optimizer)):
        if enabled:
            _require(args.DDP_impl == "local", f"{flag} needs --DDP-impl local, got --DDP-impl {args.DDP_impl}")
            _require(args.use_contiguous_buffers_in_local_ddp,
                     f"{flag} needs contiguous gradient buffers: drop --no-contiguous-buffers-in-local-ddp")
    if args.DDP_impl == "torch":
        args.use_contiguous_buffers_in_local_ddp = False


def _validate_schedule_units(args):
    if args.train_iters:
        for dest, value in (("train_samples", args.train_samples), ("lr_decay_samples", args.lr_decay_samples),
                            ("rampup_batch_size", args.rampup_batch_size)):
            _require(value is None, f"--train-iters (iteration-based training) cannot be combined with "
                                    f"{_flag(dest)}: use --train-samples for sample-based training")
        _require(args.lr_warmup_samples == 0, "--train-iters (iteration-based training) cannot be combined with "
                                              "--lr-warmup-samples: use --lr-warmup-iters")
        if args.lr_warmup_fraction is not None:
            _require(args.lr_warmup_iters == 0,
                     "--lr-warmup-fraction and --lr-warmup-iters are exclusive: pass only one")
        decay = args.lr_decay_iters or args.train_iters
        # (early) the LR scheduler rejects this only after the model is built
        _require(args.lr_warmup_iters < decay, f"--lr-warmup-iters ({args.lr_warmup_iters}) must be smaller than the "
                                               f"decay length (--lr-decay-iters, else --train-iters: {decay})")
    if args.train_samples:
        for dest, value in (("train_iters", args.train_iters), ("lr_decay_iters", args.lr_decay_iters)):
            _require(value is None, f"--train-samples (sample-based training) cannot be combined with "
                                    f"{_flag(dest)}: use --train-iters for iteration-based training")
        _require(args.lr_warmup_iters == 0, "--train-samples (sample-based training) cannot be combined with "
                                            "--lr-warmup-iters: use --lr-warmup-samples")
        if args.lr_warmup_fraction is not None:
            _require(args.lr_warmup_samples == 0,
                     "--lr-warmup-fraction and --lr-warmup-samples are exclusive: pass only one")
        decay = args.lr_decay_samples or args.train_samples
        _require(args.lr_warmup_samples < decay, f"--lr-warmup-samples ({args.lr_warmup_samples}) must be smaller "
                                                 f"than the decay length (--lr-decay-samples, else --train-samples: "
                                                 f"{decay})")


def _validate_model_shape(args):
    if args.num_layers is not None:
        _require(args.encoder_num_layers is None,
                 "--num-layers and --encoder-num-layers are exclusive: pass only one")
        args.encoder_num_layers = args.num_layers
    else:
        _require(args.encoder_num_layers is not None, "--num-layers (or --encoder-num-layers) is required")
        args.num_layers = args.encoder_num_layers
    for dest in ("num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings"):
        _require(getattr(args, dest) is not None, f"{_flag(dest)} is required")
        _require(getattr(args, dest) > 0, f"{_flag(dest)} must be > 0, got {getattr(args, dest)}")

    activations = [f for f, on in (("--openai-gelu", args.openai_gelu), ("--squared-relu", args.squared_relu),
                                   ("--swiglu", args.swiglu), ("--quick-geglu", args.quick_geglu)) if on]
    _require(len(activations) <= 1, f"{' and '.join(activations)} each choose the MLP activation: pass only one")
    if args.ffn_hidden_size is None:
        if args.swiglu:
            # Two input projections instead of one: 2/3 of 4h keeps the parameter count about the same,
            # rounded down to a multiple of 64 so every TP shard stays GEMM-friendly.
            args.ffn_hidden_size = int((4 * args.hidden_size * 2 / 3) / 64) * 64
        else:
            args.ffn_hidden_size = 4 * args.hidden_size
    if args.kv_channels is None:
        _require(args.hidden_size % args.num_attention_heads == 0,
                 f"--hidden-size ({args.hidden_size}) must be divisible by --num-attention-heads "
                 f"({args.num_attention_heads}), or pass --kv-channels")
        args.kv_channels = args.hidden_size // args.num_attention_heads

    tp = args.tensor_model_parallel_size
    # (early) attention heads and query groups are split across TP ranks.
    _require(args.num_attention_heads % tp == 0,
             f"--num-attention-heads ({args.num_attention_heads}) must be divisible by "
             f"--tensor-model-parallel-size ({tp})")
    if args.group_query_attention:
        groups = args.num_query_groups
        _require(groups > 0 and args.num_attention_heads % groups == 0,
                 f"--num-attention-heads ({args.num_attention_heads}) must be divisible by --num-query-groups ({groups})")
        _require(groups % tp == 0,
                 f"--num-query-groups ({groups}) must be divisible by --tensor-model-parallel-size ({tp})")
    stages = args.transformer_pipeline_model_parallel_size
    if args.pipeline_model_parallel_size > 1 and stages > 0 and args.pipeline_model_parallel_split_rank is None \
            and not args.is_hybrid_model:  # (hybrid models: split by the pattern, checked in validate_hybrid)
        # (early) each pipeline stage holds the same number of transformer layers.
        _require(args.num_layers % stages == 0,
                 f"--num-layers ({args.num_layers}) must be divisible by the number of transformer pipeline "
                 f"stages ({stages}, from --pipeline-model-parallel-size)")


def _validate_encoder_decoder(args):
    """T5 (an encoder-decoder model: --decoder-seq-length given): its layer split over the pipeline and its
    sentinel tokens."""
    if args.decoder_seq_length is None:
        return
    pp = args.pipeline_model_parallel_size
    split = args.pipeline_model_parallel_split_rank
    decoder_layers = args.decoder_num_layers if args.decoder_num_layers is not None else args.num_layers
    if pp > 1:
        _require(split is not None, f"an encoder-decoder model (T5) with --pipeline-model-parallel-size {pp} needs "
                                    f"--pipeline-model-parallel-split-rank (the first decoder stage, 1 to {pp - 1})")
        _require(args.num_layers % split == 0,
                 f"--num-layers ({args.num_layers}) must be divisible by the {split} encoder pipeline stages "
                 f"(--pipeline-model-parallel-split-rank {split})")
        _require(decoder_layers % (pp - split) == 0,
                 f"the decoder's {decoder_layers} layers (--decoder-num-layers, default --num-layers) must be "
                 f"divisible by its {pp - split} pipeline stages (--pipeline-model-parallel-size {pp}, "
                 f"--pipeline-model-parallel-split-rank {split})")
    if args.tokenizer_type in ("BertWordPieceLowerCase", "BertWordPieceCase", "SentencePieceTokenizer"):
        _require((args.vocab_extra_ids or 0) > 0,
                 f"T5 needs sentinel tokens <extra_id_N> in the vocabulary: pass --vocab-extra-ids 100 "
                 f"(--tokenizer-type {args.tokenizer_type} adds them)")
    _require(not args.untie_embeddings_and_output_weights,
             "T5 does not support --untie-embeddings-and-output-weights (its LM head uses the word embedding)")


def _validate_lengths_and_misc(args):
    if args.seq_length is not None:
        _require(args.encoder_seq_length is None, "--seq-length and --encoder-seq-length are exclusive: pass only one")
        args.encoder_seq_length = args.seq_length
    else:
        _require(args.encoder_seq_length is not None, "--seq-length (or --encoder-seq-length) is required")
        args.seq_length = args.encoder_seq_length
    _require(args.max_position_embeddings >= args.seq_length,
             f"--max-position-embeddings ({args.max_position_embeddings}) must be >= --seq-length ({args.seq_length})")
    if args.decoder_seq_length is not None:
        _require(args.max_position_embeddings >= args.decoder_seq_length,
                 f"--max-position-embeddings ({args.max_position_embeddings}) must be >= --decoder-seq-length "
                 f"({args.decoder_seq_length})")
    _require(args.seed is not None and args.seed > 0, f"--seed must be a positive integer, got {args.seed}")
    if args.lr is not None:
        _require(args.min_lr <= args.lr, f"--min-lr ({args.min_lr}) must be <= --lr ({args.lr})")
    if args.save is not None:
        _require(args.save_interval is not None, "--save needs --save-interval: pass how often to save, in iterations")
    if args.fp16_lm_cross_entropy:
        _require(args.fp16, "--fp16-lm-cross-entropy needs --fp16")
    if args.fp32_residual_connection:
        _require(args.fp16 or args.bf16, "--fp32-residual-connection needs --fp16 or --bf16")


def _set_weight_decay(args):
    if args.weight_decay_incr_style == "constant":
        _require(args.start_weight_decay is None and args.end_weight_decay is None,
                 "--start-weight-decay/--end-weight-decay need --weight-decay-incr-style linear or cosine; "
                 "with constant use --weight-decay")
        args.start_weight_decay = args.weight_decay
        args.end_weight_decay = args.weight_decay
    else:
        _require(args.start_weight_decay is not None and args.end_weight_decay is not None,
                 f"--weight-decay-incr-style {args.weight_decay_incr_style} needs both --start-weight-decay and "
                 "--end-weight-decay")


def _validate_recompute(args):
    major, minor = (int(v) for v in torch.__version__.split(".")[:2])
    if (major, minor) < (1, 11):
        args.no_persist_layer_norm = True
        _log(args, "Persistent fused layer norm kernel is supported from pytorch v1.11; "
                   "defaulting to no_persist_layer_norm=True")
    if args.distribute_saved_activations:
        _require(args.tensor_model_parallel_size > 1,
                 "--distribute-saved-activations needs --tensor-model-parallel-size > 1")
        _require(args.recompute_granularity == "full",
                 "--distribute-saved-activations needs --recompute-granularity full")
        _require(args.recompute_method is not None,
                 "--distribute-saved-activations needs --recompute-method uniform or block")
    if args.moe_layer_recompute:  # megatron-core: deprecated spelling of selective recompute of "moe"
        _require(args.recompute_granularity != "full",
                 "--moe-layer-recompute cannot be combined with --recompute-granularity full: drop one of them")
    if args.recompute_granularity == "selective" or args.moe_layer_recompute:
        from megatron.core.transformer.transformer_config import check_recompute_modules
        try:
            check_recompute_modules(args.recompute_modules or ["core_attn"], args.moe_grouped_gemm,
                                    args.multi_latent_attention)
        except ValueError as e:
            raise ConfigurationError(str(e)) from None
    elif args.recompute_modules:
        _log(args, f"note: --recompute-modules {' '.join(args.recompute_modules)} has no effect without "
                   "--recompute-granularity selective")
    if args.recompute_granularity == "selective":
        _require(args.recompute_method is None,
                 "--recompute-method is not supported with --recompute-granularity selective (or "
                 "--recompute-activations): drop --recompute-method")
    if args.recompute_granularity == "full":
        # (early) TransformerConfig rejects full recompute without a method and a layer count.
        _require(args.recompute_method is not None,
                 "--recompute-granularity full needs --recompute-method uniform or block")
        _require(args.recompute_num_layers is not None,
                 "--recompute-granularity full needs --recompute-num-layers N (layers per recompute group with "
                 "uniform, recomputed layers per stage with block; it has no default since Megatron-LM 0.12)")


def _validate_sequence_parallel(args):
    # With one TP rank sequence parallelism would only change numerics, not memory.
    if args.tensor_model_parallel_size == 1:
        args.sequence_parallel = False
    if args.sequence_parallel:
        args.async_tensor_model_parallel_allreduce = False
    # The ordering guarantee matters only for CUDA streams; a CPU (gloo) run has none.
    cuda_in_use = device.cuda_available() and args.distributed_backend != "gloo"
    # FSDP's streams need more than one connection (its own check): the ordering then comes from FSDP's events.
    fsdp = args.use_torch_fsdp2 or args.use_megatron_fsdp
    if cuda_in_use and not fsdp and os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1":
        _require(not args.sequence_parallel,
                 "--sequence-parallel requires the environment variable CUDA_DEVICE_MAX_CONNECTIONS=1: export it")
        _require(not args.async_tensor_model_parallel_allreduce,
                 "async tensor-parallel all-reduce (on by default) requires the environment variable "
                 "CUDA_DEVICE_MAX_CONNECTIONS=1: export it, or pass --no-async-tensor-model-parallel-allreduce")


def _validate_features(args):
    if not args.add_bias_linear:
        args.bias_gelu_fusion = False
    if args.retro_add_retriever:
        _require(not args.sequence_parallel, "--retro-add-retriever does not support --sequence-parallel")
        _require(args.pipeline_model_parallel_size == 1,
                 "--retro-add-retriever does not support --pipeline-model-parallel-size > 1")
        _load_retro_args(args)
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    _require(not (args.reset_attention_mask and not args.create_attention_mask_in_dataloader),
             "--reset-attention-mask needs the attention mask the data loader builds: drop "
             "--no-create-attention-mask-in-dataloader (or --reset-attention-mask)")
    _require(args.add_position_embedding or args.position_embedding_type == "rope",
             "--no-position-embedding is deprecated: use --position-embedding-type rope")
    _validate_model_implementation(args)
    _require(not getattr(args, "async_save", False) or getattr(args, "ckpt_format", "torch") == "torch_dist",
             "--async-save needs --ckpt-format torch_dist")
    from megatron.training.deterministic import check_deterministic_mode
    check_deterministic_mode(args)
    _require(args.hang_timeout_minutes >= 0,
             f"--hang-timeout-minutes must be >= 0 (0 turns hang detection off), got {args.hang_timeout_minutes}")
    _require(args.straggler_minmax_count >= 1,
             f"--straggler-minmax-count must be >= 1, got {args.straggler_minmax_count}")


def _validate_rerun_machine(args):
    """The rerun state machine's flags, and what --fake-process-group turns off (megatron/core/rerun_state_machine.py)."""
    _require(args.error_injection_rate >= 0,
             f"--error-injection-rate must be >= 0 (0 never injects), got {args.error_injection_rate}")
    _require(all(i > 0 for i in args.iterations_to_skip),
             f"--iterations-to-skip takes iteration numbers >= 1, got {args.iterations_to_skip}")
    if args.fake_process_group:
        # Collectives move no data: every value is meaningless, so checking them would only find garbage.
        checks = [flag for flag, on in (("--check-for-nan-in-loss-and-grad", args.check_for_nan_in_loss_and_grad),
                                         ("--check-for-spiky-loss", args.check_for_spiky_loss),
                                         ("--check-for-large-grads", args.check_for_large_grads)) if on]
        args.check_for_nan_in_loss_and_grad = args.check_for_spiky_loss = args.check_for_large_grads = False
        if checks:
            _log(args, f"--fake-process-group: turning off {', '.join(checks)} (values are not exchanged)")


def _validate_model_implementation(args):
    """--use-legacy-models rules, --transformer-impl fallback, RoPE-only flags (megatron-core models are the default)."""
    # Derived for code that asks which model family is built (checkpoint tools, benchmarks).
    args.use_mcore_models = not args.use_legacy_models
    if args.use_legacy_models:
        _require(getattr(args, "ckpt_format", "torch") == "torch",
                 "--use-legacy-models needs --ckpt-format torch (torch_dist is for megatron-core models)")
        _require(not args.rotary_interleaved, "--rotary-interleaved is not supported with --use-legacy-models")
    if args.position_embedding_type != "rope":
        args.apply_rope_fusion = False
    if args.transformer_impl == "transformer_engine":
        try:
            import transformer_engine  # type: ignore  # noqa: F401
            reason = "Transformer Engine is installed, but this library builds its layers from its own modules"
        except ImportError:
            reason = "Transformer Engine is not installed"
        _log(args, f"--transformer-impl transformer_engine: {reason}; using --transformer-impl local")
        args.transformer_impl = "local"


def _legacy_models(args) -> bool:
    """True when the legacy (megatron.legacy.model) classes build the model (--use-legacy-models)."""
    return bool(args.use_legacy_models)


def _validate_per_token_loss(args):
    if args.calculate_per_token_loss:
        # The token count divides the gradients after a SUM reduction in Megatron's own DDP.
        _require(args.DDP_impl == "local", "--calculate-per-token-loss needs --DDP-impl local (torch DDP averages "
                                           "gradients over ranks)")


def _validate_decoupled_lr(args):
    if args.decoupled_lr is None and args.decoupled_min_lr is None:
        return
    _require(not _legacy_models(args), "--decoupled-lr / --decoupled-min-lr need the megatron-core models "
                                       "(the legacy models do not mark embedding and output parameters)")
    if args.decoupled_lr is not None:
        _require(args.decoupled_lr >= 0, f"--decoupled-lr must be >= 0, got {args.decoupled_lr}")
        min_lr = args.decoupled_min_lr if args.decoupled_min_lr is not None else args.min_lr
        _require(min_lr <= args.decoupled_lr,
                 f"--decoupled-min-lr (else --min-lr) ({min_lr}) must be <= --decoupled-lr ({args.decoupled_lr})")


def _validate_param_gather(args):
    if args.overlap_param_gather:
        _require(args.use_distributed_optimizer,
                 "--overlap-param-gather only supported with distributed optimizer: add --use-distributed-optimizer")
        _require(args.overlap_grad_reduce, "--overlap-grad-reduce should be turned on when using "
                                           "--overlap-param-gather: add --overlap-grad-reduce")
        _require(not _legacy_models(args), "--overlap-param-gather is not supported with legacy models")
    if args.overlap_param_gather_with_optimizer_step:
        _require(args.use_distributed_optimizer, "--overlap-param-gather-with-optimizer-step only supported with "
                                                 "distributed optimizer: add --use-distributed-optimizer")
        _require(args.overlap_param_gather, "must use --overlap-param-gather with "
                                            "--overlap-param-gather-with-optimizer-step")
        _require(args.virtual_pipeline_model_parallel_size is not None,
                 "--overlap-param-gather-with-optimizer-step only supported with interleaved pipeline parallelism: "
                 "add --num-layers-per-virtual-pipeline-stage")
        _require(getattr(args, "ckpt_format", "torch") == "torch",
                 "--overlap-param-gather-with-optimizer-step not supported with distributed checkpointing: "
                 "use --ckpt-format torch")
    if args.virtual_pipeline_model_parallel_size is None:
        # Aligned all-gathers only matter for the interleaved schedule.
        args.align_param_gather = False


def _validate_manual_gc(args):
    _require(args.manual_gc_interval >= 0,
             f"--manual-gc-interval must be >= 0 (0: only around evaluation), got {args.manual_gc_interval}")


def _validate_profiling(args):
    if not args.profile:
        if args.use_pytorch_profiler:
            _log(args, "WARNING: --use-pytorch-profiler does nothing without --profile")
        return
    _require(0 <= args.profile_step_start < args.profile_step_end,
             f"--profile-step-start ({args.profile_step_start}) must be >= 0 and smaller than --profile-step-end "
             f"({args.profile_step_end})")
    if args.use_pytorch_profiler:
        _require(args.tensorboard_dir is not None,
                 "--use-pytorch-profiler writes its traces to --tensorboard-dir: pass --tensorboard-dir")


def _nearest_existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def _require_writable_dir(flag: str, path: str) -> None:
    """``path`` is a writable directory, or can be created (its nearest existing ancestor is writable)."""
    if os.path.exists(path):
        _require(os.path.isdir(path), f"{flag} {path} is not a directory: pass a directory path")
        _require(os.access(path, os.W_OK | os.X_OK), f"{flag} {path} is not writable: fix its permissions or "
                                                     "pass another directory")
        return
    ancestor = _nearest_existing(path)
    _require(os.path.isdir(ancestor) and os.access(ancestor, os.W_OK | os.X_OK),
             f"{flag} {path} cannot be created: {ancestor} is not a writable directory")


def _require_readable_file(flag: str, path: str) -> None:
    _require(os.path.exists(path), f"{flag} {path} does not exist: pass the path of an existing file")
    _require(os.access(path, os.R_OK), f"{flag} {path} is not readable: fix its permissions")


def _validate_paths(args):
    """(early) Every path flag, checked on every rank before any process group exists, so a typo fails in a
    second with one line instead of after the model is built (or with ranks waiting on one that crashed)."""
    from megatron.training.data_checks import data_prefixes

    for flag, prefix in data_prefixes(args):
        for suffix in (".idx", ".bin"):
            _require(os.path.isfile(prefix + suffix),
                     f"{flag} {prefix}: {prefix + suffix} does not exist (pass dataset prefixes "
                     "without the .bin/.idx extension, as written by tools/preprocess_data.py)")
            _require(os.access(prefix + suffix, os.R_OK), f"{flag}: {prefix + suffix} is not readable")
    for dest in ("vocab_file", "merge_file"):
        if getattr(args, dest, None):
            _require_readable_file(_flag(dest), getattr(args, dest))
    model = getattr(args, "tokenizer_model", None)
    if model and getattr(args, "tokenizer_type", None) != "HuggingFaceTokenizer":
        _require_readable_file("--tokenizer-model", model)
    elif model:
        _require(os.path.exists(model), f"--tokenizer-model {model} is not a local directory or tokenizer.json "
                                        "(this library never downloads tokenizers)")
    for dest in ("load", "pretrained_checkpoint"):
        path = getattr(args, dest, None)
        if path and os.path.exists(path):  # a missing --load directory means "start from scratch" (Megatron)
            _require(os.path.isdir(path), f"{_flag(dest)} {path} is not a directory: pass the checkpoint directory "
                                          "(the one holding latest_checkpointed_iteration.txt)")
            _require(os.access(path, os.R_OK | os.X_OK), f"{_flag(dest)} {path} is not readable: fix its permissions")
    for dest in ("save", "data_cache_path", "tensorboard_dir"):
        if getattr(args, dest, None):
            _require_writable_dir(_flag(dest), getattr(args, dest))


def get_retro_args_path(workdir):
    return os.path.join(workdir, "args.json")


def _load_retro_args(args):
    """Read the retro preprocessing arguments (``<--retro-workdir>/args.json``) into the global retro args."""
    _require(args.retro_workdir is not None, "--retro-add-retriever needs --retro-workdir")
    path = get_retro_args_path(args.retro_workdir)
    _require(os.path.exists(path), f"--retro-workdir {args.retro_workdir} has no args.json: run retro preprocessing")
    with open(path) as f:
        retro_args = types.SimpleNamespace(**json.load(f))
    retro_args.retro_return_doc_ids = args.retro_return_doc_ids
    retro_args.retro_gpt_retrieved_length = args.retro_num_retrieved_chunks * retro_args.retro_gpt_chunk_length
    set_retro_args(retro_args)
