"""megatron-core's combined 1F1B schedule (``--overlap-moe-expert-parallel-comm``): the forward of one micro-batch
and the backward of another in one merged step, so that the MoE all-to-all of each hides behind the other's
computation.

:func:`combined_forward_backward_step` is ``forward_step`` and ``backward_step`` of ``schedules`` merged: the forward
step function is called with ``return_schedule_plan=True`` and returns a schedule plan (``GPTModel.build_schedule_plan``)
instead of an output; ``type(plan).run(f_plan, b_plan, b_grad)`` runs the forward plan's nodes interleaved with
the backward plan's (:mod:`megatron.core.models.common.model_chunk_schedule_plan`); the loss function runs as a
schedule node whose input gradient seeds the next step's backward plan. The plan and the loss node ride on the
returned output tensor (``output_tensor.schedule_plan``, ``output_tensor.loss_func``) to the step that runs its
backward.

Without pipelining, for ``M`` micro-batches: step 0 = forward(0); step k = forward(k) + backward(k-1) for k < M
(under ``no_sync_func``); step M = backward(M-1). Each micro-batch's forward and backward are those of the plain
schedule and the micro-batches are independent, so the losses equal ``forward_backward_no_pipelining``'s and the
accumulated gradients equal its gradients to rounding (the nodes sum a tensor's gradient contributions in another
order); the overlap itself (CUDA streams) is a GPU-only performance matter, and on CPU
the nodes run in order on one stream.
"""
from __future__ import annotations

from typing import List, Union

import torch

from megatron.core.pipeline_parallel.schedule_helpers import set_current_microbatch
from megatron.core.process_groups_config import pg_size
from megatron.core.pipeline_parallel.utils import AbstractSchedulePlan, ScheduleNode
from megatron.core.utils import get_attr_wrapped_model

Shape = Union[List[int], torch.Size]


def combined_1f1b_schedule_for_no_pipelining(forward_step_func, data_iterator, model, num_microbatches,
                                             input_tensor, output_tensor_grad, forward_data_store, config,
                                             collect_non_loss_data, first_val_step, forward_only, no_sync_func,
                                             total_num_tokens, check_first_val_step):
    """All ``num_microbatches`` micro-batches on one stage as ``M + 1`` merged steps (module docstring); the last
    backward runs outside ``no_sync_func`` (the gradient reduction happens once). ``check_first_val_step(cond)``
    maps "first micro-batch" to the validation-aware flag. Returns ``(forward_data_store, total_num_tokens)``."""
    output_tensor, num_tokens, _ = combined_forward_backward_step(
        forward_step_func, data_iterator, model, num_microbatches, input_tensor, forward_data_store, None,
        input_tensor, None, None, config, collect_non_loss_data=collect_non_loss_data,
        checkpoint_activations_microbatch=None, is_first_microbatch=check_first_val_step(True),
        current_microbatch=0)
    with no_sync_func():
        for i in range(num_microbatches - 1):
            total_num_tokens += num_tokens
            output_tensor, num_tokens, _ = combined_forward_backward_step(
                forward_step_func, data_iterator, model, num_microbatches, input_tensor, forward_data_store, model,
                input_tensor, output_tensor, output_tensor_grad, config, collect_non_loss_data=collect_non_loss_data,
                checkpoint_activations_microbatch=None, is_first_microbatch=check_first_val_step((i + 1) == 0),
                current_microbatch=i + 1)
    total_num_tokens += num_tokens
    combined_forward_backward_step(forward_step_func, data_iterator, None, num_microbatches, input_tensor,
                                   forward_data_store, model, input_tensor, output_tensor, output_tensor_grad, config)
    return forward_data_store, total_num_tokens


