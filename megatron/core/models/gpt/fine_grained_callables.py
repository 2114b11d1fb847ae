"""The nodes of a GPT model chunk for megatron-core's combined 1F1B schedule (``--overlap-moe-expert-parallel-comm``).

A GPT chunk ``loss = post(L_n(... L_1(pre(x))))`` is cut into schedule nodes
(:class:`~megatron.core.pipeline_parallel.utils.ScheduleNode`): :class:`PreProcessNode` (embedding, rotary angles),
per transformer layer up to four :class:`TransformerLayerNode` s, and :class:`PostProcessNode` (output layer, loss).
For a layer ``L(x) = a + bda(combine(experts(dispatch(pre(norm(a))))) + shared(norm(a)), residual)`` with
``a = x + attn(norm(x))`` (the attention half) the MoE nodes are

* ``attn``: ``a``, ``norm(a)``, the shared experts, the router, the dispatcher's local permutation -> ``(tokens,
  probs)``; the residual and the shared experts' output are handed on through :class:`TransformerLayerState`;
* ``moe_dispatch``: the all-to-all (communication) -> tokens on the experts' ranks (their probabilities handed on);
* ``mlp``: the local experts -> their outputs;
* ``moe_combine``: the all-to-all back, un-permutation, + shared output, bias-dropout-add with the residual (and
  the decoder's final norm after the chunk's last layer).

A dense layer has ``attn`` (-> ``a``) and ``mlp`` (-> ``L(x)``). A tensor produced in one node and read in a later
one other than through the outputs (the residual, the shared experts' output, the dispatched probabilities) is
:meth:`TransformerLayerNode.detach` ed: the later node differentiates into the detached leaf, and the producing node's
backward runs from its outputs *and* those tensors with their accumulated gradients, so chaining the nodes'
backwards is the chain rule of the whole layer. On one stream (CPU) the nodes compute what ``GPTModel.forward``
computes and its gradients (to rounding: contributions to one tensor's gradient are summed in another order); on a GPU the schedule overlaps a micro-batch's all-to-all with another's computation.

A multi-token prediction depth is a layer of the plan too (:func:`build_mtp_layer_callables`): its ``attn`` node
embeds the rolled tokens and projects ``[enorm(e), hnorm(h)]`` before the transformer layer's attention, and its
``mtp_post_process`` node applies the depth's norm and hands ``[h_0, h_1]`` (concatenated along the sequence) to the
post-process node, which computes the MTP loss.
"""
from __future__ import annotations

import contextlib
import weakref

import torch

from megatron.core import tensor_parallel
from megatron.core.pipeline_parallel.utils import ScheduleNode, make_viewless
from megatron.core.transformer.module import float16_to_fp32
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.utils import internal_api, make_viewless_tensor


def weak_method(method):
    """A function calling ``method`` through a weak reference to its object (a node holding a bound method of
    itself would otherwise be a reference cycle kept alive until the garbage collector runs)."""
    ref = weakref.WeakMethod(method)
    del method

    def call(*args, **kwargs):
        return ref()(*args, **kwargs)

    return call


def _flex_backend(config):
    if getattr(config, "moe_token_dispatcher_type", None) != "flex":
        return None
    return getattr(config, "moe_flex_dispatcher_backend", None)


@internal_api
def should_free_input(name, is_moe, config):
    """Whether node ``name`` may release its inputs' storage after its forward: only in MoE layers, for the
    all-to-all buffers no later step reads: ``mlp`` (not with the HybridEP backend), ``moe_combine``, and
    ``moe_dispatch`` (not with DeepEP / HybridEP, whose backward reads them, nor with ``moe_preprocess`` in the
    CUDA-graph scope, whose buffers are static). Dense layers keep their inputs (the backward needs them). Here
    also never with the ``allgather`` dispatcher (its dispatch input is a view of the router's saved input; the
    combined schedule asks for ``alltoall`` / ``flex``)."""
    if not is_moe or getattr(config, "moe_token_dispatcher_type", None) == "allgather":
        return False
    backend = _flex_backend(config)
    scopes = {getattr(s, "name", s) for s in (getattr(config, "cuda_graph_scope", None) or ())}
    free = {"mlp": backend != "hybridep", "moe_combine": True,
            "moe_dispatch": backend not in ("deepep", "hybridep") and "moe_preprocess" not in scopes}
    return free.get(name, False)


class TransformerLayerState:
    """Attributes one node of a layer hands to a later node of the same layer (residual, shared experts' output,
    dispatched probabilities)."""


