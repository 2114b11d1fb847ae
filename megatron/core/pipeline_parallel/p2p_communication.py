"""Point-to-point communication between pipeline stages (megatron.core.pipeline_parallel.p2p_communication).

Stage ``i`` sends activations to stage ``i+1`` and receives activation gradients back from it. Every
exchange is one call to :meth:`P2PCommunicator._communicate`, which posts all of its sends and receives together
(``batch_isend_irecv`` by default) so that two neighbours that send to each other at the same time cannot
deadlock: with NCCL a lone send blocks until its receive is posted. ``P2PCommunicator(pp_group, config)``
(megatron-core's class) talks over an explicit pipeline group: its peers are the global ranks of the previous and
next members of ``pp_group`` (wrapping around). The module-level functions (the 2023 API) are the same exchanges
over parallel_state's pipeline group, with the first / last stage taken from parallel_state.

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


def is_single_shape(x) -> bool:
    """True for one shape (a tuple / list / Size of ints), False for a list of shapes."""
    if isinstance(x, torch.Size):
        return True
    return isinstance(x, (list, tuple)) and all(isinstance(d, int) for d in x)


class P2PCommunicator:
    """megatron-core's ``P2PCommunicator(pp_group, config)``: the pipeline exchanges over ``pp_group``.

    ``recv_forward(tensor_shapes, is_first_stage)``, ``recv_backward(tensor_shapes, is_last_stage)``,
    ``send_forward(output_tensors, is_last_stage)``, ``send_backward(input_tensor_grads, is_first_stage)``,
    ``send_forward_recv_backward(output_tensors, tensor_shapes, is_last_stage)``,
    ``send_backward_recv_forward(input_tensor_grads, tensor_shapes, is_first_stage)`` take one tensor / shape or
    lists of them (one exchange each, in order) and do nothing at the stage that has no peer in that direction;
    ``send_forward_recv_forward``, ``send_backward_recv_backward`` and
    ``send_forward_backward_recv_forward_backward`` (the interleaved schedule's) always communicate.
    """

    def __init__(self, pp_group, config: ModelParallelConfig):
        self.pp_group = pp_group
        self.config = config
        size = torch.distributed.get_world_size(group=pp_group)
        rank = torch.distributed.get_rank(group=pp_group)
        self.pp_rank, self.pp_size = rank, size
        self.next_rank = torch.distributed.get_global_rank(pp_group, (rank + 1) % size)
        self.prev_rank = torch.distributed.get_global_rank(pp_group, (rank - 1) % size)
        self.virtual_pipeline_model_parallel_size = config.virtual_pipeline_model_parallel_size

    # ----------------------------------------------------------------------------------------- core
    def _ordered_ops(self, tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next):
        """The op list, in a fixed order; when not batching, odd stages post receives first."""
        isend, irecv = torch.distributed.isend, torch.distributed.irecv
        ops = ([(isend, tensor_send_prev, self.prev_rank)] if tensor_send_prev is not None else []) + \
              ([(irecv, tensor_recv_prev, self.prev_rank)] if tensor_recv_prev is not None else []) + \
              ([(isend, tensor_send_next, self.next_rank)] if tensor_send_next is not None else []) + \
              ([(irecv, tensor_recv_next, self.next_rank)] if tensor_recv_next is not None else [])
        if not self.config.batch_p2p_comm and self.pp_rank % 2 == 1:
            # Unbatched: odd stages receive first, even stages send first, so blocking transports pair up.
            ops = [o for o in ops if o[0] is irecv] + [o for o in ops if o[0] is isend]
        return ops

    def _communicate_shapes(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next):
        """Exchange the shapes of the tensors about to be sent (only with variable sequence lengths)."""
        dev = device.current_device()

        def shape_of(t):
            return torch.tensor(list(t.size()) + [0] * (3 - t.dim()), dtype=torch.int64, device=dev)

        recv_prev_shape = torch.empty(3, dtype=torch.int64, device=dev) if recv_prev else None
        recv_next_shape = torch.empty(3, dtype=torch.int64, device=dev) if recv_next else None
        ops = self._ordered_ops(shape_of(tensor_send_prev) if tensor_send_prev is not None else None, recv_prev_shape,
                                shape_of(tensor_send_next) if tensor_send_next is not None else None, recv_next_shape)
        for req in _p2p_ops(ops, self.pp_group, self.config.batch_p2p_comm):
            req.wait()

        def to_shape(t):
            return [int(x) for x in t.tolist() if x > 0] if t is not None else None

        return to_shape(recv_prev_shape), to_shape(recv_next_shape)

    def _communicate(self, *, tensor_send_next: Optional[torch.Tensor], tensor_send_prev: Optional[torch.Tensor],
                     recv_prev: bool, recv_next: bool, tensor_shape: Shape, wait_on_reqs: bool = True):
        """Send and receive in both directions at once; returns ``(recv_prev_tensor, recv_next_tensor, reqs)``."""
        config = self.config
        if config.pipeline_dtype is None:
            raise RuntimeError("pipeline_dtype must be set in the model config to communicate between pipeline "
                               "stages")
        recv_prev_shape = recv_next_shape = tensor_shape
        if config.variable_seq_lengths:
            recv_prev_shape, recv_next_shape = self._communicate_shapes(tensor_send_next, tensor_send_prev,
                                                                        recv_prev, recv_next)
        dev = device.current_device()

        def empty(shape):
            return torch.empty(tuple(shape), requires_grad=True, device=dev, dtype=config.pipeline_dtype)

        tensor_recv_prev = empty(recv_prev_shape) if recv_prev else None
        tensor_recv_next = empty(recv_next_shape) if recv_next else None
        if tensor_send_next is not None:
            tensor_send_next = tensor_send_next.contiguous()
        if tensor_send_prev is not None:
            tensor_send_prev = tensor_send_prev.contiguous()
        ops = self._ordered_ops(tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next)
        reqs = _p2p_ops(ops, self.pp_group, config.batch_p2p_comm)
        if wait_on_reqs:
            for req in reqs:
                req.wait()
            reqs = None
        return tensor_recv_prev, tensor_recv_next, reqs

    def _each(self, tensors, shapes, skip: bool, timer: str, **directions):
        """One exchange per (tensor, shape) pair; ``directions`` name which received tensor to return."""
        single = not isinstance(tensors, list) if tensors is not None else is_single_shape(shapes)
        if tensors is None:
            shapes = [shapes] if single else shapes
            tensors = [None] * len(shapes)
        else:
            tensors = [tensors] if single else tensors
            shapes = [None] * len(tensors) if shapes is None else ([shapes] if is_single_shape(shapes) else shapes)
        out = []
        for tensor, shape in zip(tensors, shapes):
            if skip:
                out.append(None)
                continue
            with _timed(self.config, timer):
                prev, nxt, _ = self._communicate(
                    tensor_send_next=tensor if directions.get("send") == "next" else None,
                    tensor_send_prev=tensor if directions.get("send") == "prev" else None,
                    recv_prev=directions.get("recv") == "prev", recv_next=directions.get("recv") == "next",
                    tensor_shape=shape)
            out.append(prev if directions.get("recv") == "prev" else nxt)
        return out[0] if single else out

    # --------------------------------------------------------------------------------- the exchanges
    def recv_forward(self, tensor_shapes, is_first_stage: bool):
        """The activation(s) from the previous stage (None on the first stage)."""
        return self._each(None, tensor_shapes, is_first_stage, "forward-recv", recv="prev")

    def recv_backward(self, tensor_shapes, is_last_stage: bool):
        """The output gradient(s) from the next stage (None on the last stage)."""
        return self._each(None, tensor_shapes, is_last_stage, "backward-recv", recv="next")

    def send_forward(self, output_tensors, is_last_stage: bool) -> None:
        """Send the activation(s) to the next stage (nothing on the last stage)."""
        self._each(output_tensors, None, is_last_stage, "forward-send", send="next")

    def send_backward(self, input_tensor_grads, is_first_stage: bool) -> None:
        """Send the input gradient(s) to the previous stage (nothing on the first stage)."""
        self._each(input_tensor_grads, None, is_first_stage, "backward-send", send="prev")

    def send_forward_recv_backward(self, output_tensors, tensor_shapes, is_last_stage: bool):
        """Send activation(s) downstream and receive their output gradient(s), one batch each."""
        return self._each(output_tensors, tensor_shapes, is_last_stage, "forward-send-backward-recv",
                          send="next", recv="next")

    def send_backward_recv_forward(self, input_tensor_grads, tensor_shapes, is_first_stage: bool):
        """Send input gradient(s) upstream and receive the next activation(s), one batch each."""
        return self._each(input_tensor_grads, tensor_shapes, is_first_stage, "backward-send-forward-recv",
                          send="prev", recv="prev")

    def send_forward_recv_forward(self, output_tensor, recv_prev: bool, tensor_shape: Shape,
                                  overlap_p2p_comm: bool = False):
        """Send an activation downstream and receive one from upstream (interleaved schedule)."""
        with _timed(self.config, "forward-send-forward-recv"):
            tensor, _, reqs = self._communicate(tensor_send_next=output_tensor, tensor_send_prev=None,
                                                recv_prev=recv_prev, recv_next=False, tensor_shape=tensor_shape,
                                                wait_on_reqs=not overlap_p2p_comm)
        return (tensor, reqs) if overlap_p2p_comm else tensor

    def send_backward_recv_backward(self, input_tensor_grad, recv_next: bool, tensor_shape: Shape,
                                    overlap_p2p_comm: bool = False):
        """Send a gradient upstream and receive one from downstream (interleaved schedule)."""
        with _timed(self.config, "backward-send-backward-recv"):
            _, tensor, reqs = self._communicate(tensor_send_next=None, tensor_send_prev=input_tensor_grad,
                                                recv_prev=False, recv_next=recv_next, tensor_shape=tensor_shape,
                                                wait_on_reqs=not overlap_p2p_comm)
        return (tensor, reqs) if overlap_p2p_comm else tensor

    def send_forward_backward_recv_forward_backward(self, output_tensor, input_tensor_grad, recv_prev: bool,
                                                    recv_next: bool, tensor_shape: Shape):
        """All four directions at once (steady state of the interleaved schedule)."""
        with _timed(self.config, "forward-backward-send-forward-backward-recv"):
            input_tensor, output_tensor_grad, _ = self._communicate(
                tensor_send_next=output_tensor, tensor_send_prev=input_tensor_grad, recv_prev=recv_prev,
                recv_next=recv_next, tensor_shape=tensor_shape)
        return input_tensor, output_tensor_grad


def _mpu(config) -> P2PCommunicator:
    """A communicator over parallel_state's pipeline group (the module-level 2023 API)."""
    return P2PCommunicator(parallel_state.get_pipeline_model_parallel_group(), config)


# The 2023 module-level API: the same exchanges over parallel_state's pipeline group.
def recv_forward(tensor_shape: Shape, config: ModelParallelConfig) -> Optional[torch.Tensor]:
    """Receive the activation from the previous stage (None on the first stage)."""
    if parallel_state.is_pipeline_first_stage():
        return None
    return _mpu(config).recv_forward(tensor_shape, False)


def recv_backward(tensor_shape: Shape, config: ModelParallelConfig) -> Optional[torch.Tensor]:
    """Receive the output gradient from the next stage (None on the last stage)."""
    if parallel_state.is_pipeline_last_stage():
        return None
    return _mpu(config).recv_backward(tensor_shape, False)


def send_forward(output_tensor: torch.Tensor, config: ModelParallelConfig) -> None:
    """Send the activation to the next stage (nothing on the last stage)."""
    if not parallel_state.is_pipeline_last_stage():
        _mpu(config).send_forward(output_tensor, False)


def send_backward(input_tensor_grad: torch.Tensor, config: ModelParallelConfig) -> None:
    """Send the input gradient to the previous stage (nothing on the first stage)."""
    if not parallel_state.is_pipeline_first_stage():
        _mpu(config).send_backward(input_tensor_grad, False)


def send_forward_recv_backward(output_tensor, tensor_shape: Shape, config: ModelParallelConfig):
    """Send the activation to the next stage and receive its output gradient, in one batch."""
    if parallel_state.is_pipeline_last_stage():
        return None
    return _mpu(config).send_forward_recv_backward(output_tensor, tensor_shape, False)


def send_backward_recv_forward(input_tensor_grad, tensor_shape: Shape, config: ModelParallelConfig):
    """Send the input gradient to the previous stage and receive its next activation, in one batch."""
    if parallel_state.is_pipeline_first_stage():
        return None
    return _mpu(config).send_backward_recv_forward(input_tensor_grad, tensor_shape, False)


def send_forward_recv_forward(output_tensor, recv_prev: bool, tensor_shape: Shape, config: ModelParallelConfig,
                              overlap_p2p_comm: bool = False):
    """Send an activation downstream and receive one from upstream (interleaved schedule)."""
    return _mpu(config).send_forward_recv_forward(output_tensor, recv_prev, tensor_shape, overlap_p2p_comm)


def send_backward_recv_backward(input_tensor_grad, recv_next: bool, tensor_shape: Shape,
                                config: ModelParallelConfig, overlap_p2p_comm: bool = False):
    """Send a gradient upstream and receive one from downstream (interleaved schedule)."""
    return _mpu(config).send_backward_recv_backward(input_tensor_grad, recv_next, tensor_shape, overlap_p2p_comm)


def send_forward_backward_recv_forward_backward(output_tensor, input_tensor_grad, recv_prev: bool, recv_next: bool,
                                                tensor_shape: Shape, config: ModelParallelConfig):
    """All four directions at once (steady state of the interleaved schedule)."""
    return _mpu(config).send_forward_backward_recv_forward_backward(output_tensor, input_tensor_grad, recv_prev,
                                                                    recv_next, tensor_shape)
