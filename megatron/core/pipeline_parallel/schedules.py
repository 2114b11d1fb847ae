"""Forward-backward schedules over micro-batches (megatron.core.pipeline_parallel.schedules).

All three schedules share one keyword-only signature and the ``forward_step_func(data_iterator, model) ->
(output_tensor, loss_func)`` contract. On the last pipeline stage ``loss_func(output_tensor)`` returns either

* ``(loss_sum, num_tokens, reported_dict)`` (today's contract): ``loss_sum`` is the sum of the masked
  per-token losses of the micro-batch and ``num_tokens`` their count. Without
  ``config.calculate_per_token_loss`` the schedule backpropagates ``loss_sum / max(num_tokens, 1) / M``
  (``M`` micro-batches: a mean of per-micro-batch token means). With it, ``loss_sum`` is backpropagated
  unchanged and ``num_tokens`` is summed over the step's micro-batches (and model chunks) into
  ``total_num_tokens``, which ``finalize_model_grads`` sums over DP x CP and divides the gradients by: the
  gradient of the exact token mean over the global batch.
* ``(loss, reported_dict)`` (the 2023 contract): ``loss * CP / M`` is backpropagated (CP: context-parallel size,
  as Megatron scales it).

``reported_dict`` is stored per micro-batch; backward multiplies by ``config.grad_scale_func`` (loss scale).

1F1B (``forward_backward_pipelining_without_interleaving``), with ``p`` stages, stage ``r``, ``M``
micro-batches: stage ``r`` first runs ``w = min(p - r - 1, M)`` forward passes (warm-up), then alternates
one forward and one backward ``M - w`` times (steady state), then runs the remaining ``w`` backward passes
(cool-down). At most ``p - r`` activations are alive on stage ``r``.

Interleaved (``forward_backward_pipelining_with_interleaving``): each rank holds ``C`` model chunks
(virtual stages); virtual stage ``c * p + r`` lives on rank ``r``. Forward micro-batch step ``k`` runs chunk
``(k mod pC) div p`` (backward: reversed), so ranks cycle through their chunks in groups of ``p``
micro-batches; warm-up is ``(p - r - 1) * 2 + (C - 1) * p`` steps (all of them when ``M == p`` or
forward-only). Requires ``M % p == 0``.

Process groups (megatron-core's keywords of every schedule): ``pg_collection`` gives the pipeline (``pp``), context
(``cp``, the 2023 loss factor and the activation shapes) and tensor (``tp``, sequence-parallel shapes) groups and is
handed to ``config.finalize_model_grads_func``; ``p2p_communicator`` (a :class:`P2PCommunicator`) the pipeline
exchanges. Without them: parallel_state's groups.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Iterator, List, Optional, Tuple, Union

import torch
from torch.autograd.variable import Variable

from megatron.core import device, parallel_state
from megatron.core.enums import ModelType
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.pipeline_parallel.schedule_helpers import (clear_embedding_activation_buffer,  # noqa: F401
                                                              finish_embedding_wgrad_compute, get_pp_rank_microbatches,
                                                              set_current_microbatch)
from megatron.core.process_groups_config import is_pp_stage_after_split_of, pg_group, pg_rank, pg_size
from megatron.core.utils import get_attr_wrapped_model, get_model_config, get_model_type


def get_forward_backward_func(pp_size: Optional[int] = None, vp_size: Optional[int] = None):
    """The schedule for the parallel layout (pp == 1, pp > 1, or pp > 1 with virtual stages); ``pp_size`` /
    ``vp_size`` default to parallel_state's (megatron-core's signature)."""
    if pp_size is None:
        pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        vp_size = parallel_state.get_virtual_pipeline_model_parallel_world_size() if vp_size is None else vp_size
    if pp_size > 1:
        if vp_size is not None:
            return forward_backward_pipelining_with_interleaving
        return forward_backward_pipelining_without_interleaving
    return forward_backward_no_pipelining


class _Pipeline:
    """The groups one schedule run uses: the pipeline exchanges (``p2p_communicator``, or one over
    ``pg_collection.pp`` / parallel_state's), this rank's stage, the CP and TP sizes."""

    def __init__(self, config, p2p_communicator=None, pg_collection=None):
        self.pg_collection = pg_collection
        if p2p_communicator is not None:
            self.pp_rank = torch.distributed.get_rank(group=p2p_communicator.pp_group)
            self.pp_size = torch.distributed.get_world_size(group=p2p_communicator.pp_group)
        else:
            self.pp_rank, self.pp_size = pg_rank(pg_collection, "pp"), pg_size(pg_collection, "pp")
            group = pg_group(pg_collection, "pp")
            if group is not None and torch.distributed.is_initialized():
                p2p_communicator = P2PCommunicator(group, config)
        self.p2p = p2p_communicator
        self.cp_size = pg_size(pg_collection, "cp")
        self.tp_size = pg_size(pg_collection, "tp")

    def first(self, ignore_virtual: bool = False) -> bool:
        """First stage (and, unless ``ignore_virtual``, parallel_state's current chunk is the first)."""
        vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
        if not ignore_virtual and vpp is not None and (parallel_state.get_virtual_pipeline_model_parallel_rank() or 0):
            return False
        return self.pp_rank == 0

    def last(self, ignore_virtual: bool = False) -> bool:
        vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
        if not ignore_virtual and vpp is not None and \
                (parallel_state.get_virtual_pipeline_model_parallel_rank() or 0) != vpp - 1:
            return False
        return self.pp_rank == self.pp_size - 1

    def after_split(self) -> bool:
        """A decoder stage of an encoder-decoder pipeline (parallel_state's split rank, on this pipeline)."""
        return self.pp_size > 1 and is_pp_stage_after_split_of(None, self.pp_rank, self.pp_size)


def deallocate_output_tensor(out, deallocate_pipeline_outputs: bool = False):
    """Free a sent activation's storage, keeping its autograd node (``.data`` becomes one element).

    Only the ``grad_fn`` of a stage output is needed for its backward pass; :func:`custom_backward` runs the
    engine without the shape check that the shrunken tensor would fail.
    """
    if out is None or not deallocate_pipeline_outputs:
        return
    assert isinstance(out, torch.Tensor), f"expected Tensor, found {type(out).__name__}"
    assert out._base is None, "counter-productive to free a view of another tensor"
    out.data = torch.empty((1,), device=out.device, dtype=out.dtype)


def custom_backward(output, grad_output):
    """Backward from ``output`` with ``grad_output`` straight through the autograd engine (no shape check)."""
    assert output.numel() == 1, "output should be pseudo-freed in schedule, to optimize memory"
    assert isinstance(output, torch.Tensor), f"output == {type(output).__name__}"
    assert isinstance(grad_output, (torch.Tensor, type(None))), f"grad_output == {type(grad_output).__name__}"
    if grad_output is None:
        assert output.numel() == 1, "implicit grad requires scalar output."
        grad_output = torch.ones_like(output, memory_format=torch.preserve_format)
    Variable._execution_engine.run_backward(
        tensors=(output,), grad_tensors=(grad_output,), keep_graph=False, create_graph=False, inputs=tuple(),
        allow_unreachable=True, accumulate_grad=True,
    )


def _autocast(config):
    if not config.enable_autocast:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.current_device().type, dtype=config.autocast_dtype)


def forward_step(forward_step_func, data_iterator, model, num_microbatches, input_tensor, forward_data_store,
                 config, cp_group_size=None, collect_non_loss_data=False, checkpoint_activations_microbatch=None,
                 is_first_microbatch=False, current_microbatch=None, vp_stage=None, is_last_stage=None,
                 after_split=None):
    """Run one micro-batch forward; on the last stage, apply the loss function and store its report.

    Returns ``(output_tensor, num_tokens)``: ``num_tokens`` is the loss function's token count on the last
    stage with the 3-tuple contract, else an int64 zero. ``cp_group_size`` / ``is_last_stage`` (megatron-core's)
    default to parallel_state's; ``after_split``: this is a decoder stage of an encoder-decoder pipeline.
    """
    if cp_group_size is None:
        cp_group_size = parallel_state.get_context_parallel_world_size()
    if is_last_stage is None:
        is_last_stage = parallel_state.is_pipeline_last_stage()
    if after_split is None:
        after_split = (parallel_state.get_pipeline_model_parallel_world_size() > 1
                       and parallel_state.is_pipeline_stage_after_split())
    if config.timers is not None:
        config.timers("forward-compute", log_level=2).start()
    # A list of input tensors (the 1F1B schedule of an encoder-decoder model) gets a list of outputs back.
    listed = isinstance(input_tensor, list)
    set_input_tensor = get_attr_wrapped_model(model, "set_input_tensor")
    set_input_tensor(input_tensor if listed else [input_tensor])

    with _autocast(config):
        if checkpoint_activations_microbatch is None:
            output_tensor, loss_func = forward_step_func(data_iterator, model)
        else:
            output_tensor, loss_func = forward_step_func(data_iterator, model, checkpoint_activations_microbatch)

    output_tensor, num_tokens = forward_step_calc_loss(model, output_tensor, loss_func, config, vp_stage,
                                                       collect_non_loss_data, num_microbatches, forward_data_store,
                                                       cp_group_size, is_last_stage)
    if listed:
        # Decoder stages of an encoder-decoder pipeline pass the encoder output on (the skip connection).
        if after_split and _model_type(model) == ModelType.encoder_and_decoder:
            return [output_tensor, input_tensor[-1]], num_tokens
        return [output_tensor], num_tokens
    return output_tensor, num_tokens


def forward_step_calc_loss(model, output_tensor, loss_func, config, vp_stage, collect_non_loss_data,
                           num_microbatches, forward_data_store, cp_group_size=None, is_last_stage=None):
    """The loss half of :func:`forward_step`: on the last stage, ``loss_func(output_tensor)`` (the 3-tuple or the
    2023 2-tuple contract, see :func:`_apply_loss_func`; with ``collect_non_loss_data`` its ``non_loss_data=True``
    result; without a ``loss_func`` the output itself) goes into ``forward_data_store``; stops the
    ``forward-compute`` timer; sets the MoE / MTP loss scales. Returns ``(tensor to backpropagate, num_tokens)``.
    ``cp_group_size`` and ``is_last_stage`` come together, or both default to parallel_state's."""
    if cp_group_size is None and is_last_stage is None:
        cp_group_size = parallel_state.get_context_parallel_world_size()
        is_last_stage = parallel_state.is_pipeline_last_stage()
    elif cp_group_size is None or is_last_stage is None:
        raise ValueError("forward_step_calc_loss: give both cp_group_size and is_last_stage, or neither")
    num_tokens = torch.zeros((), dtype=torch.int64)
    if is_last_stage:
        if loss_func is None:
            forward_data_store.append(output_tensor)
        elif not collect_non_loss_data:
            output_tensor, num_tokens, loss_reduced = _apply_loss_func(loss_func, output_tensor, num_microbatches,
                                                                       config, cp_group_size)
            forward_data_store.append(loss_reduced)
        else:
            forward_data_store.append(loss_func(output_tensor, non_loss_data=True))
    if config.timers is not None:
        config.timers("forward-compute").stop()
    if getattr(config, "num_moe_experts", None) is not None:  # on every stage: each holds router losses
        _set_moe_aux_loss_scale(num_microbatches, config, cp_group_size)
    if getattr(config, "mtp_num_layers", None):
        _set_mtp_loss_scale(num_microbatches, config)
    return output_tensor, num_tokens


def _apply_loss_func(loss_func, output_tensor, num_microbatches, config, cp_size):
    """(tensor to backpropagate, token count, report) from a 3-tuple or legacy 2-tuple loss function."""
    result = loss_func(output_tensor)
    if isinstance(result, (tuple, list)) and len(result) == 3:
        loss, num_tokens, loss_reduced = result
        num_tokens = torch.as_tensor(num_tokens).detach().to(torch.int64).reshape(())
        if not config.calculate_per_token_loss:
            loss = loss / num_tokens.clamp(min=1).to(loss.dtype) / num_microbatches
        return loss, num_tokens, loss_reduced
    if isinstance(result, (tuple, list)) and len(result) == 2:
        if config.calculate_per_token_loss:
            raise RuntimeError("--calculate-per-token-loss needs a loss_func that returns (loss_sum, num_tokens, "
                               "reported_dict); this one returns the 2023 (loss, reported_dict)")
        loss, loss_reduced = result
        # Megatron scales a 2023-style loss by the context-parallel size (the gradients are averaged over DP x CP).
        loss = loss * cp_size
        return loss / num_microbatches, torch.zeros((), dtype=torch.int64), loss_reduced
    raise RuntimeError("loss_func must return (loss_sum, num_tokens, reported_dict) or (loss, reported_dict), e.g. "
                       f"(loss, {{'lm loss': averaged_loss}}); got {type(result).__name__}")


def _set_moe_aux_loss_scale(num_microbatches, config, cp_size):
    """MoE router losses get the main loss's backward scale: loss scale / micro-batches (x CP), or the loss scale
    alone with ``calculate_per_token_loss`` (the routers pre-multiply by their token count)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    scale = torch.ones(1, device=device.current_device())
    if config.grad_scale_func is not None:
        scale = config.grad_scale_func(scale)
    if not config.calculate_per_token_loss:
        scale = scale * cp_size / num_microbatches
    MoEAuxLossAutoScaler.set_loss_scale(scale)


def _set_mtp_loss_scale(num_microbatches, config):
    """Multi-token prediction losses get the main loss's backward scale: loss scale / micro-batches (the loss scale
    alone with ``calculate_per_token_loss``); no context-parallel factor."""
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    scale = torch.ones(1, device=device.current_device())
    if config.grad_scale_func is not None:
        scale = config.grad_scale_func(scale)
    if not config.calculate_per_token_loss:
        scale = scale / num_microbatches
    MTPLossAutoScaler.set_loss_scale(scale)


def backward_step(input_tensor, output_tensor, output_tensor_grad, model_type, config, after_split=None):
    """Backpropagate one micro-batch; return the gradient of this stage's input (None on the first stage).

    Lists (encoder-decoder pipelines): backward runs from ``output_tensor[0]``; the gradient that came back for the
    passed-on encoder output (``output_tensor_grad[1]``) is added to the gradient of the received one.
    """
    if config.timers is not None:
        config.timers("backward-compute", log_level=2).start()
    listed = isinstance(input_tensor, list)
    inputs = input_tensor if listed else [input_tensor]
    outputs = output_tensor if isinstance(output_tensor, list) else [output_tensor]
    output_grads = output_tensor_grad if isinstance(output_tensor_grad, list) else [output_tensor_grad]
    for x in inputs:
        if x is not None:
            x.retain_grad()
    output, output_grad = outputs[0], output_grads[0]
    if output_grad is None and config.grad_scale_func is not None:
        output = config.grad_scale_func(output)

    if config.deallocate_pipeline_outputs and output_grad is not None:
        custom_backward(output, output_grad)
    else:
        torch.autograd.backward(output, grad_tensors=output_grad)

    input_grads = [x.grad if x is not None else None for x in inputs]
    if after_split is None:
        after_split = (parallel_state.get_pipeline_model_parallel_world_size() > 1
                       and parallel_state.is_pipeline_stage_after_split())
    if (after_split and model_type == ModelType.encoder_and_decoder and len(output_grads) > 1
            and output_grads[1] is not None):
        input_grads[-1].add_(output_grads[1])
    if config.timers is not None:
        config.timers("backward-compute").stop()
    return input_grads if listed else input_grads[0]


def _single(value, name):
    if isinstance(value, list):
        if len(value) != 1:
            raise RuntimeError(f"this schedule expects one model chunk, but {name} is a list of {len(value)}; "
                               "interleaved schedules need --num-layers-per-virtual-pipeline-stage")
        return value[0]
    return value


def _model_type(model):
    try:
        return get_model_type(model)
    except RuntimeError:
        return ModelType.encoder_or_decoder


def _check_model_type(model, interleaved: bool = False):
    model_type = _model_type(model)
    if interleaved and model_type == ModelType.encoder_and_decoder:
        raise RuntimeError("Interleaving is not supported with an encoder and decoder model.")
    return model_type


def _no_sync_func(config, model):
    if config.no_sync_func is not None:
        return config.no_sync_func
    if hasattr(model, "no_sync"):
        return model.no_sync
    return contextlib.nullcontext


def _zero_tokens() -> torch.Tensor:
    """The step's token counter (int64 on the collective device, as finalize_model_grads reduces it)."""
    return torch.zeros((), dtype=torch.int64, device=device.current_device())


