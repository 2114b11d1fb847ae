"""Finetuning loop of the classification tasks (Megatron-LM's ``tasks/finetune_utils.py``) over megatron.training.

``finetune(train_valid_datasets_provider, model_provider, ...)``:

1. datasets -> loaders (``DistributedSampler`` over the data-parallel group, torch defaults: shuffled with seed 0,
   re-shuffled each epoch by ``set_epoch(--seed + epoch)``, padded by repetition); ``--train-iters`` becomes
   ``epochs x batches per epoch``; ``--keep-last`` keeps the last partial batch. Datasets with a
   ``sample_multiplier`` (RACE: 4 choices per question) multiply the micro and global batch sizes.
2. model, optimizer and LR schedule (``setup_model_and_optimizer``): resumes from ``--load`` when it holds a
   checkpoint, else starts from ``--pretrained-checkpoint`` (model weights only, iteration 0); ``--epochs 0`` builds
   the model alone and only evaluates.
3. ``_train``: one micro-batch per step (global batch = micro batch x data-parallel size); the loss is the batch
   mean of ``CrossEntropy(logits, label)``, logged as ``lm loss``; ``--save-interval``, ``--eval-interval`` (loss
   on ``--eval-iters`` validation batches), ``--exit-interval``; a checkpoint after every epoch, then the
   end-of-epoch callback (accuracy on each ``--valid-data`` file). A resumed run skips the batches of its epoch
   already trained, so it continues exactly where the saved run was.
"""
from __future__ import annotations

import sys
from functools import partial

import torch

from megatron.core import device, parallel_state
from megatron.core.enums import ModelType
from megatron.core.utils import get_model_config
from megatron.training.checkpointing import load_checkpoint, save_checkpoint
from megatron.training.global_vars import get_args, get_num_microbatches, get_timers
from megatron.training.training import (configure_schedule_hooks, evaluate_and_print_results, get_model,
                                        setup_model_and_optimizer, train_step)
from megatron.training.training_log import LogState, training_log
from megatron.training.utils import average_losses_across_data_parallel_group, calc_params_l2_norm, print_rank_0


def process_batch(batch):
    """(tokens, types, labels, attention mask) on the device; the mask is float (half with --fp16)."""
    args = get_args()
    dev = device.current_device()
    tokens = batch["text"].long().to(dev).contiguous()
    types = batch["types"].long().to(dev).contiguous()
    labels = batch["label"].long().to(dev).contiguous()
    attention_mask = batch["padding_mask"].float().to(dev).contiguous()
    if args.fp16:
        attention_mask = attention_mask.half()
    return tokens, types, labels, attention_mask


def cross_entropy_loss_func(labels, output_tensor):
    """Batch-mean cross entropy of the logits; reported as ``lm loss`` averaged over data-parallel ranks."""
    loss = torch.nn.functional.cross_entropy(output_tensor.contiguous().float(), labels)
    averaged_loss = average_losses_across_data_parallel_group([loss])
    return loss, {"lm loss": averaged_loss[0]}


def next_batch(batch):
    """The schedules hand the forward step an iterator; the finetuning loop hands it the batch itself."""
    try:
        return next(batch)
    except TypeError:
        return batch


def _cross_entropy_forward_step(batch, model):
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    tokens, types, labels, attention_mask = process_batch(next_batch(batch))
    timers("batch-generator").stop()
    output_tensor = model(tokens, attention_mask, tokentype_ids=types)
    return output_tensor, partial(cross_entropy_loss_func, labels)


def build_data_loader(dataset, micro_batch_size, num_workers, drop_last, task_collate_fn=None):
    """A loader over this data-parallel rank's share of ``dataset`` (DistributedSampler, torch defaults).

    The loader has its own generator, so creating its iterator never draws from the global torch RNG (which holds
    the dropout stream that checkpoints save): a resumed run draws the same dropout masks as the straight run.
    """
    sampler = torch.utils.data.distributed.DistributedSampler(
        dataset, num_replicas=parallel_state.get_data_parallel_world_size(),
        rank=parallel_state.get_data_parallel_rank())
    return torch.utils.data.DataLoader(dataset, batch_size=micro_batch_size, sampler=sampler, shuffle=False,
                                       num_workers=num_workers, drop_last=drop_last,
                                       pin_memory=device.cuda_available(), collate_fn=task_collate_fn,
                                       generator=torch.Generator().manual_seed(0))


def _build_infinite_size_dataloader(dataloader):
    while True:
        yield from dataloader


def _build_train_valid_dataloaders(train_dataset, valid_dataset, task_collate_fn=None):
    args = get_args()
    print_rank_0("building train and validation dataloaders ...")
    train_dataloader = build_data_loader(train_dataset, args.micro_batch_size, args.num_workers, not args.keep_last,
                                         task_collate_fn)
    args.train_iters_per_epoch = len(train_dataloader)
    args.train_iters = args.epochs * args.train_iters_per_epoch
    valid_dataloader_ = build_data_loader(valid_dataset, args.micro_batch_size, args.num_workers, not args.keep_last,
                                          task_collate_fn)
    valid_dataloader = _build_infinite_size_dataloader(valid_dataloader_)
    # Batch sizes as the user gave them (the accuracy loaders use these), before the sample multiplier.
    args.orig_micro_batch_size = args.micro_batch_size
    args.orig_global_batch_size = args.global_batch_size
    if hasattr(train_dataset, "sample_multiplier"):
        args.micro_batch_size *= train_dataset.sample_multiplier
        args.global_batch_size *= train_dataset.sample_multiplier
    return train_dataloader, valid_dataloader


