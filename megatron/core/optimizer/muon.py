"""Muon: momentum SGD whose update of each 2-D weight is orthogonalised, with tensor-parallel weights handled.

For a weight ``W`` with gradient ``G``, momentum ``beta``, learning rate ``lr`` and weight decay ``wd``:

* decoupled weight decay ``W <- W (1 - lr wd)`` (or L2: ``G <- G + wd W``);
* ``M <- beta M + (1 - beta) G`` (an EMA); the direction is ``D = M``, or with Nesterov ``(1 - beta) G + beta M``;
* ``O = NS(D)``, the Newton-Schulz approximation of the orthogonal polar factor ``U V^T`` of ``D = U S V^T``;
* ``W <- W - lr * s * extra_scale * O``, with the shape scale ``s`` of ``get_muon_scale_factor``: ``spectral``
  ``sqrt(max(m, n))``; ``unit_rms_norm`` ``sqrt(m / n)``; ``shape_scaling`` ``sqrt(max(1, m / n))`` (``m x n``
  the full, unsharded weight shape).

Newton-Schulz: ``X_0 = D / ||D||_F`` (so every singular value is <= 1), transposed so that ``X`` is wide
(``rows <= cols``); then ``X <- a X + (b A + c A^2) X`` with ``A = X X^T`` for the iteration's ``(a, b, c)``; each
step maps every singular value ``s`` to ``a s + b s^3 + c s^5`` and leaves the singular vectors alone, driving the
singular values towards 1. The ``quintic`` coefficients (five tuned steps) land them near 1 (about 0.7 - 1.2)
fast; ``polar_express`` ends on ``(15/8, -10/8, 3/8)``, which converges to exactly 1 (``U V^T``) when repeated. With
``fp32_matmul_prec="medium"`` the products are computed in bf16.

Tensor parallelism (``partition_dim`` of the weight, ``mode``):

* ``blockwise``: every TP shard is orthogonalised on its own (and scaled by its own shape);
* ``duplicated``: the shards are all-gathered, every rank orthogonalises the full matrix and keeps its slice;
* ``distributed``: the shards stay put: the iteration runs on the sharded ``X`` (oriented so that it is sharded
  along its long side), with ``A = X X^T`` all-reduced (summed) over the TP group and the Frobenius norm too.

``split_qkv``: a fused QKV weight (``is_qkv_fn(param)``) is ``[groups x (q + k + v) rows, hidden]``; its q, k and
v blocks (``qkv_split_shapes`` rows per query group) are orthogonalised and scaled separately.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from itertools import chain, cycle, islice, repeat
from typing import Any, Callable, Dict, List, Literal, Optional

import torch

from megatron.core.optimizer import _get_param_groups, get_megatron_optimizer
from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer
from megatron.core.optimizer.optimizer import (
    ChainedOptimizer,
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    MegatronOptimizer,
)
from megatron.core.optimizer.optimizer_config import OptimizerConfig, ParamKey
from megatron.core.optimizer_param_scheduler import ParamGroupOverride
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.utils import get_attr_wrapped_model, get_pg_rank, get_pg_size

logger = logging.getLogger(__name__)

# (a, b, c) of each Newton-Schulz step: s -> a s + b s^3 + c s^5 on every singular value s.
_NS_COEFFICIENTS = {
    "simple": [(3.4445, -4.7750, 2.0315)],
    "quintic": [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
                (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)],
    # Polar Express (arXiv 2505.16932), ending on the convergent (15/8, -10/8, 3/8).
    "polar_express": [(8.2051, -22.9019, 16.4607), (4.0664, -2.8612, 0.5184), (3.9096, -2.8234, 0.5250),
                      (3.2856, -2.4153, 0.4853), (2.2779, -1.6198, 0.3985), (1.8726, -1.2307, 0.3585),
                      (1.8564, -1.2132, 0.3568), (1.8750, -1.2500, 0.3750)],
}
_REPEAT_LAST = ("polar_express",)  # after the list, keep its last step; the others cycle through theirs


def _coefficients(steps: int, coefficient_type: str):
    if coefficient_type not in _NS_COEFFICIENTS:
        raise ValueError(f"Newton-Schulz coefficient_type must be one of {sorted(_NS_COEFFICIENTS)}, "
                         f"got {coefficient_type!r}")
    sets = _NS_COEFFICIENTS[coefficient_type]
    endless = chain(sets, repeat(sets[-1])) if coefficient_type in _REPEAT_LAST else cycle(sets)
    return islice(endless, steps)


def newton_schulz(x: torch.Tensor, steps: int, coefficient_type: str = "quintic", eps: float = 1e-7,
                  transpose: Optional[bool] = None, tp_group=None) -> torch.Tensor:
    """``steps`` Newton-Schulz iterations towards the orthogonal polar factor of the fp32 matrix ``x`` (module
    docstring). ``transpose`` (default: when ``x`` is tall) runs on ``x^T``; with ``tp_group`` ``x`` is this rank's
    shard along its long side and ``X X^T`` and the norm are summed over the group."""
    if x.ndim != 2:
        raise ValueError(f"Newton-Schulz needs a 2-D matrix, got shape {tuple(x.shape)}")
    if x.dtype != torch.float32:
        raise TypeError(f"Newton-Schulz needs a float32 matrix, got {x.dtype}")
    if transpose is None:
        transpose = x.size(0) > x.size(1)
    X = x.mT if transpose else x
    squares = (X * X).sum()
    if tp_group is not None:
        torch.distributed.all_reduce(squares, group=tp_group)
    X = X / squares.sqrt().clamp_min(eps)
    if torch.get_float32_matmul_precision() == "medium":
        X = X.to(torch.bfloat16)  # fp32 in / out, bf16 products
    for a, b, c in _coefficients(steps, coefficient_type):
        A = X @ X.mT
        if tp_group is not None:
            torch.distributed.all_reduce(A, group=tp_group)
        X = a * X + (b * A + c * (A @ A)) @ X
    X = X.to(torch.float32)
    return X.mT if transpose else X


def newton_schulz_tp(x: torch.Tensor, steps: int, coefficient_type: str, tp_group, partition_dim: Optional[int] = None,
                     mode: Literal["duplicated", "distributed"] = "duplicated") -> torch.Tensor:
    """Newton-Schulz of a matrix sharded over ``tp_group`` along ``partition_dim`` (None: not sharded); returns this
    rank's shard of the result (module docstring for the modes)."""
    if partition_dim is None or tp_group is None or get_pg_size(tp_group) == 1:
        return newton_schulz(x, steps, coefficient_type)
    if mode == "duplicated":
        shards = [torch.empty_like(x) for _ in range(get_pg_size(tp_group))]
        torch.distributed.all_gather(shards, x.contiguous(), group=tp_group)
        full = newton_schulz(torch.cat(shards, dim=partition_dim), steps, coefficient_type)
        return full.chunk(get_pg_size(tp_group), dim=partition_dim)[get_pg_rank(tp_group)]
    if mode == "distributed":
        if partition_dim not in (0, 1):
            raise ValueError(f"Muon distributed mode: partition_dim must be 0 or 1, got {partition_dim}")
        # Sharded rows: iterate on X^T, whose columns (the long side of the products) are sharded.
        return newton_schulz(x, steps, coefficient_type, transpose=partition_dim == 0, tp_group=tp_group)
    raise ValueError(f"Muon TP mode must be 'duplicated' or 'distributed', got {mode!r}")


