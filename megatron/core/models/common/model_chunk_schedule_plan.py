"""Schedule plans of a transformer model chunk for megatron-core's combined 1F1B schedule.

:class:`TransformerModelChunkSchedulePlan` holds one micro-batch's nodes of a chunk (``GPTModel.build_schedule_plan``):
``pre_process``, one :class:`TransformerLayerSchedulePlan` per layer (nodes ``attn``, ``moe_dispatch``, ``mlp``,
``moe_combine``, ``mtp_post_process``; a node a layer lacks is a
:class:`~megatron.core.pipeline_parallel.utils.NoopScheduleNode`) and ``post_process``. Its static ``run(f, b, ...)``
runs the forward of plan ``f`` (one micro-batch) and the backward of plan ``b`` (an earlier one) interleaved layer
by layer: forward layer ``i`` of ``f`` with backward layer ``n-1-i`` of ``b``; inside a layer pair
:meth:`TransformerLayerSchedulePlan.run` orders the nodes so that each all-to-all of one micro-batch sits next to
computation of the other::

    b: mtp_post_process, combine | f: attn | b: mlp | f: dispatch | b: dispatch (, attn) | f: mlp, combine, mtp
    | b: attn (then its delayed weight gradients)

Forward and backward are independent micro-batches, so any interleaving gives the numbers of running them one
after the other; on a GPU the nodes run on a computation and a communication stream (the overlap is a GPU-only
performance matter). Here the nodes run in this order on the current stream (``stream=None``, CPU): the losses
are the plain schedule's and the gradients equal its gradients to rounding.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Optional

import torch
from torch import Tensor

from megatron.core.pipeline_parallel.utils import AbstractSchedulePlan, NoopScheduleNode


class ModelChunkState:
    """Attributes shared by the nodes of one micro-batch's chunk: the ``forward`` arguments (``input_ids``,
    ``position_ids``, ``attention_mask``, ``labels``, ...), the model, and what the pre-process node computes
    (``decoder_input``, ``rotary_pos_emb``, ...)."""


class TransformerLayerSchedulePlan:
    """The nodes of one transformer layer (module docstring).

    ``TransformerLayerSchedulePlan(layer, event, chunk_state, comp_stream, comm_stream, extra_args={})``: ``event``
    and ``chunk_state`` are the chunk plan's; ``comp_stream`` runs ``attn`` / ``mlp`` / ``mtp_post_process``,
    ``comm_stream`` the dispatch and combine (None: the current stream); ``extra_args`` (``is_first_layer``,
    ``is_last_layer``) is completed with ``config``, ``is_moe``, ``delay_wgrad_compute``, ``is_mtp``.
    """

    attn = None
    moe_dispatch = None
    mlp = None
    moe_combine = None
    mtp_post_process = None

    def __init__(self, layer, event, chunk_state, comp_stream, comm_stream, extra_args={}):
        from megatron.core.models.gpt.fine_grained_callables import TransformerLayerState

        self.config = layer.config
        self.layer_state = TransformerLayerState()
        self.chunk_state = chunk_state
        self.layer = layer
        self.event = event
        self.comp_stream = comp_stream
        self.comm_stream = comm_stream
        self._build_callable_nodes(event, comp_stream, comm_stream, extra_args)

    def _build_callable_nodes(self, event, comp_stream, comm_stream, extra_args):
        from megatron.core.models.gpt.fine_grained_callables import TransformerLayerNode, build_layer_callables
        from megatron.core.transformer.moe.moe_layer import MoELayer
        from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer

        forward_funcs, dw_modules = build_layer_callables(self.layer)
        is_mtp = isinstance(self.layer, MultiTokenPredictionLayer)
        mlp = self.layer.transformer_layer.mlp if is_mtp else self.layer.mlp
        is_moe = isinstance(mlp, MoELayer)
        extra_args = dict(extra_args, config=self.layer.config, is_moe=is_moe, is_mtp=is_mtp,
                          delay_wgrad_compute=getattr(self.layer.config, "delay_wgrad_compute", False))
        attn, dispatch, experts, combine, mtp_post = forward_funcs

        def node(stream, func, name):
            return TransformerLayerNode(stream, event, self.layer_state, self.chunk_state, func, name=name,
                                        bwd_dw_callables=dw_modules.get(name), extra_args=extra_args)

        self.attn = node(comp_stream, attn, "attn")
        self.mlp = node(comp_stream, experts, "mlp")
        self.moe_dispatch = node(comm_stream, dispatch, "moe_dispatch") if is_moe else NoopScheduleNode()
        self.moe_combine = node(comm_stream, combine, "moe_combine") if is_moe else NoopScheduleNode()
        self.mtp_post_process = (node(comp_stream, mtp_post, "mtp_post_process") if is_mtp
                                 else NoopScheduleNode())

    def release_state(self):
        """Drop the nodes and the layer (the plan runs once)."""
        for name in ("attn", "moe_dispatch", "mlp", "moe_combine", "mtp_post_process", "layer_state"):
            if getattr(self, name, None) is not None:
                setattr(self, name, None)
        if hasattr(self, "layer"):
            del self.layer

    def get_fp8_context(self):
        """A null context: FP8 linear layers here take their recipe from the config themselves."""
        return nullcontext()

    @staticmethod
    def run(f_layer, b_layer, f_input=None, b_grad=None, is_last_layer_in_bwd=False):
        """Forward of ``f_layer`` from ``f_input`` and backward of ``b_layer`` from ``b_grad``, interleaved as in
        the module docstring (either layer may be None). Returns ``(forward output, input gradient)``; the weight
        gradients of ``b_layer``'s attention (when delayed) wait when ``is_last_layer_in_bwd``."""
        early_attn = b_layer is not None and getattr(b_layer.config, "ep_overlap_early_attn_memory_release", False)
        if b_layer is not None:
            b_grad = b_layer.mtp_post_process.backward(b_grad)
            b_grad = b_layer.moe_combine.backward(b_grad)
        if f_layer is not None:
            with f_layer.get_fp8_context():
                f_input = f_layer.attn.forward(f_input)
        if b_layer is not None:
            b_grad = b_layer.mlp.backward(b_grad)
        if f_layer is not None:
            with f_layer.get_fp8_context():
                f_input = f_layer.moe_dispatch.forward(f_input)
        if b_layer is not None:
            b_layer.mlp.backward_dw()
            b_grad = b_layer.moe_dispatch.backward(b_grad)
            if early_attn:
                b_grad = b_layer.attn.backward(b_grad)
        if f_layer is not None:
            with f_layer.get_fp8_context():
                f_input = f_layer.mlp.forward(f_input)
                f_input = f_layer.moe_combine.forward(f_input)
                f_input = f_layer.mtp_post_process.forward(f_input)
        if b_layer is not None and not early_attn:
            b_grad = b_layer.attn.backward(b_grad)
        if b_layer is not None and not is_last_layer_in_bwd:
            b_layer.attn.backward_dw()
        return f_input, b_grad


