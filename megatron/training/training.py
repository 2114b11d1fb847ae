"""The training framework's main loop (megatron.training.training).

``pretrain`` reads top to bottom: initialise → build model, optimizer and LR schedule (optionally from a
checkpoint) → build data iterators → ``train`` (one ``train_step`` per iteration, then logging,
evaluation, checkpointing and exit checks) → final validation and test.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import sys
import time

import torch

from megatron.core import device, parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.enums import ModelType
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.rerun_state_machine import (RerunMode, RerunState, ResultRejectedError, advance_data_iterators,
                                               get_rerun_state_machine, wrap_data_iterators)
from megatron.core.tensor_parallel import set_defaults_if_not_set_tensor_model_parallel_attributes
from megatron.core.utils import get_model_config
from megatron.training.checkpointing import load_checkpoint, save_checkpoint
from megatron.training.datasets_provider import build_train_valid_test_data_iterators
from megatron.training.errors import AgreedExit
from megatron.training.fault_injection import ENV_VAR as FAULT_INJECT_ENV_VAR
from megatron.training.global_vars import (
    get_adlr_autoresume,
    get_args,
    get_num_microbatches,
    get_signal_handler,
    get_tensorboard_writer,
    get_timers,
    update_num_microbatches,
)
from megatron.training.fault_handling import fault_handling, maybe_inject_fault
from megatron.training.gc_and_profiling import IterationProfiler, ManualGC
from megatron.training.hang_detection import ProgressTracker
from megatron.training.initialize import initialize_megatron, set_jit_fusion_options
from megatron.training.numerical_checks import (IterationState, NumericalFaultError, ResultChecks, inject_nan_grad,
                                                validate_grads, wrap_forward_step)
from megatron.training.training_log import LogState, num_floating_point_operations, training_log
from megatron.training.utils import calc_params_l2_norm, print_datetime, print_rank_0, print_rank_last

_TRAIN_START_TIME = time.time()


def pretrain(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func,
             process_non_loss_data_func=None, extra_args_provider=None, args_defaults={}):  # noqa: B006
    """Initialise, build everything, train, then evaluate on the validation and test sets."""
    initialize_megatron(extra_args_provider=extra_args_provider, args_defaults=args_defaults)
    # From here on a failure on any rank ends every rank with a message naming it (fault_handling.py).
    with fault_handling(get_args()) as progress:
        return _pretrain_after_initialize(train_valid_test_dataset_provider, model_provider, model_type,
                                          forward_step_func, process_non_loss_data_func, progress=progress)


def _pretrain_after_initialize(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func,
                               process_non_loss_data_func, progress=None):
    set_jit_fusion_options()
    _report_initialization_time()
    args, timers = get_args(), get_timers()

    timers("model-and-optimizer-setup", log_level=0).start(barrier=True)
    model, optimizer, opt_param_scheduler = setup_model_and_optimizer(model_provider, model_type)
    timers("model-and-optimizer-setup").stop()
    print_datetime("after model, optimizer, and learning rate scheduler are built")
    config = get_model_config(model[0])

    timers("train/valid/test-data-iterators-setup", log_level=0).start(barrier=True)
    if args.virtual_pipeline_model_parallel_size is not None:
        iterators = []
        for chunk in range(len(model)):
            parallel_state.set_virtual_pipeline_model_parallel_rank(chunk)
            iterators.append(build_train_valid_test_data_iterators(train_valid_test_dataset_provider))
        parallel_state.set_virtual_pipeline_model_parallel_rank(0)
        train_data_iterator, valid_data_iterator, test_data_iterator = (list(x) for x in zip(*iterators))
    else:
        train_data_iterator, valid_data_iterator, test_data_iterator = build_train_valid_test_data_iterators(
            train_valid_test_dataset_provider)
    timers("train/valid/test-data-iterators-setup").stop()
    print_datetime("after dataloaders are built")
    timers.log(["model-and-optimizer-setup", "train/valid/test-data-iterators-setup"], barrier=True)

    iteration = args.iteration
    if not args.skip_train and args.do_train and args.train_iters > 0:
        print_rank_0("training ...")
        iteration = train(forward_step_func, model, optimizer, opt_param_scheduler, train_data_iterator,
                          valid_data_iterator, process_non_loss_data_func, config, progress=progress)
        print_datetime("after training is done")
        if args.save and iteration != 0 and iteration % args.save_interval != 0:
            save_checkpoint(iteration, model, optimizer, opt_param_scheduler,
                            args.num_floating_point_operations_so_far)
        if args.async_save:
            from megatron.training.checkpointing.torch_dist import finalize_async_save
            finalize_async_save()  # the last checkpoint is complete before evaluation and exit
    else:
        print_rank_0("skipping training (--skip-train is on) ...")

    if args.do_valid:
        evaluate_and_print_results(f"iteration {iteration} on validation set", forward_step_func,
                                   valid_data_iterator, model, iteration, process_non_loss_data_func, config)
    if args.do_test:
        evaluate_and_print_results(f"iteration {iteration} on test set", forward_step_func, test_data_iterator,
                                   model, iteration, process_non_loss_data_func, config)
    return model


def _report_initialization_time():
    global _TRAIN_START_TIME
    start = torch.tensor([_TRAIN_START_TIME], dtype=torch.float64, device=device.current_device())
    torch.distributed.all_reduce(start, op=torch.distributed.ReduceOp.MIN)
    _TRAIN_START_TIME = start.item()
    print_rank_0("time to initialize megatron (seconds): {:.3f}".format(time.time() - _TRAIN_START_TIME))
    print_datetime("after megatron is initialized")


def update_train_iters(args):
    """Derive ``--train-iters`` from ``--train-samples`` (with or without batch-size ramp-up)."""
    if args.train_iters is not None:
        return
    if getattr(args, "step_batch_size_schedule", None):
        # Simulate the step schedule until its last threshold, then whole batches of the final size.
        from megatron.training.microbatches import parse_step_batch_size_schedule

        schedule = parse_step_batch_size_schedule(args.step_batch_size_schedule, args.seq_length)
        iterations, consumed = 0, 0
        while consumed < schedule[-1][0] and consumed < args.train_samples:
            consumed += [bs for threshold, bs in schedule if threshold <= consumed][-1]
            iterations += 1
        iterations += max(args.train_samples - consumed, 0) // schedule[-1][1]
        args.train_iters = iterations
    elif args.rampup_batch_size is None:
        args.train_iters = args.train_samples // args.global_batch_size
    else:
        iterations, consumed = 0, 0
        while consumed <= int(args.rampup_batch_size[2]) and consumed < args.train_samples:
            update_num_microbatches(consumed, consistency_check=False)
            consumed += get_num_microbatches() * args.micro_batch_size * args.data_parallel_size
            iterations += 1
        update_num_microbatches(0, consistency_check=False)
        iterations += (args.train_samples - consumed) // args.global_batch_size
        args.train_iters = iterations
    print_rank_0("setting training iterations to {}".format(args.train_iters))


# ------------------------------------------------------------------------------------------- model

def _build_encoder_decoder_stage(model_provider_func, pp_size):
    """An encoder-decoder model's stage: stages before ``--pipeline-model-parallel-split-rank`` hold the encoder,
    the others the decoder; the first stage of each stack embeds (``pre_process``), the last of each stack applies
    the final norm (``post_process``: the decoder's last also the LM head)."""
    if pp_size == 1:
        return model_provider_func(pre_process=True, post_process=True, add_encoder=True, add_decoder=True)
    if parallel_state.get_virtual_pipeline_model_parallel_world_size() is not None:
        raise RuntimeError("Interleaving is not supported with an encoder and decoder model.")
    split = parallel_state.get_pipeline_model_parallel_split_rank()
    if split is None:
        raise RuntimeError("Split rank needs to be specified for model with both encoder and decoder "
                           "(--pipeline-model-parallel-split-rank)")
    rank = parallel_state.get_pipeline_model_parallel_rank()
    return model_provider_func(pre_process=rank in (0, split), post_process=rank in (split - 1, pp_size - 1),
                               add_encoder=parallel_state.is_pipeline_stage_before_split(),
                               add_decoder=parallel_state.is_pipeline_stage_after_split())


def get_model(model_provider_func, model_type=ModelType.encoder_or_decoder, wrap_with_ddp=True):
    """Build this rank's model chunks (one per virtual stage), move them to the device, wrap for mixed
    precision and data parallelism. Always returns a list."""
    args = get_args()
    args.model_type = model_type
    rng = None
    if args.init_model_with_meta_device:  # the layers draw nothing now: _materialize replays from these states
        from megatron.core.distributed.fsdp.meta_init import RngStates

        rng = RngStates.capture()
    model = _build_model_chunks(model_provider_func, model_type)

    for chunk in model:
        for param in chunk.parameters():
            set_defaults_if_not_set_tensor_model_parallel_attributes(param)

    if parallel_state.get_data_parallel_rank() == 0:
        print(" > number of parameters on (tensor, pipeline) model parallel rank ({}, {}): {}".format(
            parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank(),
            sum(sum(p.nelement() for p in chunk.parameters()) for chunk in model)), flush=True)

    if rng is None:
        for chunk in model:
            chunk.to(device.current_device())

    if wrap_with_ddp and _fsdp2_engine(args):
        # FSDP2 keeps fp32 main weights as its shards and casts for compute itself (no Float16Module).
        dtypes = [{n: p.dtype for n, p in chunk.named_parameters(remove_duplicate=False)} for chunk in model]
        model = [_wrap_data_parallel(args, chunk, i) for i, chunk in enumerate(model)]
        if rng is not None:
            _materialize(args, rng, [chunk.module for chunk in model], dtypes, sharded=True)
        return model
    if rng is not None:  # ZeRO-1 and no wrapping: every rank holds the whole weights
        _materialize(args, rng, model, [{} for _ in model], sharded=False)
    if args.fp16 or args.bf16:
        from megatron.core.transformer.module import Float16Module

        model = [Float16Module(get_model_config(chunk), chunk) for chunk in model]

    if not wrap_with_ddp:
        return model
    model = [_wrap_data_parallel(args, chunk, i) for i, chunk in enumerate(model)]
    if args.data_parallel_random_init:
        for chunk in model:
            chunk.broadcast_params()
    return model


def _materialize(args, rng, modules, dtypes, sharded: bool):
    """--init-model-with-meta-device: draw the weights built on the meta device (FSDP2 shards or whole tensors)."""
    from megatron.core.distributed.fsdp.meta_init import allocate_sharded, materialize
    from megatron.core.transformer.norms import init_device

    for module, init_dtypes in zip(modules, dtypes):
        if sharded:
            allocate_sharded(module, device.current_device())
        materialize(module, rng, init_dtypes, init_device(get_model_config(module)))
        rng = None  # one replay of the build's draws continues across the chunks
    print_rank_0("--init-model-with-meta-device: weights drawn layer by layer from the build's generator states"
                 + (", each rank keeping its FSDP shard" if sharded else ""))


def _build_model_chunks(model_provider_func, model_type):
    """This rank's model chunks (one per virtual stage), unwrapped."""
    args = get_args()
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    if model_type == ModelType.encoder_and_decoder:
        model = [_build_encoder_decoder_stage(model_provider_func, pp_size)]
    elif pp_size > 1 and args.virtual_pipeline_model_parallel_size is not None:
        model = []
        for i in range(args.virtual_pipeline_model_parallel_size):
            parallel_state.set_virtual_pipeline_model_parallel_rank(i)
            chunk = model_provider_func(pre_process=parallel_state.is_pipeline_first_stage(),
                                        post_process=parallel_state.is_pipeline_last_stage())
            chunk.model_type = model_type
            model.append(chunk)
        parallel_state.set_virtual_pipeline_model_parallel_rank(0)
    else:
        chunk = model_provider_func(pre_process=parallel_state.is_pipeline_first_stage(),
                                    post_process=parallel_state.is_pipeline_last_stage())
        chunk.model_type = model_type
        model = [chunk]
    for chunk in model:
        chunk.model_type = model_type
    return model


def _fsdp2_engine(args) -> bool:
    """Whether the model is sharded by FSDP2 (--use-torch-fsdp2, or Megatron-FSDP's optim_grads[_params])."""
    return args.use_torch_fsdp2 or (args.use_megatron_fsdp and args.data_parallel_sharding_strategy in
                                    ("optim_grads", "optim_grads_params"))


def _wrap_data_parallel(args, chunk, index):
    """One model chunk in its data-parallel wrapper: torch DDP, our DDP (buckets), FSDP2 or Megatron-FSDP."""
    config = get_model_config(chunk)
    if args.DDP_impl == "torch":
        from megatron.core.distributed.torch_ddp import TorchDistributedDataParallel

        return TorchDistributedDataParallel(chunk, process_group=parallel_state.get_data_parallel_group(
            with_context_parallel=True))
    kwargs = dict(
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
        overlap_grad_reduce=args.overlap_grad_reduce,
        use_distributed_optimizer=args.use_distributed_optimizer,
        bucket_size=args.ddp_bucket_size,
        overlap_param_gather=args.overlap_param_gather,
        align_param_gather=args.align_param_gather,
        # check_for_nan_in_grad stays off: --check-for-nan-in-loss-and-grad is the rerun state machine's gradient
        # check (numerical_checks.validate_grads, before finalize_model_grads), which makes every rank agree.
    )
    if args.use_torch_fsdp2:
        from megatron.core.distributed.torch_fully_sharded_data_parallel import TorchFullyShardedDataParallel
        from megatron.core.distributed.torch_fully_sharded_data_parallel_config import (
            TorchFullyShardedDataParallelConfig)

        kwargs.update(use_distributed_optimizer=False, reshard_after_forward=args.torch_fsdp2_reshard_after_forward)
        return TorchFullyShardedDataParallel(config, TorchFullyShardedDataParallelConfig(**kwargs), chunk)
    if args.use_megatron_fsdp:
        from megatron.core.distributed.fsdp import FullyShardedDataParallel

        kwargs.update(use_megatron_fsdp=True, data_parallel_sharding_strategy=args.data_parallel_sharding_strategy,
                      overlap_param_gather=args.overlap_param_gather and args.data_parallel_sharding_strategy == "optim")
        return FullyShardedDataParallel(config, DistributedDataParallelConfig(**kwargs), chunk,
                                        disable_bucketing=index > 0)
    # Only the first chunk is bucketed: later chunks' backward passes finish last anyway.
    return DistributedDataParallel(config, DistributedDataParallelConfig(**kwargs), chunk,
                                   disable_bucketing=index > 0)


def get_optimizer_param_scheduler(optimizer):
    """The LR / weight-decay schedule; steps are counted in samples, as in Megatron."""
    args = get_args()
    if args.train_iters:
        lr_decay_steps = (args.lr_decay_iters or args.train_iters) * args.global_batch_size
        wd_incr_steps = args.train_iters * args.global_batch_size
        if args.lr_warmup_fraction is not None:
            lr_warmup_steps = args.lr_warmup_fraction * lr_decay_steps
        else:
            lr_warmup_steps = args.lr_warmup_iters * args.global_batch_size
    elif args.train_samples:
        lr_decay_steps = args.lr_decay_samples or args.train_samples
        wd_incr_steps = args.train_samples
        if args.lr_warmup_fraction is not None:
            lr_warmup_steps = args.lr_warmup_fraction * lr_decay_steps
        else:
            lr_warmup_steps = args.lr_warmup_samples
    else:
        raise RuntimeError("either --train-iters or --train-samples must be provided")
    return OptimizerParamScheduler(
        optimizer, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=lr_warmup_steps,
        lr_decay_steps=lr_decay_steps, lr_decay_style=args.lr_decay_style, start_wd=args.start_weight_decay,
        end_wd=args.end_weight_decay, wd_incr_steps=wd_incr_steps, wd_incr_style=args.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler)


def optimizer_config_from_args(args) -> OptimizerConfig:
    """Copy every flag whose name is an OptimizerConfig field."""
    kwargs = {f.name: getattr(args, f.name) for f in dataclasses.fields(OptimizerConfig) if hasattr(args, f.name)}
    kwargs["timers"] = get_timers()
    return OptimizerConfig(**kwargs)


def setup_model_and_optimizer(model_provider_func, model_type, no_wd_decay_cond=None, scale_lr_cond=None,
                              lr_mult=1.0):
    """Model chunks, optimizer and LR scheduler; loads ``--load`` if given (sets ``args.iteration``)."""
    args = get_args()
    update_train_iters(args)
    model = get_model(model_provider_func, model_type)
    optimizer = get_megatron_optimizer(optimizer_config_from_args(args), model, no_wd_decay_cond, scale_lr_cond,
                                       lr_mult)
    opt_param_scheduler = get_optimizer_param_scheduler(optimizer)
    args.num_floating_point_operations_so_far = 0
    if args.load is not None or args.pretrained_checkpoint is not None:
        timers = get_timers()
        timers("load-checkpoint", log_level=0).start(barrier=True)
        args.iteration = load_checkpoint(model, optimizer, opt_param_scheduler)
        timers("load-checkpoint").stop(barrier=True)
        timers.log(["load-checkpoint"])
    else:
        args.iteration = 0
    return model, optimizer, opt_param_scheduler


# ------------------------------------------------------------------------------------------ train

class RerunExitRequest(Exception):
    """train_step: the rerun state machine ends the job (``train`` saves a checkpoint if asked, then exits)."""

    def __init__(self, checkpoint: bool, exit_code: int):
        super().__init__(f"rerun state machine: exit with code {exit_code}")
        self.checkpoint, self.exit_code = checkpoint, exit_code


def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config, checks=None):
    """One iteration: forward and backward over every micro-batch (again, from the same state, when the rerun state
    machine asks for a re-run), then one optimizer step.

    ``checks`` (the ``ResultChecks`` from ``configure_schedule_hooks``, or None) validates the local losses; the
    gradient hook validates the gradients (megatron/training/numerical_checks.py). A fatal rejection with
    ``--rerun-mode disabled`` raises NumericalFaultError on every rank; a re-run verdict that ends the job raises
    RerunExitRequest before the optimizer could use the result."""
    args, timers = get_args(), get_timers()
    if checks is not None:
        forward_step_func = wrap_forward_step(forward_step_func, checks, torch.distributed.get_rank(),
                                              args.iteration + 1)
    forward_backward_func = get_forward_backward_func()
    machine = get_rerun_state_machine()
    if machine.mode != RerunMode.DISABLED:
        data_iterator = wrap_data_iterators(data_iterator)  # so that a re-run replays the same micro-batches
    timers("forward-backward", log_level=1).start(barrier=args.barrier_with_L1_time)
    try:
        while machine.should_run_forward_backward(data_iterator):
            for chunk in model:
                chunk.zero_grad_buffer()
            optimizer.zero_grad()
            losses_reduced = forward_backward_func(
                forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                num_microbatches=get_num_microbatches(), seq_length=args.seq_length,
                micro_batch_size=args.micro_batch_size, decoder_seq_length=args.decoder_seq_length,
                forward_only=False)
    except ResultRejectedError as error:
        raise NumericalFaultError(f"{error}; stopping the run on every rank (--check-for-nan-in-loss-and-grad). Lower "
                                  "--lr, check the data of this iteration, or resume from the last checkpoint",
                                  same_on_every_rank=True) from None
    timers("forward-backward").stop()
    should_checkpoint, should_exit, exit_code = machine.should_checkpoint_and_exit()
    if should_exit:
        raise RerunExitRequest(should_checkpoint, exit_code)
    if args.empty_unused_memory_level >= 1:
        device.empty_cache()

    timers("optimizer", log_level=1).start(barrier=args.barrier_with_L1_time)
    update_successful, grad_norm, num_zeros_in_grad = optimizer.step()
    timers("optimizer").stop()

    if update_successful:
        increment = get_num_microbatches() * args.micro_batch_size * args.data_parallel_size
        opt_param_scheduler.step(increment=increment)
        skipped_iter = 0
    else:
        skipped_iter = 1
    if args.empty_unused_memory_level >= 2:
        device.empty_cache()

    moe_losses = _moe_losses(model, config) if args.num_experts else {}
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        loss_reduced = {}
        for key, (numerator, denominator) in _sum_reported_losses(losses_reduced).items():
            loss_reduced[key] = numerator / denominator
        # Megatron's MoE metrics (load_balancing_loss, z_loss, ...) are shown like the loss keys.
        loss_reduced.update({key: torch.tensor(value) for key, value in moe_losses.items()})
        if args.mtp_num_layers:  # mtp_{k} loss per depth, as Megatron logs it
            from megatron.core.transformer.multi_token_prediction import reduce_mtp_losses

            mtp = reduce_mtp_losses(model, get_num_microbatches())
            loss_reduced.update({key: torch.tensor(value) for key, value in mtp.items()})
        return loss_reduced, skipped_iter, grad_norm, num_zeros_in_grad
    return {}, skipped_iter, grad_norm, num_zeros_in_grad