def get_muon_scale_factor(size_out: int, size_in: int, mode: str = "spectral") -> float:
    """The update scale for a ``size_out x size_in`` weight (module docstring)."""
    if mode == "spectral":
        return max(size_out, size_in) ** 0.5
    if mode == "unit_rms_norm":
        return (size_out / size_in) ** 0.5
    if mode == "shape_scaling":
        return max(1, size_out / size_in) ** 0.5
    raise ValueError(f"Muon scale mode must be spectral, unit_rms_norm or shape_scaling, got {mode!r}")


@contextmanager
def _fp32_matmul_precision(precision: str):
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


class TensorParallelMuon(torch.optim.Optimizer):
    """Muon over (possibly tensor-parallel) 2-D weights; the math is in the module docstring. Param groups carry
    ``lr``, ``momentum_beta`` and ``weight_decay``; the state of each weight is its ``momentum_buffer``."""

    def __init__(self, params, lr: float = 3e-4, momentum_beta: float = 0.95, use_nesterov: bool = True,
                 weight_decay: float = 0.01, use_decoupled_weight_decay: bool = True, split_qkv: bool = False,
                 is_qkv_fn: Optional[Callable[[torch.Tensor], bool]] = None, qkv_split_shapes=None,
                 fp32_matmul_prec: str = "medium", coefficient_type: str = "quintic", num_ns_steps: int = 5,
                 scale_mode: str = "spectral", extra_scale_factor: float = 1.0,
                 pg_collection: Optional[ProcessGroupCollection] = None,
                 mode: Literal["blockwise", "duplicated", "distributed"] = "duplicated") -> None:
        if num_ns_steps < 1:
            raise ValueError(f"num_ns_steps must be at least 1, got {num_ns_steps}")
        if mode not in ("blockwise", "duplicated", "distributed"):
            raise ValueError(f"Muon TP mode must be blockwise, duplicated or distributed, got {mode!r}")
        if split_qkv and (is_qkv_fn is None or not qkv_split_shapes):
            raise ValueError("Muon split_qkv needs is_qkv_fn and qkv_split_shapes")
        get_muon_scale_factor(1, 1, scale_mode)  # validates the mode
        _coefficients(1, coefficient_type)  # validates the coefficient type
        self.pg_collection = pg_collection
        self.mode = mode
        self.split_qkv = split_qkv
        self.is_qkv_fn = is_qkv_fn
        self.qkv_split_shapes = list(qkv_split_shapes) if qkv_split_shapes else None
        self.use_nesterov = use_nesterov
        self.use_decoupled_weight_decay = use_decoupled_weight_decay
        self.fp32_matmul_prec = fp32_matmul_prec
        self.coefficient_type = coefficient_type
        self.num_ns_steps = num_ns_steps
        self.scale_mode = scale_mode
        self.extra_scale_factor = extra_scale_factor
        super().__init__(params, dict(lr=lr, momentum_beta=momentum_beta, weight_decay=weight_decay))

    def scaled_orthogonalize_fn(self, grad: torch.Tensor, tp_group, partition_dim: Optional[int] = None):
        """``s * extra_scale * NS(grad)`` for one (shard of a) matrix, ``s`` from the full matrix's shape."""
        size = [grad.size(-2), grad.size(-1)]
        if partition_dim is not None and tp_group is not None:
            size[partition_dim] *= get_pg_size(tp_group)
        mode = "duplicated" if self.mode == "blockwise" else self.mode
        orthogonal = newton_schulz_tp(grad.float(), self.num_ns_steps, self.coefficient_type, tp_group,
                                      partition_dim, mode)
        scale = get_muon_scale_factor(size[0], size[1], self.scale_mode) * self.extra_scale_factor
        return (orthogonal * scale).to(grad.dtype)

    def orthogonalize(self, p: torch.Tensor, grad: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """The orthogonalised, scaled update of weight ``p`` from its momentum direction ``grad``."""
        if grad.ndim != 2:
            raise ValueError(f"Muon updates 2-D weights only, got shape {tuple(grad.shape)}")
        tp_group = None
        if self.pg_collection is not None:
            tp_group = self.pg_collection.expt_tp if getattr(p, "expert_tp", False) else self.pg_collection.tp
        partition_dim = None if self.mode == "blockwise" else getattr(p, "partition_dim", None)
        if partition_dim == -1:
            partition_dim = None
        if not (self.split_qkv and self.is_qkv_fn(p)):
            return self.scaled_orthogonalize_fn(grad, tp_group, partition_dim)
        rows, cols = grad.shape
        groups = rows // sum(self.qkv_split_shapes)
        blocks = torch.split(grad.view(groups, sum(self.qkv_split_shapes), cols), self.qkv_split_shapes, dim=1)
        updates = [self.scaled_orthogonalize_fn(block.reshape(-1, cols), tp_group, partition_dim)
                   .view(groups, -1, cols) for block in blocks]
        return torch.cat(updates, dim=1).view(rows, cols)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("TensorParallelMuon.step: closure is not supported")
        for group in self.param_groups:
            lr, beta, wd = group["lr"], group["momentum_beta"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                if wd != 0.0:
                    if self.use_decoupled_weight_decay:
                        p.mul_(1.0 - lr * wd)
                    else:
                        grad = grad + wd * p
                momentum = state["momentum_buffer"]
                momentum.lerp_(grad, 1.0 - beta)
                direction = grad.lerp(momentum, beta) if self.use_nesterov else momentum
                with _fp32_matmul_precision(self.fp32_matmul_prec):
                    update = self.orthogonalize(p, direction, **{k: v for k, v in group.items() if k != "params"})
                p.add_(update, alpha=-lr)
        return None


def _qkv_split_shapes(model_chunks) -> List[int]:
    """Rows of q, k and v per query group: ``[heads / groups * kv_channels, kv_channels, kv_channels]``."""
    config = get_attr_wrapped_model(model_chunks[0], "config")
    groups = config.num_query_groups or config.num_attention_heads
    kv_channels = config.kv_channels or config.hidden_size // config.num_attention_heads
    return [config.num_attention_heads // groups * kv_channels, kv_channels, kv_channels]


def get_megatron_muon_optimizer(config: OptimizerConfig, model_chunks: List[torch.nn.Module],
                                config_overrides: Optional[Dict[ParamKey, ParamGroupOverride]] = None,
                                use_gloo_process_groups: bool = True, layer_wise_distributed_optimizer: bool = False,
                                pg_collection: Optional[ProcessGroupCollection] = None) -> MegatronOptimizer:
    """Muon for the 2-D non-embedding weights, Adam (``get_megatron_optimizer``) for every other parameter, chained.

    The 2-D weights go to a :class:`TensorParallelMuon` built from the ``muon_*`` fields of ``config`` (expert
    weights, named ``*experts*`` but not ``shared``, to a second one that uses the expert TP group, unless
    ``layer_wise_distributed_optimizer``); with bf16 each is wrapped in fp32 main parameters. The fused QKV
    weights (``linear_qkv.weight``) are split by q / k / v. Everything is chained (a :class:`ChainedOptimizer`),
    or, with ``layer_wise_distributed_optimizer``, sharded by whole parameters over the data-parallel ranks
    (:class:`LayerWiseDistributedOptimizer`). Like megatron-core this sets ``config.optimizer = 'adam'``;
    the distributed optimizer and fp16 are refused.
    """
    config.optimizer = "adam"
    if config.use_distributed_optimizer:
        raise ValueError("Muon with the distributed optimizer is not supported: use "
                         "layer_wise_distributed_optimizer (--optimizer dist_muon) or drop --use-distributed-optimizer")
    if config.fp16:
        raise ValueError("Muon with fp16 is not supported: use --bf16")
    if pg_collection is None:
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()

    linear, nonlinear = [], []
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            if not param.requires_grad:
                continue
            if "experts" in name and "shared" not in name:
                param.expert_tp = True
            if "linear_qkv.weight" in name and param.dim() == 2:
                param.is_qkv = True
            is_matrix = param.dim() == 2 and not getattr(param, "is_embedding_or_output_parameter", False)
            (linear if is_matrix else nonlinear).append(param)

    muon_kwargs = dict(lr=config.lr, momentum_beta=config.muon_momentum, use_nesterov=config.muon_use_nesterov,
                       weight_decay=config.weight_decay, fp32_matmul_prec=config.muon_fp32_matmul_prec,
                       num_ns_steps=config.muon_num_ns_steps, scale_mode=config.muon_scale_mode,
                       split_qkv=config.muon_split_qkv, is_qkv_fn=lambda p: getattr(p, "is_qkv", False),
                       qkv_split_shapes=_qkv_split_shapes(model_chunks), extra_scale_factor=config.muon_extra_scale_factor,
                       pg_collection=pg_collection, mode=config.muon_tp_mode)

    def wrap(torch_optimizer):
        wrapped = (Float16OptimizerWithFloat16Params(torch_optimizer, config, None) if config.bf16
                   else FP32Optimizer(torch_optimizer, config))
        wrapped.pg_collection = pg_collection
        return wrapped

    for param in nonlinear:  # Muon's groups: the matrices only
        param.requires_grad_(False)
    try:
        groups = [g for g in _get_param_groups(model_chunks, config, config_overrides) if g["params"]]
    finally:
        for param in nonlinear:
            param.requires_grad_(True)
    expert_groups = [] if layer_wise_distributed_optimizer else [g for g in groups if g["is_expert_parallel"]]
    dense_groups = [g for g in groups if not any(g is e for e in expert_groups)]
    for group in groups:
        group["lr"] = group["max_lr"] * group["lr_mult"]
        group["weight_decay"] = config.weight_decay * group["wd_mult"]

    bf16 = config.bf16
    if layer_wise_distributed_optimizer:
        # The layer-wise optimizer creates the fp32 main parameters after sharding (only for its own shard).
        config.bf16 = False
    try:
        optimizers = [wrap(TensorParallelMuon(dense_groups, **muon_kwargs))] if dense_groups else []
        if expert_groups:
            optimizers.append(wrap(TensorParallelMuon(expert_groups, **muon_kwargs)))
        if nonlinear:
            for param in linear:  # Adam's groups: everything else
                param.requires_grad_(False)
            try:
                adam = get_megatron_optimizer(config, model_chunks, config_overrides=config_overrides,
                                              use_gloo_process_groups=use_gloo_process_groups,
                                              pg_collection=pg_collection)
            finally:
                for param in linear:
                    param.requires_grad_(True)
            optimizers += adam.chained_optimizers if isinstance(adam, ChainedOptimizer) else [adam]
    finally:
        config.bf16 = bf16
    logger.info("Muon: %d matrices (%s TP mode), Adam: %d other parameters", len(linear), config.muon_tp_mode,
                len(nonlinear))
    if layer_wise_distributed_optimizer:
        return LayerWiseDistributedOptimizer(optimizers, config, pg_collection)
    return ChainedOptimizer(optimizers)