def _finalize(config, models, forward_only, total_num_tokens, pg_collection=None, force_all_reduce=False):
    """Call ``config.finalize_model_grads_func``, with the step's token count under per-token loss (and the
    schedule's ``pg_collection`` / ``force_all_reduce`` when it was given them)."""
    if not forward_only and getattr(config, "finalize_model_grads_func", None) is not None:
        args = [models, total_num_tokens.clone()] if config.calculate_per_token_loss else [models]
        kwargs = {} if pg_collection is None else {"pg_collection": pg_collection}
        if force_all_reduce:
            kwargs["force_all_reduce"] = True
        config.finalize_model_grads_func(*args, **kwargs)


def _refuse_shape_hook(adjust_tensor_shapes_fn, schedule: str) -> None:
    """megatron-core's ``adjust_tensor_shapes_fn`` (heterogeneous stage shapes) is not implemented: refused.
    ``first_val_step`` (Transformer Engine's FP8 weight caching during validation) changes no result here."""
    if adjust_tensor_shapes_fn is not None:
        raise NotImplementedError(f"{schedule}(adjust_tensor_shapes_fn=...) is not implemented: every stage "
                                  "exchanges get_tensor_shapes()'s shapes")


def forward_backward_no_pipelining(*, forward_step_func, data_iterator: Union[Iterator, List[Iterator]],
                                   model: Union[torch.nn.Module, List[torch.nn.Module]], num_microbatches: int,
                                   seq_length: int, micro_batch_size: int, decoder_seq_length: Optional[int] = None,
                                   forward_only: bool = False, collect_non_loss_data: bool = False,
                                   first_val_step: Optional[bool] = None, adjust_tensor_shapes_fn=None,
                                   p2p_communicator: Optional[P2PCommunicator] = None, pg_collection=None,
                                   force_all_reduce: bool = False):
    """All micro-batches on one stage; gradients are reduced only during the last backward pass."""
    _refuse_shape_hook(adjust_tensor_shapes_fn, "forward_backward_no_pipelining")
    model = _single(model, "model")
    data_iterator = _single(data_iterator, "data_iterator")
    config = get_model_config(model)
    cp_size = pg_size(pg_collection, "cp")
    model_type = _check_model_type(model)
    no_sync = _no_sync_func(config, model)

    forward_data_store = []
    input_tensor, output_tensor_grad = None, None
    total_num_tokens = _zero_tokens()
    if config.overlap_moe_expert_parallel_comm and not forward_only:
        # megatron-core's combined 1F1B schedule: a micro-batch's forward merged with the previous one's backward.
        from megatron.core.pipeline_parallel.combined_1f1b import combined_1f1b_schedule_for_no_pipelining

        forward_data_store, total_num_tokens = combined_1f1b_schedule_for_no_pipelining(
            forward_step_func, data_iterator, model, num_microbatches, input_tensor, output_tensor_grad,
            forward_data_store, config, collect_non_loss_data, first_val_step, forward_only, no_sync,
            total_num_tokens, functools.partial(check_first_val_step, first_val_step, forward_only))
        _finalize(config, [model], forward_only, total_num_tokens, pg_collection, force_all_reduce)
        return forward_data_store
    if getattr(config, "hybrid_context_parallel", False):
        from megatron.core.pipeline_parallel.hybrid_cp_schedule import hybrid_context_parallel_forward_backward

        forward_data_store, total_num_tokens = hybrid_context_parallel_forward_backward(
            forward_step_func, data_iterator, model, num_microbatches, input_tensor, output_tensor_grad,
            forward_data_store, config, collect_non_loss_data, first_val_step, forward_only, no_sync,
            total_num_tokens, check_first_val_step, model_type)
        _finalize(config, [model], forward_only, total_num_tokens, pg_collection, force_all_reduce)
        return forward_data_store
    with no_sync():
        for _ in range(num_microbatches - 1):
            output_tensor, num_tokens = forward_step(forward_step_func, data_iterator, model, num_microbatches,
                                                     input_tensor, forward_data_store, config, cp_size,
                                                     collect_non_loss_data, is_last_stage=True, after_split=False)
            total_num_tokens += num_tokens.to(total_num_tokens.device)
            if not forward_only:
                backward_step(input_tensor, output_tensor, output_tensor_grad, model_type, config, after_split=False)
    # The last micro-batch runs outside no_sync so that the gradient reduction happens once.
    output_tensor, num_tokens = forward_step(forward_step_func, data_iterator, model, num_microbatches, input_tensor,
                                             forward_data_store, config, cp_size, collect_non_loss_data,
                                             is_last_stage=True, after_split=False)
    total_num_tokens += num_tokens.to(total_num_tokens.device)
    if not forward_only:
        backward_step(input_tensor, output_tensor, output_tensor_grad, model_type, config, after_split=False)
    _finalize(config, [model], forward_only, total_num_tokens, pg_collection, force_all_reduce)
    return forward_data_store