class PreProcessNode(ScheduleNode):
    """The chunk's first node: the embedding (first stage; else the received tensor) and the rotary angles
    (``GPTModel._preprocess``), kept on the chunk state for the layers. ``PreProcessNode(gpt_model, chunk_state,
    event, stream)``."""

    def __init__(self, gpt_model, chunk_state, event, stream):
        super().__init__(weak_method(self.forward_impl), stream, event, name="pre_process")
        self.gpt_model = gpt_model
        self.chunk_state = chunk_state

    def forward_impl(self):
        """Returns the decoder's input ``[s, b, h]``."""
        state, model = self.chunk_state, self.gpt_model
        if not model.pre_process:
            state.decoder_input = model.decoder.input_tensor
        (decoder_input, state.rotary_pos_emb, state.rotary_pos_cos, state.rotary_pos_sin,
         state.sequence_len_offset, state.padding_mask) = model._preprocess(
            input_ids=state.input_ids, position_ids=state.position_ids, decoder_input=state.decoder_input,
            packed_seq_params=state.packed_seq_params, padding_mask=state.padding_mask)
        # As TransformerBlock.forward: the decoder's input is a non-view tensor that requires grad.
        decoder_input = make_viewless_tensor(decoder_input, requires_grad=True, keep_graph=True)
        state.decoder_input = decoder_input
        return decoder_input


class PostProcessNode(ScheduleNode):
    """The chunk's last node (last stage): the multi-token prediction losses (the depths ran as layers of the
    plan), the output layer and the loss (``GPTModel._postprocess``), in fp32. ``PostProcessNode(gpt_model, chunk_state, event, stream)``."""

    def __init__(self, gpt_model, chunk_state, event, stream):
        super().__init__(weak_method(self.forward_impl), stream, event, name="post_process")
        self.gpt_model = gpt_model
        self.chunk_state = chunk_state

    def forward_impl(self, hidden_states):
        """Returns the logits, or the per-token loss with labels."""
        state, model = self.chunk_state, self.gpt_model
        decoder = model.decoder
        if len(decoder.layers) == 0 and _final_norm(decoder) is not None:
            hidden_states = make_viewless_tensor(_final_norm(decoder)(hidden_states), requires_grad=True,
                                                 keep_graph=True)
        out = model._postprocess(
            hidden_states=hidden_states, input_ids=state.input_ids, position_ids=state.position_ids,
            labels=state.labels, rotary_pos_emb=state.rotary_pos_emb, rotary_pos_cos=state.rotary_pos_cos,
            rotary_pos_sin=state.rotary_pos_sin, mtp_in_postprocess=False, loss_mask=state.loss_mask,
            decoder_input=state.decoder_input, attention_mask=state.attention_mask,
            packed_seq_params=state.packed_seq_params, sequence_len_offset=state.sequence_len_offset,
            runtime_gather_output=state.runtime_gather_output, extra_block_kwargs=state.extra_block_kwargs)
        return float16_to_fp32(out)


def _final_norm(decoder):
    """The decoder's final norm on this stage, or None."""
    if decoder.post_process and getattr(decoder, "post_layer_norm", False):
        return getattr(decoder, "final_layernorm", None)
    return None