def _moe_losses(model, config):
    """The step's router losses per Megatron's tracker (sum over layers / MoE layers); collective over the world."""
    from megatron.core.transformer.moe.moe_layer import reduce_moe_losses

    num_moe_layers = sum(config.is_moe_layer(i + 1) for i in range(config.num_layers))
    if config.mtp_num_layers and config.is_moe_layer(config.num_layers):  # MTP depths copy the last decoder layer
        num_moe_layers += config.mtp_num_layers
    return reduce_moe_losses(model, get_num_microbatches(), num_moe_layers,
                             per_layer_logging=config.moe_per_layer_logging)


def _sum_reported_losses(loss_dicts):
    """``{key: (numerator, denominator)}`` over the micro-batch reports of one step (last pipeline stage).

    A 2-element value ``[sum, count]`` (today's loss functions) is summed over the micro-batches and over the
    DP x CP group (context-parallel ranks hold different tokens), so ``numerator / denominator`` is the token mean
    of the global batch. A 1-element value
    (2023 loss functions, already averaged over data-parallel ranks) gives (sum over micro-batches, their count).
    """
    totals = {}
    for key in loss_dicts[0]:
        values = [torch.as_tensor(d[key]).detach().float().reshape(-1) for d in loss_dicts]
        if values[0].numel() == 2:
            total = torch.stack(values).sum(dim=0).to(device.current_device())
            torch.distributed.all_reduce(total, group=parallel_state.get_data_parallel_group(
                with_context_parallel=True))
            totals[key] = (total[0], total[1])
        elif values[0].numel() == 1:
            totals[key] = (torch.cat(values).sum(), len(values))
        else:
            raise RuntimeError(f"loss_func reported {key!r} with {values[0].numel()} elements: report a scalar "
                               "(2023 style) or a [sum, count] pair")
    return totals