def _train(model, optimizer, opt_param_scheduler, forward_step, train_dataloader, valid_dataloader,
           end_of_epoch_callback):
    args, timers = get_args(), get_timers()
    if get_num_microbatches() != 1:
        raise RuntimeError("finetuning with gradient accumulation is not supported: --global-batch-size must be "
                           "--micro-batch-size x data-parallel size")
    config = get_model_config(model[0])
    checks = configure_schedule_hooks(config, model, optimizer)
    for chunk in model:
        chunk.train()
    log_state = LogState()
    start_epoch = args.iteration // args.train_iters_per_epoch
    start_iteration = args.iteration % args.train_iters_per_epoch
    iteration = args.iteration
    last_saved = None

    def save():
        nonlocal last_saved
        save_checkpoint(iteration, model, optimizer, opt_param_scheduler, args.num_floating_point_operations_so_far)
        last_saved = iteration

    timers("interval-time", log_level=0).start(barrier=True)
    for epoch in range(start_epoch, args.epochs):
        print_rank_0("working on epoch {} ...".format(epoch + 1))
        train_dataloader.sampler.set_epoch(args.seed + epoch)
        for iteration_, batch in enumerate(train_dataloader):
            if iteration_ < start_iteration:
                continue
            start_iteration = 0
            loss_dict, skipped_iter, grad_norm, num_zeros_in_grad = train_step(
                forward_step, batch, model, optimizer, opt_param_scheduler, config, checks=checks)
            iteration += 1
            args.iteration = iteration
            args.consumed_train_samples += args.micro_batch_size * args.data_parallel_size * get_num_microbatches()
            params_norm = calc_params_l2_norm(model) if args.log_params_norm else None
            learning_rate = next(g["lr"] for g in optimizer.param_groups if not g.get("is_decoupled_lr"))
            training_log(log_state, loss_dict, learning_rate, iteration, optimizer.get_loss_scale(), skipped_iter,
                         grad_norm, params_norm, num_zeros_in_grad)
            if args.save and args.save_interval and iteration % args.save_interval == 0:
                save()
            if args.eval_interval and iteration % args.eval_interval == 0:
                evaluate_and_print_results("iteration {}".format(iteration), forward_step, valid_dataloader, model,
                                           iteration, None, config)
            if args.exit_interval and iteration % args.exit_interval == 0:
                if args.save and last_saved != iteration:
                    save()
                torch.distributed.barrier()
                print_rank_0("exiting program at iteration {}".format(iteration))
                sys.exit()
        if args.save and last_saved != iteration:
            save()
        if end_of_epoch_callback is not None:
            end_of_epoch_callback(model, epoch)


def finetune(train_valid_datasets_provider, model_provider, model_type=ModelType.encoder_or_decoder,
             forward_step=_cross_entropy_forward_step, end_of_epoch_callback_provider=None, task_collate_fn=None):
    """Build the loaders, the model (from ``--load`` or ``--pretrained-checkpoint``) and the optimizer, then train
    ``--epochs`` epochs; with ``--epochs 0`` only run the end-of-epoch callback (epoch -1)."""
    args, timers = get_args(), get_timers()
    timers("train/valid/test dataset/dataloder", log_level=0).start()
    if args.epochs > 0:
        train_dataset, valid_dataset = train_valid_datasets_provider()
        train_dataloader, valid_dataloader = _build_train_valid_dataloaders(train_dataset, valid_dataset,
                                                                            task_collate_fn)
    else:
        args.train_iters = 0
    timers("train/valid/test dataset/dataloder").stop()

    timers("callback function", log_level=0).start()
    end_of_epoch_callback = end_of_epoch_callback_provider() if end_of_epoch_callback_provider is not None else None
    timers("callback function").stop()

    timers("model and optimizer", log_level=0).start()
    if args.epochs > 0:
        model, optimizer, opt_param_scheduler = setup_model_and_optimizer(model_provider, model_type)
    else:
        # Evaluation only: no optimizer and no LR schedule (there are no iterations to schedule).
        model, optimizer, opt_param_scheduler = get_model(model_provider, model_type, wrap_with_ddp=False), None, None
        args.iteration = 0
        if args.load is not None or args.pretrained_checkpoint is not None:
            args.iteration = load_checkpoint(model, None, None)
    timers("model and optimizer").stop()
    print_rank_0("done with setups ...")
    timers.log(["train/valid/test dataset/dataloder", "callback function", "model and optimizer"])

    print_rank_0("training ...")
    if args.epochs > 0:
        _train(model, optimizer, opt_param_scheduler, forward_step, train_dataloader, valid_dataloader,
               end_of_epoch_callback)
    elif end_of_epoch_callback is not None:
        print_rank_0("evaluation only mode, setting epoch to -1")
        end_of_epoch_callback(model, epoch=-1, output_predictions=True)
    print_rank_0("done :-)")