class TransformerModelChunkSchedulePlan(AbstractSchedulePlan):
    """One micro-batch's plan of a model chunk (module docstring).

    ``TransformerModelChunkSchedulePlan(model, input_ids, position_ids, attention_mask, decoder_input=None,
    labels=None, packed_seq_params=None, extra_block_kwargs=None, runtime_gather_output=None, loss_mask=None,
    padding_mask=None)``: the arguments of ``model.forward`` go to the chunk state; the decoder's layers, then the
    multi-token prediction depths, get a layer plan each.
    """

    def __init__(self, model, input_ids: Tensor, position_ids: Tensor, attention_mask: Tensor,
                 decoder_input: Tensor = None, labels: Tensor = None, packed_seq_params=None,
                 extra_block_kwargs=None, runtime_gather_output: Optional[bool] = None,
                 loss_mask: Optional[Tensor] = None, padding_mask=None):
        from megatron.core.models.gpt.fine_grained_callables import PostProcessNode, PreProcessNode

        if model.config.recompute_granularity == "full":
            raise NotImplementedError("the combined 1F1B schedule does not support full recompute "
                                      "(--recompute-granularity full)")
        self._model_chunk_state = ModelChunkState()
        self._transformer_layers = []
        # On a GPU an event orders the nodes of one micro-batch across streams; on one stream nothing is needed.
        self._event = torch.cuda.Event() if torch.cuda.is_available() else None
        self.pre_process = None
        self.post_process = None
        self.vp_stage = model.vp_stage
        comp_stream = comm_stream = None  # the current stream: nodes run in program order

        state = self._model_chunk_state
        for name, value in (("input_ids", input_ids), ("position_ids", position_ids),
                            ("attention_mask", attention_mask), ("decoder_input", decoder_input), ("labels", labels),
                            ("mtp_hidden_states", None), ("loss_mask", loss_mask),
                            ("packed_seq_params", packed_seq_params), ("padding_mask", padding_mask),
                            ("extra_block_kwargs", extra_block_kwargs),
                            ("runtime_gather_output", runtime_gather_output), ("model", model), ("context", None),
                            ("context_mask", None), ("attention_bias", None)):
            setattr(state, name, value)

        self.pre_process = PreProcessNode(model, state, self._event, comp_stream)
        self._build_layer_schedule_plan(model.decoder, comp_stream, comm_stream)
        self._build_layer_schedule_plan(getattr(model, "mtp", None), comp_stream, comm_stream)
        if model.post_process:
            self.post_process = PostProcessNode(model, state, self._event, comp_stream)

    def _build_layer_schedule_plan(self, module, comp_stream, comm_stream):
        if module is None:
            return
        n = len(module.layers)
        for i, layer in enumerate(module.layers):
            extra_args = {"is_first_layer": i == 0, "is_last_layer": i == n - 1}
            self._transformer_layers.append(
                TransformerLayerSchedulePlan(layer, self.event, self.state, comp_stream, comm_stream, extra_args))

    @property
    def event(self):
        """The event ordering this micro-batch's nodes across CUDA streams (None on CPU)."""
        return self._event

    def record_current_stream(self):
        """Record the event on the current CUDA stream (nothing on CPU)."""
        if self.event is not None:
            self.event.record(torch.cuda.current_stream())

    def wait_current_stream(self):
        """Make the current CUDA stream wait for the event (nothing on CPU)."""
        if self.event is not None:
            self.event.wait(torch.cuda.current_stream())

    def get_layer(self, i):
        """Layer plan ``i``."""
        if i >= self.num_layers():
            raise IndexError(f"layer {i} of a plan with {self.num_layers()} layers")
        return self._transformer_layers[i]

    def pop_layer(self):
        """Remove and return the last layer plan (the backward takes the layers last to first)."""
        return self._transformer_layers.pop()

    def num_layers(self):
        """The number of layer plans left."""
        return len(self._transformer_layers)

    @property
    def state(self):
        """The :class:`ModelChunkState`."""
        return self._model_chunk_state

    def release_state(self):
        """Drop the references to the model and the pre / post-process nodes."""
        self._model_chunk_state.model = None
        if self.pre_process is not None:
            self.pre_process.chunk_state = None
            self.pre_process = None
        if self.post_process is not None:
            self.post_process.chunk_state = None
            self.post_process = None

    @staticmethod
    def run(f_schedule_plan, b_schedule_plan, b_grad=None, pre_forward=None, pre_backward=None,
            post_forward=None, post_backward=None):
        """Forward of ``f_schedule_plan`` and backward of ``b_schedule_plan`` from ``b_grad`` (the gradient of its
        post-process output), either None. Order: ``pre_forward(vp_stage)``, forward pre-process;
        ``pre_backward(vp_stage)``, backward post-process; forward layer ``i`` with backward layer ``n-1-i``
        (:meth:`TransformerLayerSchedulePlan.run`), then the layers one side has more of; ``post_forward(output,
        vp_stage)``, ``post_backward(grad, vp_stage)`` (the pipeline's sends / receives); the first layer's delayed
        attention weight gradients; forward post-process; backward pre-process. Returns the forward output."""
        f_input = None
        if f_schedule_plan is not None:
            if pre_forward is not None:
                pre_forward(f_schedule_plan.vp_stage)
            f_schedule_plan.record_current_stream()
            f_input = f_schedule_plan.pre_process.forward()
        if b_schedule_plan is not None:
            b_schedule_plan.record_current_stream()
            if b_grad is None:
                raise ValueError("TransformerModelChunkSchedulePlan.run: a backward plan needs b_grad")
            if pre_backward is not None:
                pre_backward(b_schedule_plan.vp_stage)
                b_schedule_plan.record_current_stream()
            if b_schedule_plan.post_process is not None:
                b_grad = b_schedule_plan.post_process.backward(b_grad)

        f_layers = f_schedule_plan.num_layers() if f_schedule_plan is not None else 0
        b_layers = b_schedule_plan.num_layers() if b_schedule_plan is not None else 0
        both = min(f_layers, b_layers)
        b_layer = None
        for i in range(both):
            b_layer = b_schedule_plan.pop_layer()
            f_input, b_grad = TransformerLayerSchedulePlan.run(f_schedule_plan.get_layer(i), b_layer,
                                                               f_input=f_input, b_grad=b_grad,
                                                               is_last_layer_in_bwd=(i == b_layers - 1))
            if i < b_layers - 1:
                b_layer.release_state()
        for i in range(both, b_layers):
            b_layer = b_schedule_plan.pop_layer()
            _, b_grad = TransformerLayerSchedulePlan.run(None, b_layer, b_grad=b_grad,
                                                         is_last_layer_in_bwd=(i == b_layers - 1))
            if i < b_layers - 1:
                b_layer.release_state()
        for i in range(both, f_layers):
            f_input, _ = TransformerLayerSchedulePlan.run(f_schedule_plan.get_layer(i), None, f_input=f_input)

        if f_schedule_plan is not None and post_forward is not None:
            f_schedule_plan.wait_current_stream()
            post_forward(f_input, f_schedule_plan.vp_stage)
        if b_schedule_plan is not None and post_backward is not None:
            b_schedule_plan.wait_current_stream()
            post_backward(b_grad, b_schedule_plan.vp_stage)
        if b_layers > 0:
            b_layer.attn.backward_dw()  # the first layer's, delayed past the sends
            b_layer.release_state()

        if f_schedule_plan is not None and f_schedule_plan.post_process is not None:
            f_input = f_schedule_plan.post_process.forward(f_input)
        if b_schedule_plan is not None:
            b_schedule_plan.pre_process.backward(b_grad)

        if f_schedule_plan is not None:
            f_schedule_plan.wait_current_stream()
        if b_schedule_plan is not None:
            b_schedule_plan.wait_current_stream()
            b_schedule_plan.release_state()
        return f_input