def configure_schedule_hooks(config, model, optimizer):
    """Let the schedules scale the loss, defer DDP gradient reduction and finalise gradients; give the rerun state
    machine what a re-run restores (megatron/training/numerical_checks.py).

    Returns the ``ResultChecks`` that train_step and the gradient hook share (None when no check is asked)."""
    config.grad_scale_func = optimizer.scale_loss
    config.timers = get_timers()
    if len(model) == 1:
        config.no_sync_func = model[0].no_sync
    config.finalize_model_grads_func = finalize_model_grads
    if get_args().overlap_param_gather and get_args().align_param_gather:
        # Interleaved schedule: each chunk's parameter all-gathers start at aligned points of the schedule.
        config.param_sync_func = [chunk.start_param_sync for chunk in model]
    args = get_args()
    state = IterationState(model)
    machine = get_rerun_state_machine()
    machine.state_save_func, machine.state_restore_func = state.save, state.restore
    checks = ResultChecks.from_args(args)
    if not checks.any and not os.environ.get(FAULT_INJECT_ENV_VAR):
        return None
    config.finalize_model_grads_func = functools.partial(_checked_finalize_model_grads, checks=checks)
    return checks


def _checked_finalize_model_grads(model_chunks, *rest, checks, **kwargs):
    """Validate (or, in tests, poison) this rank's local gradients before the data-parallel reduction.

    With --overlap-grad-reduce (or --DDP-impl torch) the reduction already ran during the backward pass, so
    the check sees reduced gradients."""
    args = get_args()
    inject_nan_grad(model_chunks, torch.distributed.get_rank(), args.iteration + 1)
    validate_grads(model_chunks, checks)
    return finalize_model_grads(model_chunks, *rest, **kwargs)


