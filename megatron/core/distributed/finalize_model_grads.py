"""finalize_model_grads: everything that must happen to the gradients between backward and optimizer.step.

Order (each step is a sum, so any order would be right for all-reduces; the DP step comes first because
with ``--overlap-grad-reduce`` it is already running when backward ends):

1. finish the data-parallel reduction of every model chunk (``finish_grad_sync``);
2. all-reduce over the tensor-parallel group the gradients of parameters replicated across TP ranks but
   fed with different tokens under sequence parallelism, or with different heads (``param.sequence_parallel``:
   layer-norm weights and biases, row-parallel biases, the shared q/k norms, Gated DeltaNet's output norm);
3. all-reduce over the embedding group the gradient of the word embedding tied between the first and the
   last pipeline stage, or copied to the last stage for multi-token prediction (and of the position embedding
   between the first and the split stage of an encoder-decoder pipeline);
4. with ``--calculate-per-token-loss`` (``num_tokens`` given): the step's token count ``n`` of the last
   pipeline stage is broadcast over the pipeline group and summed over the data-parallel group, and every
   gradient is multiplied by ``1/n`` (DDP then reduces with a plain SUM, no ``1/|DP|`` pre-scaling), so the
   gradient is that of the token mean over the whole global batch;
5. with ``--moe-router-enable-expert-bias``: the aux-loss-free update of every router's expert bias from the
   step's token counts summed over the tensor x data (x context) parallel group (moe_utils.py states it), then
   the counts restart from zero;
6. with ``--moe-router-load-balancing-type global_aux_loss``: the routers' running global-batch counts restart.

Gradients are read from ``param.main_grad`` (our DDP buffers; ``.grad`` when there is none; this rank's block of
a DTensor ``.grad`` under fully sharded data parallelism).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import List, Optional

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megatron.core import device as _device
from megatron.core import parallel_state
from megatron.core.process_groups_config import group_of, pg_group, pg_rank, pg_size


def _main_grad(param):
    grad = getattr(param, "main_grad", None)
    grad = grad if grad is not None else param.grad
    if grad is not None and hasattr(grad, "to_local"):  # a DTensor (FSDP2): its local block
        grad = grad.to_local()
    return grad


def unwrap_model_chunk(module):
    """The model inside DDP / Float16Module wrappers: follow ``.module`` down to the first object that has
    ``pre_process`` (what Megatron's models set; Float16Module inherits MegatronModule's methods but not the
    model's state, so stopping at ``shared_embedding_or_output_weight`` would be wrong)."""
    while not hasattr(module, "pre_process") and isinstance(getattr(module, "module", None), torch.nn.Module):
        module = module.module
    return module


def _allreduce_coalesced(grads: List[torch.Tensor], group):
    if not grads:
        return
    # One collective per dtype: flatten, reduce, copy back into the original views.
    by_dtype = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        flat = _flatten_dense_tensors(same)
        torch.distributed.all_reduce(flat, group=group)
        for g, reduced in zip(same, _unflatten_dense_tensors(flat, same)):
            g.copy_(reduced)


def _allreduce_layernorm_grads(model: List[torch.nn.Module], config, tp_group=None):
    """Sum over TP the grads of replicated parameters marked ``sequence_parallel``: they saw only this rank's share of
    the work (a sequence shard under sequence parallelism, or a head shard: the shared q/k norms, Gated DeltaNet's
    output norm). Modules mark only what needs it."""
    tp_group = tp_group if tp_group is not None else parallel_state.get_tensor_model_parallel_group()
    if torch.distributed.get_world_size(tp_group) == 1:
        return
    grads = []
    for chunk in model:
        for param in chunk.parameters():
            if param.requires_grad and getattr(param, "sequence_parallel", False):
                grad = _main_grad(param)
                if grad is not None:
                    grads.append(grad.data)
    _allreduce_coalesced(grads, tp_group)


def _allreduce_embedding_grads(model: List[torch.nn.Module], config, pg_collection=None):
    """Sum the tied word-embedding grads of the first and last stage (and position embeddings at a split) over the
    collection's ``embd`` / ``pos_embd`` groups (else parallel_state's)."""
    from megatron.core.transformer.module import is_member

    pp_size = pg_size(pg_collection, "pp")
    if pp_size == 1:
        return
    embd_group = group_of(pg_collection, "embd")
    if embd_group is not None:
        in_embedding_group = is_member(embd_group)
    else:
        in_embedding_group = parallel_state.is_rank_in_embedding_group(ignore_virtual=True)
        embd_group = parallel_state.get_embedding_group() if in_embedding_group else None
    if in_embedding_group:
        pp_rank = pg_rank(pg_collection, "pp")
        if pp_rank == 0:
            chunk = model[0]
        elif pp_rank == pp_size - 1:
            chunk = model[-1]
        else:  # the decoder's first stage at the split rank holds the embedding in its first chunk
            chunk = model[0]
        inner = unwrap_model_chunk(chunk)
        # Tied weights, or the last stage's embedding copy that multi-token prediction uses.
        if (getattr(inner, "share_embeddings_and_output_weights", False)
                or getattr(getattr(inner, "config", None), "mtp_num_layers", None)):
            weight = inner.shared_embedding_or_output_weight()
            grad = _main_grad(weight)
            if grad is None:
                # Keep the collective matched on the other stage even if this copy got no gradient.
                grad = torch.zeros_like(weight)
            torch.distributed.all_reduce(grad, group=embd_group)

    # The position embedding of an encoder-decoder split (the encoder's and the decoder's first stage): over the
    # collection's ``pos_embd`` group, else parallel_state's.
    if parallel_state.get_pipeline_model_parallel_split_rank() is None:
        return
    pos_group = group_of(pg_collection, "pos_embd")
    if pos_group is None and parallel_state.is_rank_in_position_embedding_group():
        pos_group = parallel_state.get_position_embedding_group()
    if is_member(pos_group):
        inner = unwrap_model_chunk(model[0])
        weight = _position_embedding_weight(inner)
        if weight is not None:
            grad = _main_grad(weight)
            torch.distributed.all_reduce(grad if grad is not None else torch.zeros_like(weight), group=pos_group)


def _position_embedding_weight(inner):
    """The learned position-embedding table of a legacy (language_model.embedding) or core (embedding) model."""
    for path in (("language_model", "embedding", "position_embeddings"), ("embedding", "position_embeddings")):
        obj = inner
        for attr in path:
            obj = getattr(obj, attr, None)
            if obj is None:
                break
        if obj is not None and hasattr(obj, "weight"):
            return obj.weight
    return None


@contextmanager
def _timed(config, name: str):
    """Megatron's timers (``config.timers``) around one phase, at log level 1; a no-op without timers."""
    timers = getattr(config, "timers", None)
    if timers is None:
        yield
        return
    timer = timers(name, log_level=1)
    timer.start(barrier=getattr(config, "barrier_with_L1_time", False))
    try:
        yield
    finally:
        timer.stop()


def _scale_by_num_tokens(model: List[torch.nn.Module], num_tokens: torch.Tensor, pg_collection=None):
    """Step 4 of the module docstring; ``num_tokens`` is the last stage's count (ignored elsewhere)."""
    num_tokens = num_tokens.to(device=_device.current_device(), dtype=torch.int64).reshape(())
    pp_size = pg_size(pg_collection, "pp")
    if pp_size > 1:
        pp_group = pg_group(pg_collection, "pp")
        torch.distributed.broadcast(num_tokens, src=torch.distributed.get_global_rank(pp_group, pp_size - 1),
                                    group=pp_group)
    torch.distributed.all_reduce(num_tokens, group=pg_group(pg_collection, "dp_cp"))
    total = int(num_tokens.item())
    if total > 0:
        for chunk in model:
            scale_gradients(chunk, 1.0 / total)
    return num_tokens


def scale_gradients(chunk: torch.nn.Module, scaling_factor: float):
    """Multiply every gradient of a model chunk (its DDP buffers, else ``main_grad`` / ``.grad``) in place."""
    if hasattr(chunk, "scale_gradients"):
        chunk.scale_gradients(scaling_factor)
        return
    for param in chunk.parameters():
        grad = _main_grad(param)
        if grad is not None:
            grad.mul_(scaling_factor)


def finalize_model_grads(model: List[torch.nn.Module], num_tokens: Optional[torch.Tensor] = None,
                         pg_collection=None, force_all_reduce: bool = False):
    """Finish DP sync of every chunk, then the sequence-parallel and the embedding all-reduces, then (per-token
    loss) the division by the global token count. ``pg_collection`` (megatron-core's): ``tp`` sums the
    sequence-parallel gradients, ``pp`` / ``embd`` the tied embedding's, ``pp`` / ``dp_cp`` the token count,
    ``tp_dp_cp`` the routers' expert-bias counts (a group left None, or no collection: parallel_state's).
    ``force_all_reduce`` asks for all-reduced (not reduce-scattered) gradients: what the buffers do without the
    distributed optimizer; with it, refused."""
    if not isinstance(model, (list, tuple)):
        model = [model]
    if force_all_reduce and any(getattr(getattr(c, "ddp_config", None), "use_distributed_optimizer", False)
                                for c in model):
        raise NotImplementedError("finalize_model_grads(force_all_reduce=True) with the distributed optimizer: the "
                                  "gradient buffers are reduce-scattered; call it without force_all_reduce")
    config = getattr(model[0], "config", None) or getattr(unwrap_model_chunk(model[0]), "config", None)

    with _timed(config, "all-grads-sync"):
        for chunk in model:
            chunk.finish_grad_sync()
    with _timed(config, "layernorm-grads-all-reduce"):
        _allreduce_layernorm_grads(model, config, group_of(pg_collection, "tp"))
    with _timed(config, "embedding-grads-all-reduce"):
        _allreduce_embedding_grads(model, config, pg_collection)
    if num_tokens is not None:
        _scale_by_num_tokens(model, num_tokens, pg_collection)
    if config is not None and getattr(config, "num_moe_experts", None):
        _finish_router_step(model, config, pg_collection)


def reset_model_temporary_tensors(config, model: List[torch.nn.Module]):
    """Restart the routers' per-step sums: the global_aux_loss token counts and, with expert biases, the tokens
    counted per expert (megatron-core's; the end of each finalize)."""
    for chunk in model:
        for module in chunk.modules():
            if hasattr(module, "reset_global_aux_loss_tracker"):
                module.reset_global_aux_loss_tracker()
            if getattr(module, "expert_bias", None) is not None and hasattr(module, "local_tokens_per_expert"):
                module.local_tokens_per_expert.zero_()


def _finish_router_step(model: List[torch.nn.Module], config, pg_collection=None):
    """Steps 5 and 6: with expert biases, one all-reduce of the routers' token counts ``[routers, E]``, then each
    bias moves by the rate; then every local router's per-step sums restart (:func:`reset_model_temporary_tensors`;
    a no-op without those losses and biases)."""
    from megatron.core.transformer.moe.moe_utils import updated_expert_bias

    routers = [m for chunk in model for m in chunk.modules()
               if hasattr(m, "reset_global_aux_loss_tracker") and m.expert_bias is not None]
    if routers:  # else no expert bias, or this pipeline stage has no MoE layer
        counts = torch.stack([r.local_tokens_per_expert.float() for r in routers])
        torch.distributed.all_reduce(counts, group=pg_group(pg_collection, "tp_dp_cp"))
        biases = updated_expert_bias(counts, torch.stack([r.expert_bias.float() for r in routers]),
                                     config.moe_router_bias_update_rate)
        for router, bias in zip(routers, biases):
            router.expert_bias.copy_(bias)
    reset_model_temporary_tensors(config, model)