class TransformerLayerNode(ScheduleNode):
    """One node of a transformer layer: ``submodule(node, *inputs)`` is its forward (a callable of
    :func:`build_transformer_layer_callables`).

    ``TransformerLayerNode(stream, event, layer_state, chunk_state, submodule, name="default",
    bwd_dw_callables=None, extra_args={})``; ``extra_args``: ``config`` (required), ``is_moe``,
    ``delay_wgrad_compute``, ``is_mtp``, ``is_first_layer``, ``is_last_layer``. ``name`` (attn / moe_dispatch / mlp
    / moe_combine / mtp_post_process) decides :func:`should_free_input`.
    """

    def __init__(self, stream, event, layer_state, chunk_state, submodule, name="default", bwd_dw_callables=None,
                 extra_args={}):
        config = extra_args.get("config")
        if config is None:
            raise ValueError("TransformerLayerNode needs the model config in extra_args['config']")
        is_moe = extra_args.get("is_moe", False)
        self.delay_wgrad_compute = extra_args.get("delay_wgrad_compute", False)
        super().__init__(weak_method(self.forward_impl), stream, event, weak_method(self.backward_impl),
                         free_input=should_free_input(name, is_moe, config), name=name)
        self.layer_state = layer_state
        self.chunk_state = chunk_state
        self.submodule = submodule
        self.detached = ()
        self.before_detached = ()
        self.is_mtp = extra_args.get("is_mtp", False)
        self.is_first_layer = extra_args.get("is_first_layer", False)
        self.is_last_layer = extra_args.get("is_last_layer", False)
        if bwd_dw_callables is None:
            bwd_dw_callables = []
        self.bwd_dw_callables = bwd_dw_callables if isinstance(bwd_dw_callables, list) else [bwd_dw_callables]

    def detach(self, t):
        """A detached leaf of ``t`` for a later node of the layer; ``t`` joins this node's backward with the
        gradient the leaf accumulates."""
        leaf = make_viewless(t).detach()
        leaf.requires_grad = t.requires_grad
        self.before_detached = self.before_detached + (t,)
        self.detached = self.detached + (leaf,)
        return leaf

    def _handed_on(self):
        return self.detached

    def forward_impl(self, *args):
        """The submodule callable on this node."""
        return self.submodule(self, *args)

    def backward_impl(self, outputs, output_grad):
        """One autograd pass from the outputs and the detached tensors (those that received a gradient)."""
        tensors, grads = list(outputs), list(output_grad)
        for t, leaf in zip(self.before_detached, self.detached):
            if leaf.grad is not None:
                tensors.append(t)
                grads.append(leaf.grad)
        self.default_backward_func(tuple(tensors), tuple(grads))
        if self.delay_wgrad_compute:
            self.output_grads = tuple(grads)
            self.delay_grads_release = len(self.bwd_dw_callables) > 0
        return tuple(grads)

    def backward_dw(self):
        """The delayed weight gradients (``delay_wgrad_compute``); nothing otherwise."""
        if not self.delay_wgrad_compute:
            return
        for module in self.bwd_dw_callables:
            module.backward_dw()
        self.output_grads = None
        self.bwd_dw_callables = None

    def __del__(self):
        self.before_detached = None
        self.detached = None
        self.layer_state = None
        self.chunk_state = None
        self.submodule = None


def _refuse_unsupported(layer):
    config = layer.config
    if getattr(config, "delay_wgrad_compute", False):
        raise NotImplementedError("delay_wgrad_compute (--delay-wgrad-compute) is not supported: the linear "
                                  "layers here compute weight gradients in their backward")
    if getattr(layer, "recompute_mlp", False) and isinstance(layer.mlp, MoELayer):
        raise NotImplementedError("the combined 1F1B schedule does not support recomputing the MoE layer "
                                  "(--recompute-modules moe); drop it or the EP overlap")


def build_transformer_layer_callables(layer: TransformerLayer):
    """The forward callables of a transformer layer's nodes, ``[attn, moe_dispatch, mlp, moe_combine, None]``
    (module docstring; a dense layer's dispatch / combine raise NotImplementedError), and the weight-gradient
    modules per node, ``{"attn": layer.self_attention, "mlp": layer.mlp}`` (used only with delayed weight
    gradients). Each callable takes the node first."""
    _refuse_unsupported(layer)
    is_moe = isinstance(layer.mlp, MoELayer)
    config = layer.config

    def rng():
        # As TransformerBlock.forward: with sequence parallelism each TP rank's dropout must differ.
        return tensor_parallel.get_cuda_rng_tracker().fork() if config.sequence_parallel else contextlib.nullcontext()

    def finish(node, hidden_states):
        hidden_states = make_viewless_tensor(hidden_states, requires_grad=hidden_states.requires_grad,
                                             keep_graph=True)
        norm = _final_norm(node.chunk_state.model.decoder)
        if node.is_last_layer and not node.is_mtp and norm is not None:
            hidden_states = make_viewless_tensor(norm(hidden_states), requires_grad=True, keep_graph=True)
        return hidden_states

    def attn_forward(node, hidden_states):
        state = node.chunk_state
        with rng():
            hidden_states, _ = layer._forward_attention(hidden_states, attention_mask=state.attention_mask,
                                                        rotary_pos_emb=state.rotary_pos_emb,
                                                        packed_seq_params=state.packed_seq_params)
            if not is_moe:
                return hidden_states
            moe = layer.mlp
            normed = layer._norm(layer.pre_mlp_layernorm, hidden_states)
            residual = normed if layer.apply_residual_connection_post_layernorm else hidden_states
            node.layer_state.residual = node.detach(residual)
            shared = moe.shared_experts_compute(normed)
            node.layer_state.shared_expert_output = None if shared is None else node.detach(shared)
            probs, routing_map = moe.route(normed)
            return moe.preprocess(normed, probs, routing_map)

    def dispatch_forward(node, tokens, probs):
        with rng():
            tokens, probs = layer.mlp.dispatch(tokens, probs)
        node.layer_state.dispatched_probs = node.detach(probs)
        return tokens

    def experts_forward(node, tokens):
        probs, node.layer_state.dispatched_probs = node.layer_state.dispatched_probs, None
        with rng():
            output, _ = layer.mlp.routed_experts_compute(tokens, probs)
        return output

    def combine_forward(node, output):
        state = node.layer_state
        with rng():
            output = layer.mlp.postprocess(layer.mlp.combine(output), state.shared_expert_output)
            hidden_states = layer._bias_dropout_add(output, None, state.residual, "mlp")
        state.residual = state.shared_expert_output = None
        return finish(node, hidden_states)

    def dense_mlp_forward(node, hidden_states):
        with rng():
            hidden_states = layer._forward_mlp(hidden_states)
        return finish(node, hidden_states)

    def not_in_dense_layer(*args):
        raise NotImplementedError("a dense layer has no MoE dispatch / combine node")

    forward_funcs = [attn_forward,
                     dispatch_forward if is_moe else not_in_dense_layer,
                     experts_forward if is_moe else dense_mlp_forward,
                     combine_forward if is_moe else not_in_dense_layer,
                     None]
    return forward_funcs, {"attn": layer.self_attention, "mlp": layer.mlp}