def _wandb_run(args):
    if not getattr(args, "wandb_project", ""):
        return None
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True) or torch.distributed.get_rank() != \
            torch.distributed.get_world_size() - 1:
        return None
    try:
        import wandb  # optional
    except ImportError:
        print_rank_last("--wandb-project is set but wandb is not installed: not logging to Weights & Biases")
        return None
    return wandb.init(project=args.wandb_project, entity=getattr(args, "wandb_entity", None),
                      name=args.wandb_exp_name or None, dir=args.wandb_save_dir or None,
                      config=vars(args))


def periodic_evaluation_due(args, iteration: int) -> bool:
    """Evaluate after this iteration: every --eval-interval iterations, from --start-eval-at-iter on."""
    start = getattr(args, "start_eval_at_iter", None) or 0
    return bool(args.eval_interval) and iteration % args.eval_interval == 0 and iteration >= start


def train(forward_step_func, model, optimizer, opt_param_scheduler, train_data_iterator, valid_data_iterator,
          process_non_loss_data_func, config, progress=None):
    """Run ``train_step`` until ``--train-iters``; log, evaluate, save and exit as the flags ask."""
    args, timers = get_args(), get_timers()
    for chunk in model:
        chunk.train()
    checks = configure_schedule_hooks(config, model, optimizer)
    machine = get_rerun_state_machine()
    # Progress records for hang and straggler detection (hang_detection.py): local writes only.
    progress = progress or ProgressTracker(args.rank)
    forward_step_func = progress.wrap_forward_step(forward_step_func)
    config.finalize_model_grads_func = progress.wrap_collective(config.finalize_model_grads_func,
                                                                "finalize_model_grads (gradient all-reduce)", "optimizer")
    log_state = LogState()
    wandb_run = _wandb_run(args)
    iteration = args.iteration
    start_iteration = iteration
    manual_gc = ManualGC.from_args(args)
    manual_gc.start()
    profiler = IterationProfiler(args, torch.distributed.get_rank())

    timers("interval-time", log_level=0).start(barrier=True)
    print_datetime("before the start of training step")
    while iteration < args.train_iters:
        maybe_inject_fault(iteration + 1, args.rank)  # a test hook; nothing when MEGATRON_FAULT_INJECT is unset
        profiler.before_iteration(iteration)
        progress.begin_iteration(iteration + 1)
        update_num_microbatches(args.consumed_train_samples)
        if machine.state == RerunState.NOT_RUNNING_YET:
            machine.current_iteration = iteration
        if iteration + 1 in args.iterations_to_skip:
            iteration = _skip_iteration(iteration, train_data_iterator)
            continue
        try:
            loss_dict, skipped_iter, grad_norm, num_zeros_in_grad = train_step(
                forward_step_func, train_data_iterator, model, optimizer, opt_param_scheduler, config, checks=checks)
        except RerunExitRequest as request:
            _rerun_exit(request, iteration, model, optimizer, opt_param_scheduler)
        iteration += 1
        args.iteration = iteration
        profiler.after_iteration(iteration)
        batch_size = args.data_parallel_size * args.micro_batch_size * get_num_microbatches()
        args.consumed_train_samples += batch_size
        # Saved in checkpoints (num_floating_point_operations_so_far) so throughput totals survive a resume.
        args.num_floating_point_operations_so_far += num_floating_point_operations(args, batch_size)

        # A tensor: training_log turns it into a number only on log steps (no host-device sync per iteration).
        loss_scale = optimizer.get_loss_scale()
        if args.log_params_norm and args.overlap_param_gather:
            for chunk in model:
                chunk.start_param_sync(force_sync=True)  # the norm needs whole parameters now
        params_norm = calc_params_l2_norm(model) if args.log_params_norm else None
        # Megatron logs the default group's LR, never a --decoupled-lr group's.
        learning_rate = next(g["lr"] for g in optimizer.param_groups if not g.get("is_decoupled_lr"))
        training_log(log_state, loss_dict, learning_rate, iteration, loss_scale, skipped_iter, grad_norm,
                     params_norm, num_zeros_in_grad, wandb_run)
        progress.after_step(iteration)  # the --log-straggler report on log intervals
        if args.fake_process_group and iteration == start_iteration + 1:  # what this rank of the layout holds
            from megatron.training.rank_report import format_rank_memory_report, rank_memory_report
            print(format_rank_memory_report(rank_memory_report(args, model, optimizer)), flush=True)
        if machine.mode == RerunMode.REPORT_DETERMINISM_STATS and iteration % args.log_interval == 0:
            print_rank_last(machine.stats_report())

        if args.adlr_autoresume and iteration % args.adlr_autoresume_interval == 0:
            check_adlr_autoresume_termination(iteration, model, optimizer, opt_param_scheduler)
        if args.do_valid and periodic_evaluation_due(args, iteration):
            manual_gc.before_eval()
            _param_gather_hooks(model, enabled=False)
            evaluate_and_print_results(f"iteration {iteration}", forward_step_func, valid_data_iterator, model,
                                       iteration, process_non_loss_data_func, config)
            _param_gather_hooks(model, enabled=True)
            manual_gc.after_eval()
        manual_gc.after_iteration(iteration)
        progress.phase("save and exit checks")
        _save_or_exit(iteration, model, optimizer, opt_param_scheduler)
    profiler.stop()
    manual_gc.stop()
    _param_gather_hooks(model, enabled=False)  # whole parameters for the final evaluation and save
    if wandb_run is not None:
        wandb_run.finish()
    return iteration


