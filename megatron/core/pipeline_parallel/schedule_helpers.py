"""Small helpers of megatron-core's pipeline schedules (re-exported by :mod:`megatron.core.pipeline_parallel.schedules`).

* ``get_pp_rank_microbatches``: how many forward passes a pipeline rank runs before its first backward pass.
  With ``M`` micro-batches, ``C`` model chunks, ``P`` stages and this rank ``r``, the total is ``T = M * C``;
  the warm-up is ``T`` when forward-only; ``P - r - 1`` for the plain 1F1B schedule (no virtual pipeline);
  ``2 (P - r - 1) + (C - 1) G`` for the interleaved one (``G``: micro-batches per virtual-stage group), plus
  one with the EP all-to-all overlap; ``0`` without pipelining. The warm-up is capped at ``T`` (then every
  micro-batch is in the warm-up); the remaining ``T - warmup`` run one-forward-one-backward.
* ``set_current_microbatch``: tell every decoder layer (and every MTP layer's transformer layer) the index of
  the micro-batch running now.
* ``clear_embedding_activation_buffer`` / ``finish_embedding_wgrad_compute``: with
  ``config.defer_embedding_wgrad_compute``, the last stage's output layer keeps its inputs and output gradients
  to compute the weight gradient after the pipeline drains; these empty the buffer before a step and run the
  deferred computation after it.
"""
from __future__ import annotations

from typing import Optional

from megatron.core import parallel_state
from megatron.core.utils import drain_embedding_wgrad_compute, get_attr_wrapped_model


def get_pp_rank_microbatches(num_microbatches, num_model_chunks, microbatch_group_size_per_vp_stage,
                             forward_only=False, overlap_moe_expert_parallel_comm=False,
                             p2p_communicator: Optional[object] = None):
    """``(total, all_in_warmup, warmup, remaining)`` micro-batch counts of this pipeline rank (module docstring).
    The pipeline size / rank and the virtual-pipeline size come from ``p2p_communicator`` (its ``pp_group`` and
    ``virtual_pipeline_model_parallel_size``), else from parallel_state."""
    if p2p_communicator is not None:
        pp_size, pp_rank = p2p_communicator.pp_group.size(), p2p_communicator.pp_group.rank()
        vp_size = p2p_communicator.virtual_pipeline_model_parallel_size
    else:
        pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        vp_size = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    total = num_microbatches * num_model_chunks
    if forward_only:
        warmup = total
    elif pp_size <= 1:
        warmup = 0
    elif vp_size is None:
        warmup = pp_size - pp_rank - 1
    else:
        warmup = 2 * (pp_size - pp_rank - 1) + (num_model_chunks - 1) * microbatch_group_size_per_vp_stage
        warmup += 1 if overlap_moe_expert_parallel_comm else 0
    all_in_warmup = warmup >= total
    warmup = min(warmup, total)
    return total, all_in_warmup, warmup, total - warmup


def set_current_microbatch(model, microbatch_id):
    """Set ``current_microbatch = microbatch_id`` on every layer of the model's decoder and on the transformer
    layer of every MTP layer (nothing when the model, through its wrappers, has no decoder)."""
    try:
        owner = get_attr_wrapped_model(model, "decoder", allow_none=False, return_model_obj=True)
    except RuntimeError:
        return
    for layer in owner.decoder.layers:
        layer.current_microbatch = microbatch_id
    if hasattr(owner, "mtp"):
        for layer in owner.mtp.layers:
            layer.transformer_layer.current_microbatch = microbatch_id


def clear_embedding_activation_buffer(config, model, is_last_stage):
    """On the last stage with ``config.defer_embedding_wgrad_compute``: empty the output layer's
    ``embedding_activation_buffer`` and return the module that owns it (found through the wrappers of ``model``,
    or of its last chunk when ``model`` is a list); otherwise None."""
    if not (is_last_stage and getattr(config, "defer_embedding_wgrad_compute", False)):
        return None
    chunk = model[-1] if isinstance(model, list) else model
    embedding_module = get_attr_wrapped_model(chunk, "post_process", return_model_obj=True)
    embedding_module.embedding_activation_buffer.clear()
    return embedding_module


def finish_embedding_wgrad_compute(config, embedding_module, is_last_stage, tp_group):
    """On the last stage with ``config.defer_embedding_wgrad_compute``: compute the deferred weight gradient of
    the output layer from the buffered activations and output gradients (``drain_embedding_wgrad_compute``) into
    its weight: ``output_layer.weight`` when embeddings and output weights are shared, else
    ``shared_embedding_or_output_weight()`` (megatron-core's choice, kept)."""
    if not (is_last_stage and getattr(config, "defer_embedding_wgrad_compute", False)):
        return
    weight = (embedding_module.output_layer.weight if embedding_module.share_embeddings_and_output_weights
              else embedding_module.shared_embedding_or_output_weight())
    drain_embedding_wgrad_compute(config, embedding_module.embedding_activation_buffer,
                                  embedding_module.grad_output_buffer, weight, tp_group)