def get_tensor_shapes(*, seq_length: int, micro_batch_size: int, config, rank: Optional[int] = None,
                      model_type=ModelType.encoder_or_decoder, decoder_seq_length: Optional[int] = None,
                      tp_group=None, cp_group=None) -> List[tuple]:
    """Shapes of the activations stage ``rank`` sends: ``[(s / cp [/tp with SP], b, h)]``; for an encoder-decoder
    model an encoder stage sends ``[(se, b, h)]`` and a decoder stage ``[(sd, b, h), (se, b, h)]`` (its output and
    the encoder output it passes on). ``tp_group`` / ``cp_group`` (megatron-core's): default parallel_state's."""
    groups = None if tp_group is None and cp_group is None else _groups(tp=tp_group, cp=cp_group)
    tp = pg_size(groups, "tp") if config.sequence_parallel else 1
    if model_type == ModelType.encoder_and_decoder:
        if decoder_seq_length is None:
            raise ValueError("an encoder-decoder pipeline needs decoder_seq_length (--decoder-seq-length)")
        encoder_shape = (seq_length // tp, micro_batch_size, config.hidden_size)
        # ``rank``: a stage of the schedule's pipeline (a collection's or parallel_state's), split at
        # parallel_state's split rank.
        split = parallel_state.get_pipeline_model_parallel_split_rank()
        before = parallel_state.is_pipeline_stage_before_split() if rank is None else (split is None or rank < split)
        if before:
            return [encoder_shape]
        return [(decoder_seq_length // tp, micro_batch_size, config.hidden_size), encoder_shape]
    seq_length = seq_length // pg_size(groups, "cp")
    return [(seq_length // tp, micro_batch_size, config.hidden_size)]


def _groups(**groups):
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection(**groups)


class _GradSyncToggle:
    """Hold the DDP ``no_sync`` context open until the last backward pass of the step."""

    def __init__(self, no_sync_func):
        self.no_sync_func = no_sync_func
        self.context = None

    def disable(self):
        if self.context is None:
            self.context = self.no_sync_func()
            self.context.__enter__()

    def enable(self):
        if self.context is not None:
            self.context.__exit__(None, None, None)
            self.context = None


def forward_backward_pipelining_without_interleaving(
        *, forward_step_func, data_iterator: Union[Iterator, List[Iterator]],
        model: Union[torch.nn.Module, List[torch.nn.Module]], num_microbatches: int, seq_length: int,
        micro_batch_size: int, decoder_seq_length: Optional[int] = None, forward_only: bool = False,
        collect_non_loss_data: bool = False, first_val_step: Optional[bool] = None, adjust_tensor_shapes_fn=None,
        p2p_communicator: Optional[P2PCommunicator] = None, pg_collection=None, force_all_reduce: bool = False):
    """1F1B: warm-up forwards, steady one-forward-one-backward, cool-down backwards (see module docstring)."""
    _refuse_shape_hook(adjust_tensor_shapes_fn, "forward_backward_pipelining_without_interleaving")
    model = _single(model, "model")
    data_iterator = _single(data_iterator, "data_iterator")
    config = get_model_config(model)
    model_type = _check_model_type(model)
    grad_sync = _GradSyncToggle(_no_sync_func(config, model))
    grad_sync.disable()

    pipe = _Pipeline(config, p2p_communicator, pg_collection)
    p2p, first, last, after_split = pipe.p2p, pipe.first(), pipe.last(), pipe.after_split()
    pp_size, pp_rank = pipe.pp_size, pipe.pp_rank
    num_warmup = num_microbatches if forward_only else min(pp_size - pp_rank - 1, num_microbatches)
    num_remaining = num_microbatches - num_warmup
    # Lists of tensors: one per activation exchanged (two after the split of an encoder-decoder model).
    groups = _groups(tp=pg_group(pg_collection, "tp"), cp=pg_group(pg_collection, "cp"))
    recv_shapes = get_tensor_shapes(seq_length=seq_length, micro_batch_size=micro_batch_size, config=config,
                                    rank=pp_rank - 1, model_type=model_type, decoder_seq_length=decoder_seq_length,
                                    tp_group=groups.tp, cp_group=groups.cp)
    send_shapes = get_tensor_shapes(seq_length=seq_length, micro_batch_size=micro_batch_size, config=config,
                                    rank=pp_rank, model_type=model_type, decoder_seq_length=decoder_seq_length,
                                    tp_group=groups.tp, cp_group=groups.cp)

    total_num_tokens = _zero_tokens()

    def fwd(input_tensor):
        output_tensor, num_tokens = forward_step(forward_step_func, data_iterator, model, num_microbatches,
                                                 input_tensor, forward_data_store, config, pipe.cp_size,
                                                 collect_non_loss_data, is_last_stage=last, after_split=after_split)
        total_num_tokens.add_(num_tokens.to(total_num_tokens.device))
        return output_tensor

    def bwd(input_tensor, output_tensor, output_tensor_grad):
        return backward_step(input_tensor, output_tensor, output_tensor_grad, model_type, config, after_split)

    forward_data_store = []
    input_tensors, output_tensors = [], []

    for _ in range(num_warmup):
        input_tensor = p2p.recv_forward(recv_shapes, first)
        output_tensor = fwd(input_tensor)
        p2p.send_forward(output_tensor, last)
        if not forward_only:
            input_tensors.append(input_tensor)
            output_tensors.append(output_tensor)
            deallocate_output_tensor(output_tensor[0], config.deallocate_pipeline_outputs)

    input_tensor = p2p.recv_forward(recv_shapes, first) if num_remaining > 0 else None

    for i in range(num_remaining):
        last_iteration = i == num_remaining - 1
        output_tensor = fwd(input_tensor)
        if forward_only:
            p2p.send_forward(output_tensor, last)
            if not last_iteration:
                input_tensor = p2p.recv_forward(recv_shapes, first)
            continue

        output_tensor_grad = p2p.send_forward_recv_backward(output_tensor, send_shapes, last)
        input_tensors.append(input_tensor)
        output_tensors.append(output_tensor)
        deallocate_output_tensor(output_tensor[0], config.deallocate_pipeline_outputs)

        input_tensor, output_tensor = input_tensors.pop(0), output_tensors.pop(0)
        if num_warmup == 0 and last_iteration:
            grad_sync.enable()
        input_tensor_grad = bwd(input_tensor, output_tensor, output_tensor_grad)
        if last_iteration:
            input_tensor = None
            p2p.send_backward(input_tensor_grad, first)
        else:
            input_tensor = p2p.send_backward_recv_forward(input_tensor_grad, recv_shapes, first)

    if not forward_only:
        for i in range(num_warmup):
            if i == num_warmup - 1:
                grad_sync.enable()
            input_tensor, output_tensor = input_tensors.pop(0), output_tensors.pop(0)
            output_tensor_grad = p2p.recv_backward(send_shapes, last)
            input_tensor_grad = bwd(input_tensor, output_tensor, output_tensor_grad)
            p2p.send_backward(input_tensor_grad, first)
    grad_sync.enable()
    _finalize(config, [model], forward_only, total_num_tokens, pg_collection, force_all_reduce)
    return forward_data_store


def get_schedule_table(num_microbatches: int, num_model_chunks: int,
                       microbatch_group_size_per_vp_stage: int) -> List[Tuple[int, int]]:
    """The interleaved schedule's order of ``(micro-batch, model chunk)`` forward passes (backward passes run the
    chunks in reverse): the micro-batches go in groups of ``microbatch_group_size_per_vp_stage`` (the last group
    takes what is left); each group runs through chunk 0, then chunk 1, ... E.g. 4 micro-batches, 2 chunks, groups
    of 2: (0,0) (1,0) (0,1) (1,1) (2,0) (3,0) (2,1) (3,1)."""
    table = []
    for start in range(0, num_microbatches, microbatch_group_size_per_vp_stage):
        group = range(start, min(start + microbatch_group_size_per_vp_stage, num_microbatches))
        table.extend((mb, chunk) for chunk in range(num_model_chunks) for mb in group)
    return table


def check_first_val_step(first_val_step, forward_only, cond):
    """``cond``, and with ``first_val_step`` given on a forward-only pass, also ``first_val_step``."""
    if first_val_step is not None and forward_only:
        return first_val_step and cond
    return cond


def forward_backward_pipelining_with_interleaving(
        *, forward_step_func, data_iterator: List[Iterator], model: List[torch.nn.Module], num_microbatches: int,
        seq_length: int, micro_batch_size: int, decoder_seq_length: Optional[int] = None,
        forward_only: bool = False, collect_non_loss_data: bool = False, first_val_step: Optional[bool] = None,
        adjust_tensor_shapes_fn=None, p2p_communicator: Optional[P2PCommunicator] = None, pg_collection=None,
        force_all_reduce: bool = False):
    """Interleaved 1F1B over ``len(model)`` virtual stages per rank (see module docstring)."""
    _refuse_shape_hook(adjust_tensor_shapes_fn, "forward_backward_pipelining_with_interleaving")
    if not isinstance(model, list) or not isinstance(data_iterator, list):
        raise RuntimeError("the interleaved schedule needs a list of model chunks and a list of data iterators")
    if len(model) != len(data_iterator):
        raise RuntimeError(f"{len(model)} model chunks but {len(data_iterator)} data iterators")
    config = get_model_config(model[0])
    model_type = _check_model_type(model[0], interleaved=True)
    # megatron-core's combined 1F1B (EP all-to-all overlap): every step through combined_1f1b's merged step.
    combined = config.overlap_moe_expert_parallel_comm and not forward_only
    # Gradient reduction stays off until each chunk's own last backward pass (one toggle per chunk), or
    # until the step's last backward pass when the caller gave a single no_sync_func.
    if config.no_sync_func is not None:
        toggles = [_GradSyncToggle(config.no_sync_func)]
    else:
        toggles = [_GradSyncToggle(_no_sync_func(config, chunk)) for chunk in model]
    for toggle in toggles:
        toggle.disable()
    backward_counts = [0] * len(model)

    pipe = _Pipeline(config, p2p_communicator, pg_collection)
    p2p, pp_size, pp_rank = pipe.p2p, pipe.pp_size, pipe.pp_rank
    num_chunks = len(model)
    if num_microbatches % pp_size != 0:
        raise RuntimeError(
            f"number of microbatches ({num_microbatches}) is not divisible by pipeline-model-parallel-size "
            f"({pp_size}) when using interleaved schedule"
        )
    total = num_microbatches * num_chunks
    all_warmup = False
    if forward_only:
        num_warmup = total
    elif num_microbatches == pp_size:
        num_warmup, all_warmup = total, True
    else:
        num_warmup = min((pp_size - pp_rank - 1) * 2 + (num_chunks - 1) * pp_size, total)
    num_remaining = total - num_warmup
    (shape,) = get_tensor_shapes(seq_length=seq_length, micro_batch_size=micro_batch_size, config=config,
                                 tp_group=pg_group(pg_collection, "tp"), cp_group=pg_group(pg_collection, "cp"))

    input_tensors = [[] for _ in range(num_chunks)]
    output_tensors = [[] for _ in range(num_chunks)]
    output_tensor_grads = [[] for _ in range(num_chunks)]
    forward_data_store = []
    total_num_tokens = _zero_tokens()

    table = get_schedule_table(num_microbatches, num_chunks, pp_size)

    def chunk_id(k, forward):
        c = table[k % total][1]
        return c if forward else num_chunks - c - 1

    def set_chunk(c):
        parallel_state.set_virtual_pipeline_model_parallel_rank(c)

    # Aligned parameter all-gathers (--overlap-param-gather with --align-param-gather): chunk 0's start with the
    # step, chunk c + 1's when chunk c runs its first micro-batch; the forward pre-hooks then only wait.
    param_sync_func = config.param_sync_func if isinstance(config.param_sync_func, list) else None
    if param_sync_func is not None and not forward_only:
        param_sync_func[0]()

    def forward_pre(k):
        c = chunk_id(k, forward=True)
        set_chunk(c)
        if param_sync_func is not None and not forward_only and k == c * pp_size and c + 1 < num_chunks:
            param_sync_func[c + 1]()
        if pipe.first() and len(input_tensors[c]) == len(output_tensors[c]):
            input_tensors[c].append(None)
        return c, input_tensors[c][-1]

    def forward_post(c, output_tensor, num_tokens):
        total_num_tokens.add_(num_tokens.to(total_num_tokens.device))
        output_tensors[c].append(output_tensor)
        if forward_only:
            input_tensors[c].pop()
            output_tensors[c].pop()

    def forward_helper(k):
        c, input_tensor = forward_pre(k)
        output_tensor, num_tokens = forward_step(forward_step_func, data_iterator[c], model[c], num_microbatches,
                                                 input_tensor, forward_data_store, config, pipe.cp_size,
                                                 collect_non_loss_data, is_last_stage=pipe.last(), after_split=False)
        forward_post(c, output_tensor, num_tokens)
        return output_tensor

    def backward_pre(k):
        c = chunk_id(k, forward=False)
        set_chunk(c)
        if pipe.last() and len(output_tensor_grads[c]) == 0:
            output_tensor_grads[c].append(None)
        backward_counts[c] += 1
        if len(toggles) > 1 and backward_counts[c] == num_microbatches:
            toggles[c].enable()  # this chunk's last backward: let its DDP reduce gradients
        elif len(toggles) == 1 and k == total - 1:
            toggles[0].enable()
        return input_tensors[c].pop(0), output_tensors[c].pop(0), output_tensor_grads[c].pop(0)

    def backward_helper(k):
        return backward_step(*backward_pre(k), model_type, config, after_split=False)

    if combined:  # megatron-core's merged steps: forward of virtual micro-batch f with backward of b
        from megatron.core.pipeline_parallel.combined_1f1b import combined_1f1b_schedule_for_interleaved_pipelining

        def merged_step(f, b):
            return combined_1f1b_schedule_for_interleaved_pipelining(
                config, forward_step_func, data_iterator, model, num_microbatches, forward_data_store,
                lambda vmb, c, mb: forward_pre(vmb)[1], forward_post, lambda vmb, c: backward_pre(vmb),
                lambda vmb: None, lambda vmb, forward: table[vmb % total][0], chunk_id,
                functools.partial(check_first_val_step, first_val_step, forward_only),
                lambda vmb: table[vmb % total][0] == 0, collect_non_loss_data,
                f_virtual_microbatch_id=f, b_virtual_microbatch_id=b)

        forward_helper = lambda k: merged_step(k, None)[0]  # noqa: E731
        backward_helper = lambda k: merged_step(None, k)[1]  # noqa: E731

    # Warm-up: forward passes only.
    set_chunk(0)
    input_tensors[0].append(p2p.recv_forward(shape, pipe.first()))
    for k in range(num_warmup):
        output_tensor = forward_helper(k)
        next_c = chunk_id(k + 1, forward=True)
        recv_prev = not (pipe.first(ignore_virtual=True) and next_c == 0)
        if k == total - 1:
            recv_prev = False
        if pipe.last():
            output_tensor = None
        if k == num_warmup - 1 and not forward_only and not all_warmup:
            recv_next = not pipe.last(ignore_virtual=True)
            input_tensor, output_tensor_grad = p2p.send_forward_backward_recv_forward_backward(
                output_tensor, None, recv_prev=recv_prev, recv_next=recv_next, tensor_shape=shape)
            output_tensor_grads[num_chunks - 1].append(output_tensor_grad)
        else:
            input_tensor = p2p.send_forward_recv_forward(output_tensor, recv_prev=recv_prev, tensor_shape=shape)
        input_tensors[next_c].append(input_tensor)
        deallocate_output_tensor(output_tensor, config.deallocate_pipeline_outputs)

    # Steady state: one forward and one backward per step.
    for k in range(num_remaining):
        forward_k = k + num_warmup
        if combined:
            output_tensor, input_tensor_grad = merged_step(forward_k, k)
        else:
            output_tensor = forward_helper(forward_k)
            input_tensor_grad = backward_helper(k)

        set_chunk(chunk_id(forward_k, forward=True))
        if pipe.last():
            output_tensor = None
        set_chunk(chunk_id(k, forward=False))
        if pipe.first():
            input_tensor_grad = None

        # The first rank runs p - 1 forward steps ahead of the last rank (and vice versa for backward),
        # so the chunk that the next received tensor belongs to is computed from that lag.
        recv_prev = True
        if pipe.first(ignore_virtual=True):
            next_forward_c = chunk_id(forward_k - (pp_size - 1), forward=True)
            if next_forward_c == num_chunks - 1:
                recv_prev = False
            next_forward_c += 1
        else:
            next_forward_c = chunk_id(forward_k + 1, forward=True)
        recv_next = True
        if pipe.last(ignore_virtual=True):
            next_backward_c = chunk_id(k - (pp_size - 1), forward=False)
            if next_backward_c == 0:
                recv_next = False
            next_backward_c -= 1
        else:
            next_backward_c = chunk_id(k + 1, forward=False)
        if k == num_remaining - 1:
            recv_prev = False

        input_tensor, output_tensor_grad = p2p.send_forward_backward_recv_forward_backward(
            output_tensor, input_tensor_grad, recv_prev=recv_prev, recv_next=recv_next, tensor_shape=shape)
        deallocate_output_tensor(output_tensor, config.deallocate_pipeline_outputs)
        if recv_prev:
            input_tensors[next_forward_c].append(input_tensor)
        if recv_next:
            output_tensor_grads[next_backward_c].append(output_tensor_grad)

    # Cool-down: the remaining backward passes.
    if not forward_only:
        if all_warmup:
            output_tensor_grads[num_chunks - 1].append(p2p.recv_backward(shape, pipe.last()))
        for k in range(num_remaining, total):
            input_tensor_grad = backward_helper(k)
            next_c = chunk_id(k + 1, forward=False)
            recv_next = not (pipe.last(ignore_virtual=True) and next_c == num_chunks - 1)
            if k == total - 1:
                recv_next = False
            output_tensor_grads[next_c].append(p2p.send_backward_recv_backward(
                input_tensor_grad, recv_next=recv_next, tensor_shape=shape))
    for toggle in toggles:
        toggle.enable()
    set_chunk(0)
    _finalize(config, model, forward_only, total_num_tokens, pg_collection, force_all_reduce)
    return forward_data_store