def _skip_iteration(iteration, train_data_iterator) -> int:
    """--iterations-to-skip (or the tracker file): consume the iteration's micro-batches, train nothing."""
    args = get_args()
    advance_data_iterators(train_data_iterator, get_num_microbatches())
    args.consumed_train_samples += args.data_parallel_size * args.micro_batch_size * get_num_microbatches()
    print_rank_0(f"skipping iteration {iteration + 1} (--iterations-to-skip or --result-rejected-tracker-filename): "
                 "its micro-batches are consumed, nothing is trained")
    args.iteration = iteration + 1
    return iteration + 1


def _rerun_exit(request, iteration, model, optimizer, opt_param_scheduler):
    """The rerun state machine's verdict ends the job: save the checkpoint it asks for, then exit with its code."""
    args = get_args()
    what = {16: "resume from the last checkpoint on another device (EXIT_CODE_RESUME_TO_DISAMBIGUATE)",
            17: "restart from the last checkpoint (EXIT_CODE_FAILED_ON_RESULT_VALIDATION)"}.get(request.exit_code, "")
    if request.checkpoint:
        if args.save:
            _param_gather_hooks(model, enabled=False)
            save_checkpoint(iteration, model, optimizer, opt_param_scheduler, args.num_floating_point_operations_so_far)
        else:
            print_rank_0("WARNING: the rerun state machine asked for a checkpoint, but --save is not set: the job "
                         "cannot be resumed to re-run this iteration")
    print_datetime(f"exiting program at iteration {iteration + 1} with exit code {request.exit_code}: {what}")
    _exit(request.exit_code)