def build_mtp_layer_callables(layer):
    """The callables of a multi-token prediction depth ``k`` (one depth, as megatron-core's overlap asks):
    ``attn`` first (depth 1) keeps the decoder's output ``h_0`` on the chunk state, rolls the chunk's token and
    position ids left by one, embeds them and feeds ``eh_proj([enorm(e), hnorm(h_{k-1})])`` to its transformer
    layer's attention callable; dispatch / experts / combine are the transformer layer's (no final decoder norm);
    ``mtp_post_process`` applies the depth's final norm and, at the last depth, returns ``[h_0, h_1, ..., h_D]``
    concatenated along the sequence for ``GPTModel._postprocess``. Every callable runs under the depth's RNG
    context (the tracker's fork with sequence parallelism), as the MTP block does."""
    from megatron.core.transformer.multi_token_prediction import _cp_group, roll_tensor

    if layer.config.mtp_num_layers != 1:
        raise NotImplementedError("the combined 1F1B schedule supports one multi-token prediction layer "
                                  f"(mtp_num_layers=1), got {layer.config.mtp_num_layers}")
    forward_funcs, backward_dw = build_transformer_layer_callables(layer.transformer_layer)
    attn, dispatch, experts, combine, _ = forward_funcs
    cp_group = _cp_group(layer.pg_collection)

    def rng():
        return (tensor_parallel.get_cuda_rng_tracker().fork() if layer.config.sequence_parallel
                else contextlib.nullcontext())

    def mtp_attn_forward(node, hidden_states):
        state = node.chunk_state
        if state.packed_seq_params is not None:
            raise NotImplementedError("multi-token prediction with packed sequences (packed_seq_params) is not "
                                      "supported")
        if node.is_first_layer:
            state.mtp_hidden_states = [hidden_states]
        state.input_ids, _ = roll_tensor(state.input_ids, cp_group)
        state.position_ids, _ = roll_tensor(state.position_ids, cp_group)
        embedded = state.model.embedding(input_ids=state.input_ids, position_ids=state.position_ids)
        with rng():
            return attn(node, layer._concat_embeddings(hidden_states, embedded))

    def in_rng(func):
        def call(node, *args):
            with rng():
                return func(node, *args)

        return call

    def mtp_post_process_forward(node, hidden_states):
        state = node.chunk_state
        with rng():
            hidden_states = layer._postprocess(hidden_states)
        state.mtp_hidden_states.append(hidden_states)
        if node.is_last_layer:
            hidden_states = torch.cat(state.mtp_hidden_states, dim=0)
            state.mtp_hidden_states = None
        return hidden_states

    backward_dw["attn"] = [backward_dw["attn"], layer.eh_proj]
    return [mtp_attn_forward, in_rng(dispatch), in_rng(experts), in_rng(combine), mtp_post_process_forward], \
        backward_dw


def build_layer_callables(layer):
    """:func:`build_transformer_layer_callables` or :func:`build_mtp_layer_callables` by the layer's type
    (``(forward_funcs, backward_dw)``); ValueError for another layer type."""
    if isinstance(layer, TransformerLayer):
        return build_transformer_layer_callables(layer)
    if isinstance(layer, MultiTokenPredictionLayer):
        return build_mtp_layer_callables(layer)
    raise ValueError(f"Unsupported layer type: {type(layer)}")
