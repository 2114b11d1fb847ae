"""Pipeline-stage helpers over an explicit pipeline group (megatron-core's ``megatron.core.pipeline_parallel.utils``):
stage ``r`` of a group of ``p`` ranks is first when ``r == 0``, last when ``r == p - 1``; a virtual chunk
``v`` of ``vp_size`` is first / last when ``v == 0`` / ``v == vp_size - 1`` (always, without virtual stages)."""
from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import Callable, Optional

import torch


def is_pp_first_stage(pp_group) -> bool:
    return torch.distributed.get_rank(pp_group) == 0


def is_pp_last_stage(pp_group) -> bool:
    return torch.distributed.get_rank(pp_group) == torch.distributed.get_world_size(pp_group) - 1


def is_vp_first_stage(vp_stage: Optional[int], vp_size: Optional[int]) -> bool:
    if vp_size is None or vp_size <= 1:
        return True
    return vp_stage == 0


def is_vp_last_stage(vp_stage: Optional[int], vp_size: Optional[int]) -> bool:
    if vp_size is None or vp_size <= 1:
        return True
    return vp_stage == vp_size - 1


def get_pp_first_rank(pp_group) -> int:
    """Global rank of the first stage of ``pp_group``."""
    return torch.distributed.get_global_rank(pp_group, 0)


def get_pp_last_rank(pp_group) -> int:
    return torch.distributed.get_global_rank(pp_group, torch.distributed.get_world_size(pp_group) - 1)


def get_pp_next_rank(pp_group) -> Optional[int]:
    """Global rank of the next stage, None on the last stage."""
    if is_pp_last_stage(pp_group):
        return None
    return torch.distributed.get_global_rank(pp_group, torch.distributed.get_rank(pp_group) + 1)


def get_pp_prev_rank(pp_group) -> Optional[int]:
    """Global rank of the previous stage, None on the first stage."""
    if is_pp_first_stage(pp_group):
        return None
    return torch.distributed.get_global_rank(pp_group, torch.distributed.get_rank(pp_group) - 1)


def make_viewless(e):
    """A tensor that is not a view of another (its ``_base`` dropped), so a schedule can free it after sending."""
    from megatron.core.utils import make_viewless_tensor

    return make_viewless_tensor(e, requires_grad=e.requires_grad, keep_graph=True)


# ---------------------------------------------------------------------------------------------------------------
# Fine-grained schedule nodes (megatron-core's combined 1F1B, --overlap-moe-expert-parallel-comm).
#
# A model chunk's forward is cut into nodes f_1 ... f_n (pre-process, per layer attention / dispatch / experts /
# combine, post-process). Node k runs f_k on *detached* copies x_k' of its inputs (leaves that keep the inputs'
# requires_grad) and keeps its outputs y_k = f_k(x_k'); its backward is one autograd pass
#     d x_k' = (d y_k / d x_k')^T . g_k          (plus the parameters' gradients, accumulated as usual)
# from the given output gradients g_k, and returns the inputs' gradients d x_k' for node k-1. Chaining the nodes in
# reverse order is the chain rule through f_n o ... o f_1: the gradients of one autograd pass through the whole
# chunk (up to the order in which a tensor's gradient contributions are summed: rounding, ~1e-8 in fp32). What the cut buys on a GPU is freedom of order: the combined 1F1B schedule runs the forward nodes of
# one micro-batch between the backward nodes of another, each on its CUDA stream (computation vs. the MoE
# all-to-all), so communication hides behind computation. That overlap is a GPU-only performance matter: with
# ``stream=None`` (CPU, or the current stream) the nodes run in program order on one stream and compute the
# plain schedule's losses and (to rounding) its gradients.
# ---------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _on_stream(stream, event):
    """Run on ``stream`` (a CUDA stream) after ``event``, then record ``event``; nothing for ``stream=None``."""
    if stream is None:
        yield
        return
    if event is not None:
        event.wait(stream)
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        if event is not None:
            event.record(stream)


class NoopScheduleNode:
    """Stands in for a node that a layer lacks (a dense layer has no MoE dispatch / combine, a decoder layer no
    MTP post-process): ``forward(inputs) -> inputs``, ``backward(outgrads) -> outgrads``."""

    def forward(self, inputs):
        """The identity on the inputs."""
        return inputs

    def backward(self, outgrads):
        """The identity on the gradients."""
        return outgrads


