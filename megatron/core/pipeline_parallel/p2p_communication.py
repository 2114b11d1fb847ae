"""Point-to-point communication between pipeline stages (megatron.core.pipeline_parallel.p2p_communication).

Stage ``i`` sends activations to stage ``i+1`` and receives activation gradients back from it. Every
helper below is one call to :func:`_communicate`, which posts all of its sends and receives together
(``batch_isend_irecv`` by default) so that two neighbours that send to each other at the same time cannot
deadlock: with NCCL a lone send blocks until its receive is posted. Peers are global ranks from
``parallel_state``; all ops run on the pipeline group.

Received tensors have shape ``tensor_shape`` (``(seq_length / tp if sequence_parallel else seq_length,
micro_batch_size, hidden_size)``) and dtype ``config.pipeline_dtype``, and require grad so that the stage
can backpropagate into them. With ``config.variable_seq_lengths`` the shapes are exchanged first.
"""
from __future__ import annotations

from typing import List, Optional, Tuple, Union

import torch

from megatron.core import device, parallel_state
from megatron.core.model_parallel_config import ModelParallelConfig

Shape = Union[List[int], torch.Size, Tuple[int, ...]]


def _p2p_ops(ops_spec, group, batch: bool):
    """Post isend/irecv ops; return the request handles."""
    if not ops_spec:
        return []
    if batch:
        ops = [torch.distributed.P2POp(op, tensor, peer, group) for op, tensor, peer in ops_spec]
        return torch.distributed.batch_isend_irecv(ops)
    return [op(tensor, peer, group=group) for op, tensor, peer in ops_spec]


def _ordered_ops(tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next):
    """The op list, in a fixed order; when not batching, odd stages post receives first."""
    prev_rank = parallel_state.get_pipeline_model_parallel_prev_rank()
    next_rank = parallel_state.get_pipeline_model_parallel_next_rank()
    isend, irecv = torch.distributed.isend, torch.distributed.irecv
    send_prev = [(isend, tensor_send_prev, prev_rank)] if tensor_send_prev is not None else []
    recv_prev = [(irecv, tensor_recv_prev, prev_rank)] if tensor_recv_prev is not None else []
    send_next = [(isend, tensor_send_next, next_rank)] if tensor_send_next is not None else []
    recv_next = [(irecv, tensor_recv_next, next_rank)] if tensor_recv_next is not None else []
    return send_prev + recv_prev + send_next + recv_next


def _communicate_shapes(tensor_send_next, tensor_send_prev, recv_prev, recv_next, config):
    """Exchange the shapes of the tensors about to be sent (only with variable sequence lengths)."""
    dev = device.current_device()

    def shape_of(t):
        return torch.tensor(list(t.size()) + [0] * (3 - t.dim()), dtype=torch.int64, device=dev)

    recv_prev_shape = torch.empty(3, dtype=torch.int64, device=dev) if recv_prev else None
    recv_next_shape = torch.empty(3, dtype=torch.int64, device=dev) if recv_next else None
    ops = _ordered_ops(shape_of(tensor_send_prev) if tensor_send_prev is not None else None, recv_prev_shape,
                       shape_of(tensor_send_next) if tensor_send_next is not None else None, recv_next_shape)
    for req in _p2p_ops(ops, parallel_state.get_pipeline_model_parallel_group(), config.batch_p2p_comm):
        req.wait()

    def to_shape(t):
        return [int(x) for x in t.tolist() if x > 0] if t is not None else None

    return to_shape(recv_prev_shape), to_shape(recv_next_shape)


def _communicate(*, tensor_send_next: Optional[torch.Tensor], tensor_send_prev: Optional[torch.Tensor],
                 recv_prev: bool, recv_next: bool, tensor_shape: Shape, config: ModelParallelConfig,
                 wait_on_reqs: bool = True):
    """Send and receive in both directions at once; returns ``(recv_prev_tensor, recv_next_tensor, reqs)``."""
    if config.pipeline_dtype is None:
        raise RuntimeError("pipeline_dtype must be set in the model config to communicate between pipeline stages")
    recv_prev_shape = recv_next_shape = tensor_shape
    if config.variable_seq_lengths:
        recv_prev_shape, recv_next_shape = _communicate_shapes(tensor_send_next, tensor_send_prev, recv_prev,
                                                               recv_next, config)
    dev = device.current_device()

    def empty(shape):
        return torch.empty(tuple(shape), requires_grad=True, device=dev, dtype=config.pipeline_dtype)

    tensor_recv_prev = empty(recv_prev_shape) if recv_prev else None
    tensor_recv_next = empty(recv_next_shape) if recv_next else None
    if tensor_send_next is not None:
        tensor_send_next = tensor_send_next.contiguous()
    if tensor_send_prev is not None:
        tensor_send_prev = tensor_send_prev.contiguous()

    ops = _ordered_ops(tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next)
    if not config.batch_p2p_comm and parallel_state.get_pipeline_model_parallel_rank() % 2 == 1:
        # Unbatched: odd stages receive first, even stages send first, so blocking transports pair up.
        ops = [o for o in ops if o[0] is torch.distributed.irecv] + [o for o in ops if o[0] is torch.distributed.isend]
    reqs = _p2p_ops(ops, parallel_state.get_pipeline_model_parallel_group(), config.batch_p2p_comm)
    if wait_on_reqs:
        for req in reqs:
            req.wait()
        reqs = None
    return tensor_recv_prev, tensor_recv_next, reqs