def _param_gather_hooks(model, enabled: bool):
    """--overlap-param-gather: turn the forward pre-hooks off (gathering pending parameters now) or back on."""
    if not get_args().overlap_param_gather:
        return
    for chunk in model:
        if enabled:
            chunk.enable_forward_pre_hook()
        else:
            chunk.disable_forward_pre_hook()


def check_adlr_autoresume_termination(iteration, model, optimizer, opt_param_scheduler) -> None:
    """--adlr-autoresume, every --adlr-autoresume-interval iterations: when the cluster asks the job to stop, save
    (with --save), ask for a resume (rank 0) and exit, as Megatron does."""
    args = get_args()
    autoresume = get_adlr_autoresume()
    torch.distributed.barrier()
    if not autoresume.termination_requested():
        return
    if args.save:
        _param_gather_hooks(model, enabled=False)
        save_checkpoint(iteration, model, optimizer, opt_param_scheduler, args.num_floating_point_operations_so_far)
    print_rank_0(">>> autoresume termination request found!")
    if torch.distributed.get_rank() == 0:
        autoresume.request_resume()
    print_rank_0(">>> training terminated. Returning")
    _exit()


def _save_or_exit(iteration, model, optimizer, opt_param_scheduler) -> None:
    """Save and exit checks after each iteration, in Megatron's order; an exit ends the process (``_exit``)."""
    args = get_args()
    saved = False

    def save():
        _param_gather_hooks(model, enabled=False)  # --overlap-param-gather: save whole parameters
        save_checkpoint(iteration, model, optimizer, opt_param_scheduler, args.num_floating_point_operations_so_far)
        _param_gather_hooks(model, enabled=True)

    if args.exit_signal_handler:
        # signals_received() is every rank's flag (a collective): stop when any rank got the signal.
        if any(get_signal_handler().signals_received()):
            if args.save:
                save()
            print_datetime("exiting program after receiving SIGTERM.")
            _exit()
    if args.save and args.save_interval and iteration % args.save_interval == 0:
        save()
        saved = True
    if args.exit_duration_in_mins:
        elapsed = torch.tensor([(time.time() - _TRAIN_START_TIME) / 60.0], device=device.current_device())
        torch.distributed.all_reduce(elapsed, op=torch.distributed.ReduceOp.MAX)
        if elapsed.item() > args.exit_duration_in_mins:
            if args.save and not saved:
                save()
            print_datetime("exiting program after {} minutes".format(elapsed.item()))
            _exit()
    if args.exit_interval and iteration % args.exit_interval == 0:
        if args.save and not saved:
            save()
        torch.distributed.barrier()
        print_datetime("exiting program at iteration {}".format(iteration))
        _exit()