def combined_1f1b_schedule_for_interleaved_pipelining(
        config, forward_step_func, data_iterator, model, num_microbatches, forward_data_store,
        forward_step_helper_preprocess, forward_step_helper_postprocess, backward_step_helper_preprocess,
        backward_step_helper_postprocess, get_microbatch_id_in_model_chunk, get_model_chunk_id,
        check_first_val_step, is_first_microbatch_for_model_chunk, collect_non_loss_data,
        f_virtual_microbatch_id=None, b_virtual_microbatch_id=None, pre_forward=None, pre_backward=None,
        post_forward=None, post_backward=None):
    """One merged step of the interleaved pipeline schedule: the forward of virtual micro-batch
    ``f_virtual_microbatch_id`` and the backward of ``b_virtual_microbatch_id`` (either None), between the
    schedule's helpers::

        input = forward_step_helper_preprocess(f_vmb, f_chunk, f_mb)
        b_input, b_output, b_output_grad = backward_step_helper_preprocess(b_vmb, b_chunk)
        combined_forward_backward_step(...)      # on model[f_chunk] / model[b_chunk]
        forward_step_helper_postprocess(f_chunk, output, num_tokens)
        backward_step_helper_postprocess(b_vmb)

    ``pre_forward`` / ``pre_backward`` / ``post_forward`` / ``post_backward`` (the pipeline's receives and sends)
    are called by the plan's ``run``. Returns ``(output_tensor, input_tensor_grad)``."""
    f_chunk = f_microbatch = input_tensor = None
    if f_virtual_microbatch_id is not None:
        f_microbatch = get_microbatch_id_in_model_chunk(f_virtual_microbatch_id, forward=True)
        f_chunk = get_model_chunk_id(f_virtual_microbatch_id, forward=True)
        input_tensor = forward_step_helper_preprocess(f_virtual_microbatch_id, f_chunk, f_microbatch)
    b_chunk = b_input_tensor = b_output_tensor = b_output_tensor_grad = None
    if b_virtual_microbatch_id is not None:
        b_chunk = get_model_chunk_id(b_virtual_microbatch_id, forward=False)
        b_input_tensor, b_output_tensor, b_output_tensor_grad = backward_step_helper_preprocess(
            b_virtual_microbatch_id, b_chunk)
    output_tensor, num_tokens, input_tensor_grad = combined_forward_backward_step(
        forward_step_func, data_iterator[f_chunk] if f_chunk is not None else None,
        model[f_chunk] if f_chunk is not None else None, num_microbatches, input_tensor, forward_data_store,
        model[b_chunk] if b_chunk is not None else None, b_input_tensor, b_output_tensor, b_output_tensor_grad,
        config, f_model_chunk_id=f_chunk, pre_forward=pre_forward, pre_backward=pre_backward,
        post_forward=post_forward, post_backward=post_backward, collect_non_loss_data=collect_non_loss_data,
        checkpoint_activations_microbatch=None,
        is_first_microbatch=check_first_val_step(
            is_first_microbatch_for_model_chunk(f_virtual_microbatch_id)
            if f_virtual_microbatch_id is not None else None),
        current_microbatch=f_microbatch)
    if f_chunk is not None:
        forward_step_helper_postprocess(f_chunk, output_tensor, num_tokens)
    # As megatron-core: the backward helper runs when the backward chunk id is truthy (not for chunk 0).
    if b_chunk:
        backward_step_helper_postprocess(b_virtual_microbatch_id)
        if input_tensor is not None and input_tensor_grad is None:
            raise RuntimeError("combined 1F1B step: the backward produced no input gradient")
    return output_tensor, input_tensor_grad


