"""Accuracy of a finetuned classifier on each ``--valid-data`` file (Megatron-LM's ``tasks/eval_utils.py``).

accuracy = (number of samples whose ``argmax(logits)`` equals the label) / (number of samples), counted over every
batch of the file's loader (``--micro-batch-size`` as given, the last partial batch kept on one data-parallel
rank) and summed over the data-parallel group. Printed per file and overall, as Megatron prints them::

     > |epoch: 0| metrics for dev-matched: correct / total = 7 / 8 = 87.5000 %, elapsed time (sec): 0.012
     >> |epoch: 0| overall: correct / total = 15 / 16 = 93.7500 %

With ``--epochs 0`` (evaluation only) and one data-parallel rank the softmaxes, labels and ids are also saved to
``<--load>/predictions_<names>.pt`` (Megatron asserts one data-parallel rank there; here the accuracy is still
printed with more).
"""
from __future__ import annotations

import os
import time
from functools import partial

import torch

from megatron.core import device, parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.training.global_vars import get_args
from megatron.training.utils import is_last_rank, print_rank_last
from tasks.finetune_utils import build_data_loader, next_batch, process_batch


def accuracy_func_provider(single_dataset_provider):
    """``metrics_func(model, epoch, output_predictions=False)`` over one loader per ``--valid-data`` path."""
    args = get_args()
    dp = parallel_state.get_data_parallel_world_size()
    dataloaders = []
    for datapath in args.valid_data:
        dataset = single_dataset_provider(datapath)
        loader = build_data_loader(dataset, getattr(args, "orig_micro_batch_size", args.micro_batch_size),
                                   num_workers=args.num_workers, drop_last=dp > 1)
        dataloaders.append((dataset.dataset_name, loader))

    def metrics_func(model, epoch, output_predictions=False):
        print_rank_last("calculating metrics ...")
        correct, total = 0, 0
        named_predictions, names = [], "predictions"
        if output_predictions and dp != 1:
            print_rank_last("predictions are saved with one data-parallel rank only: not saving them")
            output_predictions = False
        for name, loader in dataloaders:
            output = calculate_correct_answers(name, model, loader, epoch, output_predictions)
            correct += output[0]
            total += output[1]
            if output_predictions:
                named_predictions.append((name, output[2]))
                names += "_" + name
        if is_last_rank():
            percent = float(correct) * 100.0 / float(max(total, 1))
            print(" >> |epoch: {}| overall: correct / total = {} / {} = {:.4f} %".format(epoch, correct, total,
                                                                                         percent), flush=True)
        if output_predictions and is_last_rank() and args.load is not None:
            torch.save(named_predictions, os.path.join(args.load, names + ".pt"))

    return metrics_func


def calculate_correct_answers(name, model, dataloader, epoch, output_predictions):
    """(correct, total[, (softmaxes, labels, ids)]) of one loader, summed over the data-parallel group."""
    args = get_args()
    start_time = time.time()
    for chunk in model:
        chunk.eval()
    saved_micro_batch_size, saved_global_batch_size = args.micro_batch_size, args.global_batch_size
    sample_multiplier = getattr(dataloader.dataset, "sample_multiplier", 1)
    orig_micro = getattr(args, "orig_micro_batch_size", args.micro_batch_size)
    orig_global = getattr(args, "orig_global_batch_size", args.global_batch_size)
    num_micro_batches = orig_global // (orig_micro * parallel_state.get_data_parallel_world_size())

    def loss_func(labels, uids, output_tensor):
        logits = output_tensor
        report = {}
        if output_predictions:
            report["softmaxes"] = torch.nn.functional.softmax(logits.float(), dim=-1).cpu().tolist()
            report["labels"] = labels.cpu().tolist()
            report["ids"] = uids.tolist()
        predicted = torch.argmax(logits, dim=-1)
        report["total"] = labels.size(0)
        report["correct"] = int((predicted == labels).sum().item())
        return torch.zeros((), device=logits.device), report

    def correct_answers_forward_step(batch, model):
        batch_ = next_batch(batch)
        tokens, types, labels, attention_mask = process_batch(batch_)
        output_tensor = model(tokens, attention_mask, tokentype_ids=types)
        return output_tensor, partial(loss_func, labels, batch_["uid"])

    correct, total = 0, 0
    softmaxes, labels, ids = [], [], []
    forward_backward_func = get_forward_backward_func()
    with torch.no_grad():
        for batch in dataloader:
            actual_batch_size = len(batch["label"])
            args.micro_batch_size = actual_batch_size * sample_multiplier
            args.global_batch_size = actual_batch_size * sample_multiplier * num_micro_batches
            reports = forward_backward_func(
                forward_step_func=correct_answers_forward_step, data_iterator=iter([batch]), model=model,
                num_microbatches=1, seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
                forward_only=True)
            for report in reports:
                total += report["total"]
                correct += report["correct"]
                if output_predictions:
                    softmaxes.extend(report["softmaxes"])
                    labels.extend(report["labels"])
                    ids.extend(report["ids"])
    for chunk in model:
        chunk.train()
    args.micro_batch_size, args.global_batch_size = saved_micro_batch_size, saved_global_batch_size

    if not parallel_state.is_pipeline_last_stage():
        return (0, 0, ()) if output_predictions else (0, 0)
    counts = torch.tensor([correct, total], dtype=torch.long, device=device.current_device())
    torch.distributed.all_reduce(counts, group=parallel_state.get_data_parallel_group())
    correct_ans, total_count = int(counts[0].item()), int(counts[1].item())
    percent = float(correct_ans) * 100.0 / float(max(total_count, 1))
    print_rank_last(" > |epoch: {}| metrics for {}: correct / total = {} / {} = {:.4f} %, elapsed time (sec): "
                    "{:.3f}".format(epoch, name, correct_ans, total_count, percent, time.time() - start_time))
    if output_predictions:
        return correct_ans, total_count, (softmaxes, labels, ids)
    return correct_ans, total_count