def _exit(code=None):
    if get_args().async_save:
        from megatron.training.checkpointing.torch_dist import finalize_async_save
        finalize_async_save()
    writer = get_tensorboard_writer()
    if writer is not None:
        writer.flush()
    if code:
        raise AgreedExit(code)  # every rank reached the same verdict (fault_handling: an orderly stop)
    sys.exit()


# --------------------------------------------------------------------------------------- evaluate

def evaluate(forward_step_func, data_iterator, model, process_non_loss_data_func, config, verbose=False):
    """Average each reported loss over ``--eval-iters`` global batches (forward only)."""
    args, timers = get_args(), get_timers()
    timers("evaluate", log_level=0).start(barrier=True)
    for chunk in model:
        chunk.eval()
    total_loss_dict = {}
    eval_batch_size = args.global_batch_size
    eval_num_microbatches = eval_batch_size // (args.micro_batch_size * args.data_parallel_size)
    forward_backward_func = get_forward_backward_func()
    with torch.no_grad():
        for iteration in range(args.eval_iters):
            if verbose:
                print_rank_0(f"Evaluating iter {iteration + 1}/{args.eval_iters}")
            loss_dicts = forward_backward_func(
                forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                num_microbatches=eval_num_microbatches, seq_length=args.seq_length,
                micro_batch_size=args.micro_batch_size, decoder_seq_length=args.decoder_seq_length,
                forward_only=True)
            if args.empty_unused_memory_level >= 1:
                device.empty_cache()
            if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
                for key, (numerator, denominator) in _sum_reported_losses(loss_dicts).items():
                    total = total_loss_dict.get(key, (0.0, 0.0))
                    total_loss_dict[key] = (total[0] + float(numerator), total[1] + float(denominator))
            args.consumed_valid_samples += eval_batch_size

    collected_non_loss_data = None
    if process_non_loss_data_func is not None and parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        with torch.no_grad():
            collected_non_loss_data = forward_backward_func(
                forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                num_microbatches=get_num_microbatches(), seq_length=args.seq_length,
                micro_batch_size=args.micro_batch_size, decoder_seq_length=args.decoder_seq_length,
                forward_only=True, collect_non_loss_data=True)
    for chunk in model:
        chunk.train()
    for key, (numerator, denominator) in total_loss_dict.items():
        total_loss_dict[key] = numerator / denominator
    timers("evaluate").stop()
    timers.log(["evaluate"])
    return total_loss_dict, collected_non_loss_data


