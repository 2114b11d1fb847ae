"""Zero-shot GPT evaluation (Megatron-LM's ``tasks/zeroshot_gpt/evaluate.py``): ``--task WIKITEXT103`` or ``LAMBADA``.

The GPT model is pretrain_gpt.py's (megatron-core by default, legacy with ``--use-legacy-models``), loaded from
``--load`` (model weights only). Per batch of windows (tokens ``text[:, :-1]``, targets ``text[:, 1:]``, counted
positions ``pad_mask``; causal masks and positions from ``get_ltor_masks_and_position_ids``):

* WIKITEXT103 (metric ``loss``): L = sum over counted targets of ``-log softmax(logits)[target]`` (vocab-parallel
  cross entropy), summed over batches and the data-parallel group. With N detokenized tokens and M original
  (whitespace-separated) tokens::

      avg loss = L / (N - 1)      ppl = exp(min(20, avg loss))
      token ratio = (N - 1) / (M - 1)      adjusted ppl = exp(min(20, avg loss * token ratio))

  The adjusted perplexity is per original (word-level) token, the number WikiText papers report.
* LAMBADA (metric ``accuracy``): a passage is correct when the argmax of the logits equals the target at every
  counted position; accuracy = correct / number of passages.

Printed on the last rank, framed by dashes, as Megatron prints it::

     validation results on WIKITEXT103 | avg loss: 5.1234E+00 | ppl: 1.6789E+02 | adjusted ppl: ... | token ratio: ... |
     validation results on LAMBADA | number correct: 3.0000E+00 | total examples: 5.0000E+00 | avg accuracy: 6.0000E-01

The loader is Megatron's (``DistributedSampler`` without ``drop_last``): with more than one data-parallel rank the
sampler repeats up to DP - 1 windows to even out the ranks, and they are counted twice, as in Megatron.
"""
from __future__ import annotations

import math

import torch

from megatron.core import device, parallel_state, tensor_parallel
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.training.checkpointing import load_checkpoint
from megatron.training.global_vars import get_args, get_tokenizer
from megatron.training.training import get_model
from megatron.training.utils import get_ltor_masks_and_position_ids, is_last_rank, print_rank_0
from tasks.finetune_utils import build_data_loader
from tasks.zeroshot_gpt.datasets import build_dataset

METRICS = {"LAMBADA": "accuracy", "WIKITEXT103": "loss"}


def process_batch(batch):
    """(tokens, labels, attention_mask, position_ids, loss_mask) of a batch of ``seq_len + 1`` windows."""
    args, tokenizer = get_args(), get_tokenizer()
    dev = device.current_device()
    loss_mask = batch["pad_mask"].long().to(dev).contiguous()
    tokens_ = batch["text"].long().to(dev).contiguous()
    labels = tokens_[:, 1:].contiguous()
    tokens = tokens_[:, :-1].contiguous()
    attention_mask, _, position_ids = get_ltor_masks_and_position_ids(
        tokens, tokenizer.eod, args.reset_position_ids, args.reset_attention_mask, args.eod_mask_loss)
    return tokens, labels, attention_mask, position_ids, loss_mask


def metric_of_output(logits, labels, loss_mask, eval_metric):
    """Summed masked cross entropy (``loss``) or number of fully correct samples (``accuracy``) of a batch of
    vocabulary-parallel logits ``[b, s, V/tp]``."""
    if eval_metric == "loss":
        losses = tensor_parallel.vocab_parallel_cross_entropy(logits.contiguous().float(), labels.contiguous())
        return torch.sum(losses.view(-1) * loss_mask.contiguous().view(-1).float())
    full = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
    correct = (torch.argmax(full, -1) == labels).float()
    correct[(1 - loss_mask).bool()] = 1
    return correct.prod(-1).sum()


def forward_step(batch, model, eval_metric):
    """The metric of one batch on the last pipeline stage (None elsewhere)."""
    tokens, labels, attention_mask, position_ids, loss_mask = process_batch(batch)
    args = get_args()
    args.micro_batch_size = len(labels)  # tell the schedule the actual batch size

    def step(data_iterator, model_):
        output = model_(tokens, position_ids, attention_mask)
        return output, lambda out: (torch.zeros((), device=out.device),
                                    {"metric": metric_of_output(out, labels, loss_mask, eval_metric)})

    reports = get_forward_backward_func()(
        forward_step_func=step, data_iterator=iter([batch]), model=[model], num_microbatches=1,
        seq_length=tokens.size(1), micro_batch_size=len(labels), forward_only=True)
    if parallel_state.is_pipeline_last_stage():
        return reports[0]["metric"]
    return None


def evaluate(data_loader, model, eval_metric):
    args = get_args()
    model.eval()
    total_output = 0.0
    with torch.no_grad():
        for iteration, batch in enumerate(data_loader):
            if iteration % args.log_interval == 0:
                print_rank_0("> working on iteration: {}".format(iteration))
            output = forward_step(batch, model, eval_metric)
            if parallel_state.is_pipeline_last_stage():
                output = output.to(torch.float64)
                torch.distributed.all_reduce(output, group=parallel_state.get_data_parallel_group())
                total_output += output.item()
    return total_output


def results_line(task, eval_metric, output, dataset):
    """Megatron's result line (without the frame of dashes)."""
    string = " validation results on {} | ".format(task)
    if eval_metric == "loss":
        num_tokenized_tokens = dataset.num_tokenized_tokens
        num_original_tokens = dataset.num_original_tokens
        val_loss = output / (num_tokenized_tokens - 1)
        ppl = math.exp(min(20, val_loss))
        token_ratio = (num_tokenized_tokens - 1) / (num_original_tokens - 1)
        adjusted_ppl = math.exp(min(20, val_loss * token_ratio))
        string += "avg loss: {:.4E} | ".format(val_loss)
        string += "ppl: {:.4E} | ".format(ppl)
        string += "adjusted ppl: {:.4E} | ".format(adjusted_ppl)
        string += "token ratio: {} |".format(token_ratio)
    else:
        num_examples = len(dataset)
        string += "number correct: {:.4E} | ".format(output)
        string += "total examples: {:.4E} | ".format(num_examples)
        string += "avg accuracy: {:.4E}".format(output / num_examples)
    return string


def evaluate_and_print_results(task, data_loader, model, eval_metric):
    output = evaluate(data_loader, model, eval_metric)
    if is_last_rank():
        string = results_line(task, eval_metric, output, data_loader.dataset)
        length = len(string) + 1
        print("-" * length)
        print(string)
        print("-" * length, flush=True)
    return output


def main():
    """Build the GPT model, load ``--load``, evaluate ``--valid-data`` for ``--task``."""
    from pretrain_gpt import model_provider

    args = get_args()
    if args.task not in METRICS:
        raise NotImplementedError("Task {} is not implemented.".format(args.task))
    eval_metric = METRICS[args.task]
    model = get_model(model_provider, wrap_with_ddp=False)
    if args.load is not None:
        load_checkpoint(model, None, None)
    assert len(model) == 1, "the interleaved pipeline schedule is not supported for zero-shot evaluation"
    model = model[0]
    dataset = build_dataset(args.task)
    dataloader = build_data_loader(dataset, args.micro_batch_size, args.num_workers, drop_last=False)
    evaluate_and_print_results(args.task, dataloader, model, eval_metric)
    print_rank_0("done :-)")