def _timed(config, name):
    class _Null:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    if config.timers is None:
        return _Null()

    class _Timer:
        def __enter__(self):
            config.timers(name, log_level=2).start()

        def __exit__(self, *exc):
            config.timers(name).stop()
            return False

    return _Timer()


def recv_forward(tensor_shape: Shape, config: ModelParallelConfig) -> Optional[torch.Tensor]:
    """Receive the activation from the previous stage (None on the first stage)."""
    if parallel_state.is_pipeline_first_stage():
        return None
    with _timed(config, "forward-recv"):
        tensor, _, _ = _communicate(tensor_send_next=None, tensor_send_prev=None, recv_prev=True, recv_next=False,
                                    tensor_shape=tensor_shape, config=config)
    return tensor


def recv_backward(tensor_shape: Shape, config: ModelParallelConfig) -> Optional[torch.Tensor]:
    """Receive the output gradient from the next stage (None on the last stage)."""
    if parallel_state.is_pipeline_last_stage():
        return None
    with _timed(config, "backward-recv"):
        _, tensor, _ = _communicate(tensor_send_next=None, tensor_send_prev=None, recv_prev=False, recv_next=True,
                                    tensor_shape=tensor_shape, config=config)
    return tensor


def send_forward(output_tensor: torch.Tensor, config: ModelParallelConfig) -> None:
    """Send the activation to the next stage (nothing on the last stage)."""
    if parallel_state.is_pipeline_last_stage():
        return
    with _timed(config, "forward-send"):
        _communicate(tensor_send_next=output_tensor, tensor_send_prev=None, recv_prev=False, recv_next=False,
                     tensor_shape=None, config=config)


def send_backward(input_tensor_grad: torch.Tensor, config: ModelParallelConfig) -> None:
    """Send the input gradient to the previous stage (nothing on the first stage)."""
    if parallel_state.is_pipeline_first_stage():
        return
    with _timed(config, "backward-send"):
        _communicate(tensor_send_next=None, tensor_send_prev=input_tensor_grad, recv_prev=False, recv_next=False,
                     tensor_shape=None, config=config)


def send_forward_recv_backward(output_tensor, tensor_shape: Shape, config: ModelParallelConfig):
    """Send the activation to the next stage and receive its output gradient, in one batch."""
    if parallel_state.is_pipeline_last_stage():
        return None
    with _timed(config, "forward-send-backward-recv"):
        _, tensor, _ = _communicate(tensor_send_next=output_tensor, tensor_send_prev=None, recv_prev=False,
                                    recv_next=True, tensor_shape=tensor_shape, config=config)
    return tensor


def send_backward_recv_forward(input_tensor_grad, tensor_shape: Shape, config: ModelParallelConfig):
    """Send the input gradient to the previous stage and receive its next activation, in one batch."""
    if parallel_state.is_pipeline_first_stage():
        return None
    with _timed(config, "backward-send-forward-recv"):
        tensor, _, _ = _communicate(tensor_send_next=None, tensor_send_prev=input_tensor_grad, recv_prev=True,
                                    recv_next=False, tensor_shape=tensor_shape, config=config)
    return tensor


def send_forward_recv_forward(output_tensor, recv_prev: bool, tensor_shape: Shape, config: ModelParallelConfig,
                              overlap_p2p_comm: bool = False):
    """Send an activation downstream and receive one from upstream (interleaved schedule)."""
    with _timed(config, "forward-send-forward-recv"):
        tensor, _, reqs = _communicate(tensor_send_next=output_tensor, tensor_send_prev=None, recv_prev=recv_prev,
                                       recv_next=False, tensor_shape=tensor_shape, config=config,
                                       wait_on_reqs=not overlap_p2p_comm)
    if overlap_p2p_comm:
        return tensor, reqs
    return tensor


def send_backward_recv_backward(input_tensor_grad, recv_next: bool, tensor_shape: Shape,
                                config: ModelParallelConfig, overlap_p2p_comm: bool = False):
    """Send a gradient upstream and receive one from downstream (interleaved schedule)."""
    with _timed(config, "backward-send-backward-recv"):
        _, tensor, reqs = _communicate(tensor_send_next=None, tensor_send_prev=input_tensor_grad, recv_prev=False,
                                       recv_next=recv_next, tensor_shape=tensor_shape, config=config,
                                       wait_on_reqs=not overlap_p2p_comm)
    if overlap_p2p_comm:
        return tensor, reqs
    return tensor


def send_forward_backward_recv_forward_backward(output_tensor, input_tensor_grad, recv_prev: bool, recv_next: bool,
                                                tensor_shape: Shape, config: ModelParallelConfig):
    """All four directions at once (steady state of the interleaved schedule)."""
    with _timed(config, "forward-backward-send-forward-backward-recv"):
        input_tensor, output_tensor_grad, _ = _communicate(
            tensor_send_next=output_tensor, tensor_send_prev=input_tensor_grad, recv_prev=recv_prev,
            recv_next=recv_next, tensor_shape=tensor_shape, config=config)
    return input_tensor, output_tensor_grad