def evaluate_and_print_results(prefix, forward_step_func, data_iterator, model, iteration,
                               process_non_loss_data_func, config, verbose=False, write_to_tensorboard=True):
    """Evaluate and print Megatron's validation block (loss and PPL per key) on the last rank."""
    args = get_args()
    writer = get_tensorboard_writer() if write_to_tensorboard else None
    total_loss_dict, collected_non_loss_data = evaluate(forward_step_func, data_iterator, model,
                                                        process_non_loss_data_func, config, verbose)
    string = " validation loss at {} | ".format(prefix)
    for key, value in total_loss_dict.items():
        ppl = math.exp(min(20, value))
        string += "{} value: {:.6E} | ".format(key, value)
        string += "{} PPL: {:.6E} | ".format(key, ppl)
        if writer is not None:
            writer.add_scalar("{} validation".format(key), value, iteration)
            writer.add_scalar("{} validation vs samples".format(key), value, args.consumed_train_samples)
            if args.log_validation_ppl_to_tensorboard:
                writer.add_scalar("{} validation ppl".format(key), ppl, iteration)
    if process_non_loss_data_func is not None and writer is not None and collected_non_loss_data is not None:
        process_non_loss_data_func(collected_non_loss_data, iteration, writer)
    length = len(string) + 1
    print_rank_last("-" * length)
    print_rank_last(string)
    print_rank_last("-" * length)
    return total_loss_dict