def combined_forward_backward_step(forward_step_func, data_iterator, f_model, num_microbatches, input_tensor,
                                   forward_data_store, b_model, b_input_tensor, b_output_tensor,
                                   b_output_tensor_grad, config, f_model_chunk_id=None, pre_forward=None,
                                   pre_backward=None, post_forward=None, post_backward=None,
                                   collect_non_loss_data=False, checkpoint_activations_microbatch=None,
                                   is_first_microbatch=False, current_microbatch=None,
                                   encoder_decoder_xattn=False):
    """``forward_step`` on ``f_model`` and ``backward_step`` on ``b_model`` merged (module docstring); either
    model may be None.

    Forward: ``set_current_microbatch(f_model, current_microbatch)``, ``set_input_tensor(input_tensor)``,
    ``(plan, loss_func) = forward_step_func(data_iterator,
    unwrapped_model, return_schedule_plan=True)`` (the unwrapped model must be a GPTModel). Backward: the plan and
    loss node of ``b_output_tensor``; with no ``b_output_tensor_grad`` (last stage) the loss is backpropagated to
    the loss node's input first (through ``config.grad_scale_func``). Then ``type(plan).run(f_plan, b_plan,
    b_grad, pre_forward, ...)`` and the forward's loss (``forward_step_calc_loss``, the loss function as a
    :class:`ScheduleNode`). Returns ``(output_tensor, num_tokens, input_tensor_grad)``.
    """
    if checkpoint_activations_microbatch is not None:
        raise ValueError("checkpoint_activations_microbatch is not supported with overlap_moe_expert_parallel_comm")
    from megatron.core.pipeline_parallel.schedules import _autocast, forward_step_calc_loss

    if f_model is not None and config.timers is not None:
        config.timers("forward-compute", log_level=2).start()

    unwrap_output_tensor = False
    f_schedule_plan = loss_func = None
    if f_model is not None:
        if is_first_microbatch and hasattr(f_model, "set_is_first_microbatch"):
            f_model.set_is_first_microbatch()
        if current_microbatch is not None:
            set_current_microbatch(f_model, current_microbatch)
        if not isinstance(input_tensor, list):
            input_tensor = [input_tensor]
            unwrap_output_tensor = True
        get_attr_wrapped_model(f_model, "set_input_tensor")(input_tensor)
        with _autocast(config):
            try:
                unwrapped = get_attr_wrapped_model(f_model, "build_schedule_plan", return_model_obj=True)
            except RuntimeError as err:
                raise TypeError("the combined 1F1B schedule (EP all-to-all overlap) needs a model with "
                                "build_schedule_plan (GPTModel)") from err
            f_schedule_plan, loss_func = forward_step_func(data_iterator, unwrapped, return_schedule_plan=True)
            if not isinstance(f_schedule_plan, AbstractSchedulePlan):
                raise TypeError("with return_schedule_plan=True the forward step function must return an "
                                f"AbstractSchedulePlan first, got {type(f_schedule_plan).__name__}")

    unwrap_input_tensor_grad = False
    b_schedule_plan = None
    if b_model is not None:
        if not isinstance(b_input_tensor, list):
            b_input_tensor = [b_input_tensor]
            unwrap_input_tensor_grad = True
        for x in b_input_tensor:
            if x is not None:
                x.retain_grad()
        if not isinstance(b_output_tensor, list):
            b_output_tensor = [b_output_tensor]
        if not isinstance(b_output_tensor_grad, list):
            b_output_tensor_grad = [b_output_tensor_grad]
        b_schedule_plan, b_output_tensor[0].schedule_plan = b_output_tensor[0].schedule_plan, None
        loss_node, b_output_tensor[0].loss_func = b_output_tensor[0].loss_func, None
        if b_output_tensor_grad[0] is None:
            # Last stage: the loss's backward down to the loss node's input (the plan's output).
            if config.grad_scale_func is not None:
                b_output_tensor[0] = config.grad_scale_func(b_output_tensor[0])
            torch.autograd.backward(b_output_tensor[0], grad_tensors=b_output_tensor_grad[0])
            b_output_tensor_grad[0] = loss_node.get_grad()

    b_grad = b_output_tensor_grad[0] if b_model is not None else None
    with _autocast(config):
        output_tensor = type(f_schedule_plan or b_schedule_plan).run(
            f_schedule_plan, b_schedule_plan, b_grad=b_grad, pre_forward=pre_forward, pre_backward=pre_backward,
            post_forward=post_forward, post_backward=post_backward)

    num_tokens = None
    if f_model is not None:
        loss_node = ScheduleNode(loss_func, None, f_schedule_plan.event, name="loss_func")
        # The chunk's own pipeline position and CP size (with virtual stages parallel_state's virtual rank is the
        # backward chunk's by now).
        output_tensor, num_tokens = forward_step_calc_loss(
            f_model, output_tensor, loss_node.forward, config, f_model_chunk_id, collect_non_loss_data,
            num_microbatches, forward_data_store, pg_size(unwrapped.pg_collection, "cp"), unwrapped.post_process)
        output_tensor.schedule_plan = f_schedule_plan
        output_tensor.loss_func = loss_node
        if not unwrap_output_tensor:
            output_tensor = [output_tensor]

    input_tensor_grad = None
    if b_model is not None:
        input_tensor_grad = [None if x is None else x.grad for x in b_input_tensor]
        if unwrap_input_tensor_grad:
            input_tensor_grad = input_tensor_grad[0]
    return output_tensor, num_tokens, input_tensor_grad