class ScheduleNode:
    """One node of a fine-grained schedule (module comment above): ``forward(inputs)`` runs ``forward_func`` on
    detached copies of the inputs and keeps its outputs; ``backward(output_grad)`` runs ``backward_func(outputs,
    output_grad)`` (default: one autograd pass from the outputs, accumulating into ``.grad``) and returns the
    inputs' gradients (a tuple, or the tensor for one input), then drops the node's state (a node runs once).

    ``ScheduleNode(forward_func, stream, event, backward_func=None, free_input=False, name="schedule_node")``.
    ``stream`` / ``event``: the CUDA stream the node runs on and the event shared by the nodes of one micro-batch
    (ordering across streams); ``None`` runs on the current stream (CPU). ``free_input``: release the storage of
    the inputs after the forward (a memory saving for inputs no later step reads: MoE all-to-all buffers); an input
    whose storage is still held by an output, by a tensor handed on to a later node, or saved for the backward of
    this node is kept (with expert parallelism of one an all-to-all returns its input).
    """

    def __init__(self, forward_func: Callable, stream, event, backward_func: Optional[Callable] = None,
                 free_input: bool = False, name: str = "schedule_node"):
        self.name = name
        self.forward_func = forward_func
        self.backward_func = backward_func if backward_func else self.default_backward_func
        self.stream = stream
        self.event = event
        self.free_input = free_input
        self.inputs = None
        self.output = None
        self.delay_grads_release = False
        self.manual_release_grads = False

    def default_backward_func(self, outputs, output_grad):
        """One autograd pass from ``outputs`` with ``output_grad`` (gradients accumulate in the leaves, the graph
        is freed); an output that does not require grad, or has no gradient, is skipped. Returns ``output_grad``."""
        pairs = [(o, g) for o, g in zip(outputs, output_grad)
                 if torch.is_tensor(o) and o.requires_grad and g is not None]
        if pairs:
            # The engine itself, without the shape check: a pipeline schedule may have freed a sent output's data.
            torch.autograd.Variable._execution_engine.run_backward(
                tensors=tuple(o for o, _ in pairs), grad_tensors=tuple(g for _, g in pairs), keep_graph=False,
                create_graph=False, inputs=(), allow_unreachable=True, accumulate_grad=True)
        return output_grad

    def forward(self, inputs=()):
        """Run the node on ``inputs`` (a tensor or a tuple); returns its output (kept for the backward)."""
        if not isinstance(inputs, tuple):
            inputs = (inputs,)
        return self._forward(*inputs)

    def _forward(self, *inputs):
        saved = set()
        with _on_stream(self.stream, self.event):
            self.inputs = [None if e is None else make_viewless(e).detach() for e in inputs]
            for leaf, e in zip(self.inputs, inputs):
                if leaf is not None:
                    leaf.requires_grad = e.requires_grad
            if self.free_input:
                # Storages saved for this node's backward must outlive the forward.
                def pack(t):
                    saved.add(t.untyped_storage().data_ptr())
                    return t

                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    data = self.forward_func(*self.inputs)
            else:
                data = self.forward_func(*self.inputs)
            if isinstance(data, tuple):
                data = tuple(make_viewless(e) if torch.is_tensor(e) else e for e in data)
            elif torch.is_tensor(data):
                data = make_viewless(data)
            self.output = data
        if self.free_input:
            outs = data if isinstance(data, tuple) else (data,)
            kept = saved | {o.untyped_storage().data_ptr() for o in outs if torch.is_tensor(o)}
            kept |= {t.untyped_storage().data_ptr() for t in self._handed_on()}
            for e in inputs:
                if e is None or e.untyped_storage().data_ptr() in kept:
                    continue
                if e.is_cuda and self.stream is not None:
                    e.record_stream(self.stream)
                e.untyped_storage().resize_(0)
        return self.output

    def _handed_on(self):
        """Tensors of this forward that later nodes read other than through the outputs (their storage is kept)."""
        return ()

    def get_output(self):
        """The output of the last forward."""
        return self.output

    def backward(self, output_grad):
        """Backward from the gradients of the outputs (a tensor or a tuple, one per output); returns the inputs'
        gradients."""
        if not isinstance(output_grad, tuple):
            output_grad = (output_grad,)
        return self._backward(*output_grad)

    def _backward(self, *output_grad):
        with _on_stream(self.stream, self.event):
            outputs = self.output if isinstance(self.output, tuple) else (self.output,)
            if len(outputs) != len(output_grad):
                raise ValueError(f"schedule node {self.name!r}: {len(outputs)} outputs but {len(output_grad)} "
                                 "output gradients")
            output_grad = self.backward_func(outputs, output_grad)
        if output_grad and self.manual_release_grads and not self.delay_grads_release:
            for g in output_grad:
                if g is not None:
                    if g.is_cuda and self.stream is not None:
                        g.record_stream(self.stream)
                    g.untyped_storage().resize_(0)
        grads = self.get_grad()
        self._release_state()
        return grads

    def get_grad(self):
        """The inputs' gradients: a tuple, or the one tensor for a single input."""
        grad = tuple(None if e is None else e.grad for e in self.inputs)
        return grad[0] if len(grad) == 1 else grad

    def _release_state(self):
        """Drop the inputs, outputs and callables (a node runs forward and backward once)."""
        self.inputs = None
        self.output = None
        del self.forward_func
        del self.backward_func


class AbstractSchedulePlan(ABC):
    """The protocol between the combined 1F1B schedule and a model: a model that supports it implements
    ``build_schedule_plan`` with the arguments of its ``forward``, returning an instance of a subclass, whose
    ``run`` executes the forward of one plan and the backward of another (either may be None)."""

    @staticmethod
    @abstractmethod
    def run(f_schedule_plan, b_schedule_plan, grad=None, pre_forward=None, pre_backward=None, post_forward=None,
            post_backward=None):
        """Run ``f_schedule_plan``'s forward and ``b_schedule_plan``'s backward (from ``grad``); returns the
        forward output."""
