"""FP8 linear layers without Transformer Engine: per-tensor scaling, amax history, scaled GEMMs.

Formats (``--fp8-format``, field ``TransformerConfig.fp8``)::

    e4m3    every GEMM operand in float8_e4m3fn (max 448)
    hybrid  forward operands (activations, weights) in e4m3, gradients in float8_e5m2 (max 57344)

A tensor ``x`` is quantised with a per-tensor scale ``s``: ``q = cast_fp8(clamp(x * s, -max, max))`` and read back
as ``q / s``. A GEMM of two quantised operands is ``(qa @ qb) / (sa * sb)``: on a GPU that has FP8 tensor cores
(compute capability >= 8.9) it runs as ``torch._scaled_mm(qa, qb, scale_a=1/sa, scale_b=1/sb)`` with bf16/fp32
output; elsewhere (CPU, older GPUs) it is emulated by dequantising both operands to the output dtype and
multiplying, which has the same rounding of the operands (the accumulation is in the output dtype instead of fp32).
The implementation in use is logged once.

Scaling recipes (``--fp8-recipe``):

* ``delayed`` (Transformer Engine's DelayedScaling): every scaled tensor keeps an amax history of
  ``--fp8-amax-history-len`` entries. A GEMM quantises with the scale computed *before* it runs, from the history
  of earlier calls, then records its operand's amax (``max |x|``, MAX-all-reduced over the amax reduction group,
  TP x DP, so that every replica uses the same scale). The scale update is
  ``amax = max(history)`` (``--fp8-amax-compute-algo max``) or the newest entry (``most_recent``), then
  ``s = (fp8_max / amax) / 2**margin`` (``--fp8-margin``); the old scale is kept when ``amax`` is 0 or not finite.
  The first call (empty history) uses ``s = 1``.
* ``tensorwise`` (current scaling): ``s = (fp8_max / max|x|) / 2**margin`` from the tensor itself, no history.

Each linear layer scales three tensors: its input and its weight in forward (index 0, 1) and the output gradient
in backward (index 2). The weight gradient GEMM runs in FP8 too unless ``--no-fp8-wgrad``. The state (``scale``
``[3]`` and ``amax_history`` ``[history_len, 3]``) is a small module (``fp8_meta``) of each linear layer, so it is
saved and restored with the model's checkpoint.

Differences from Transformer Engine, said plainly: amaxes are reduced per GEMM call (TE batches the reduction of a
whole forward pass into one collective), and the amax reduction group is TP x DP (no context parallelism yet).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron.core import device
from megatron.core.utils import log_once

FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("delayed", "tensorwise")
AMAX_COMPUTE_ALGOS = ("most_recent", "max")

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
INPUT, WEIGHT, GRAD_OUTPUT = 0, 1, 2

def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


@dataclass(frozen=True)
class Fp8Recipe:
    """The FP8 settings of one model (from ``TransformerConfig``'s fp8 fields)."""

    fp8_format: str = "hybrid"
    recipe: str = "delayed"
    margin: int = 0
    amax_history_len: int = 1
    amax_compute_algo: str = "most_recent"
    fp8_wgrad: bool = True

    def __post_init__(self):
        if self.fp8_format not in FP8_FORMATS:
            raise ValueError(f"fp8 format must be one of {FP8_FORMATS} (--fp8-format), got {self.fp8_format!r}")
        if self.recipe not in FP8_RECIPES:
            raise ValueError(f"fp8 recipe {self.recipe!r} needs Transformer Engine; without it --fp8-recipe must be "
                             f"one of {FP8_RECIPES}")
        if self.amax_compute_algo not in AMAX_COMPUTE_ALGOS:
            raise ValueError(f"--fp8-amax-compute-algo must be one of {AMAX_COMPUTE_ALGOS}, "
                             f"got {self.amax_compute_algo!r}")
        if self.amax_history_len < 1:
            raise ValueError(f"--fp8-amax-history-len must be >= 1, got {self.amax_history_len}")
        if self.margin < 0:
            raise ValueError(f"--fp8-margin must be >= 0, got {self.margin}")

    def dtype(self, index: int) -> torch.dtype:
        """The FP8 dtype of tensor ``index`` (INPUT, WEIGHT, GRAD_OUTPUT)."""
        return E5M2 if (self.fp8_format == "hybrid" and index == GRAD_OUTPUT) else E4M3


def get_fp8_align_size(fp8_recipe) -> int:
    """Alignment (in rows) an FP8 GEMM needs: 32 for the ``mxfp8`` recipe (its 1x32 scaling blocks), else 16."""
    return 32 if str(getattr(fp8_recipe, "value", fp8_recipe)) == "mxfp8" else 16


def fp8_recipe_from_config(config) -> Optional[Fp8Recipe]:
    """The FP8 recipe of a ``TransformerConfig`` (None when FP8 is off or the config has no FP8 fields)."""
    fmt = getattr(config, "fp8", None)  # plain ModelParallelConfigs (not transformers) have no FP8 fields
    if not fmt:
        return None
    return Fp8Recipe(fp8_format=fmt, recipe=config.fp8_recipe, margin=config.fp8_margin,
                     amax_history_len=config.fp8_amax_history_len,
                     amax_compute_algo=config.fp8_amax_compute_algo, fp8_wgrad=config.fp8_wgrad)


def _derives_from(module, class_name: str) -> bool:
    """Whether ``module``'s class is (or derives from) ``megatron.core.tensor_parallel``'s ``class_name``, checked on
    the class's MRO by name so that this module does not import the layers that import it."""
    return any(cls.__name__ == class_name and cls.__module__.startswith("megatron.core.tensor_parallel")
               for cls in type(module).__mro__)


def is_column_parallel_linear(module) -> bool:
    """Whether ``module`` is a column-parallel linear layer (:class:`ColumnParallelLinear` or a subclass; Transformer
    Engine's column-parallel classes are not present here)."""
    return _derives_from(module, "ColumnParallelLinear")


def is_row_parallel_linear(module) -> bool:
    """Whether ``module`` is a row-parallel linear layer (:class:`RowParallelLinear` or a subclass)."""
    return _derives_from(module, "RowParallelLinear")


def is_first_last_bf16_layer(config, layer_no: int) -> bool:
    """Whether global layer ``layer_no`` (0-based) is kept in bf16 under FP8 (megatron-core's rule): only with
    ``config.first_last_layers_bf16``, and then when ``0 <= layer_no < num_layers_at_start_in_bf16`` or
    ``layer_no >= num_layers - num_layers_at_end_in_bf16``. A negative ``layer_no`` is never such a layer."""
    if not config.first_last_layers_bf16 or layer_no < 0:
        return False
    return (layer_no < config.num_layers_at_start_in_bf16
            or layer_no >= config.num_layers - config.num_layers_at_end_in_bf16)


def compute_scale(amax: torch.Tensor, old_scale: torch.Tensor, fmax: float, margin: int) -> torch.Tensor:
    """``(fmax / amax) / 2**margin``, keeping ``old_scale`` where amax is 0 or not finite (elementwise)."""
    amax = amax.float()
    new = (fmax / amax) / (2.0 ** margin)
    keep = (amax <= 0) | ~torch.isfinite(amax)
    return torch.where(keep, old_scale.float(), new)


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``cast(clamp(x * scale, -max, max))`` to the FP8 ``dtype``."""
    fmax = fp8_max(dtype)
    return (x.float() * scale).clamp_(-fmax, fmax).to(dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() / scale).to(dtype)


def _scaled_mm_usable(a: torch.Tensor, b: torch.Tensor) -> bool:
    if not a.is_cuda or not device.fp8_tensor_cores_available():
        return False
    # _scaled_mm needs both GEMM dims and the inner dim to be multiples of 16, and not two e5m2 operands.
    if a.shape[0] % 16 or a.shape[1] % 16 or b.shape[1] % 16:
        return False
    return not (a.dtype == E5M2 and b.dtype == E5M2)


def fp8_gemm(qa: torch.Tensor, scale_a: torch.Tensor, qb: torch.Tensor, scale_b: torch.Tensor,
             out_dtype: torch.dtype) -> torch.Tensor:
    """``(qa / scale_a) @ (qb / scale_b)`` for 2-D FP8 operands ``qa [M, K]``, ``qb [K, N]``."""
    if _scaled_mm_usable(qa, qb):
        log_once("fp8_gemm_scaled_mm", "fp8: GEMMs run in FP8 on tensor cores (torch._scaled_mm)")
        return torch._scaled_mm(qa.contiguous(), qb.t().contiguous().t(), scale_a=scale_a.reciprocal().float(),
                                scale_b=scale_b.reciprocal().float(), out_dtype=out_dtype)
    log_once("fp8_gemm_emulated", "fp8: GEMMs emulated: FP8-rounded operands multiplied in the compute dtype "
                               "(no FP8 tensor cores on this device)")
    return dequantize(qa, scale_a, out_dtype) @ dequantize(qb, scale_b, out_dtype)


class Fp8Meta(torch.nn.Module):
    """The scaling state of one linear layer: ``scale [3]`` and ``amax_history [history_len, 3]`` (checkpointed).

    Row 0 of the history is the newest amax. :meth:`scale_for` returns the scale to quantise tensor ``index`` with
    and records the tensor's amax afterwards (delayed) or derives the scale from the tensor itself (tensorwise).
    """

    def __init__(self, recipe: Fp8Recipe, amax_group=None):
        super().__init__()
        self.recipe = recipe
        self.amax_group = amax_group
        self.register_buffer("scale", torch.ones(3))
        self.register_buffer("amax_history", torch.zeros(recipe.amax_history_len, 3))
        # Number of amaxes recorded per tensor (persistent, so a resumed run continues the same schedule).
        self.register_buffer("num_recorded", torch.zeros(3, dtype=torch.int64))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        if not any(k.startswith(prefix) for k in state_dict):
            # A checkpoint saved without FP8 (or by Transformer Engine, which keeps its scales elsewhere): start the
            # scaling state afresh, as a new FP8 run does.
            log_once("fp8_fresh_state", "fp8: the checkpoint holds no FP8 scaling state; scales start at 1")
            return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def _reduced_amax(self, x: torch.Tensor) -> torch.Tensor:
        amax = x.detach().abs().max().float().reshape(1)
        group = self.amax_group
        if group is not None and torch.distributed.is_initialized() and torch.distributed.get_world_size(group) > 1:
            torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=group)
        return amax[0]

    def _delayed_scale(self, index: int) -> torch.Tensor:
        """The scale from the history recorded so far (``s = 1`` before the first amax)."""
        if int(self.num_recorded[index]) == 0:
            return self.scale[index]
        history = self.amax_history[:, index]
        amax = history.max() if self.recipe.amax_compute_algo == "max" else history[0]
        new = compute_scale(amax, self.scale[index], fp8_max(self.recipe.dtype(index)), self.recipe.margin)
        self.scale[index] = new
        return self.scale[index]

    @torch.no_grad()
    def quantize(self, x: torch.Tensor, index: int):
        """``(q, scale)`` for tensor ``index``; updates the state as the recipe says."""
        dtype = self.recipe.dtype(index)
        if self.recipe.recipe == "tensorwise":
            amax = self._reduced_amax(x) if index == WEIGHT else x.detach().abs().max().float()
            scale = compute_scale(amax, torch.ones((), device=x.device), fp8_max(dtype), self.recipe.margin)
            self.scale[index] = scale
            return quantize(x, scale, dtype), scale.clone()
        scale = self._delayed_scale(index).clone()
        q = quantize(x, scale.to(x.device), dtype)
        amax = self._reduced_amax(x)
        self.amax_history[:, index] = torch.roll(self.amax_history[:, index], 1)
        self.amax_history[0, index] = amax
        self.num_recorded[index] += 1
        return q, scale.to(x.device)


def fp8_forward(meta: Fp8Meta, total_input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]):
    """``X W^T (+ b)`` with both operands in FP8; returns ``(output, saved)`` where ``saved`` holds the quantised
    operands and their scales for backward (kept in FP8: 1 byte per element, as Transformer Engine does)."""
    x2d = total_input.reshape(-1, total_input.shape[-1])
    qx, sx = meta.quantize(x2d, INPUT)
    qw, sw = meta.quantize(weight, WEIGHT)
    out = fp8_gemm(qx, sx, qw.t(), sw, total_input.dtype)
    if bias is not None:
        out = out + bias
    # Reshaped as ATen's own matmul does (_unsafe_view): a plain view of this fresh product would make the custom
    # Function's output a view, and a loss that works in the logits in place (the GPT and BERT heads with fp32
    # logits) would then fail in backward ("Output 0 of LinearWithGradAccumulationAndAsyncCommunication is a view").
    return torch.ops.aten._unsafe_view(out, (*total_input.shape[:-1], weight.shape[0])), (qx, sx, qw, sw)


def fp8_dgrad(meta: Fp8Meta, grad_output: torch.Tensor, saved):
    """``grad_input = dY W`` with the output gradient in FP8 (e5m2 for ``hybrid``); returns
    ``(grad_input, (qg, sg))``, the quantised gradient being reused by :func:`fp8_wgrad`."""
    _, _, qw, sw = saved
    go2d = grad_output.reshape(-1, grad_output.shape[-1])
    qg, sg = meta.quantize(go2d, GRAD_OUTPUT)
    grad_input = fp8_gemm(qg, sg, qw, sw, grad_output.dtype).view(*grad_output.shape[:-1], qw.shape[1])
    return grad_input, (qg, sg)


def fp8_wgrad(meta: Fp8Meta, grad_q, grad_output_2d: torch.Tensor, saved, total_input_2d: torch.Tensor):
    """``grad_weight = dY^T X``: both in FP8 (the input quantised in forward), or in the compute dtype with
    ``--no-fp8-wgrad``."""
    if meta.recipe.fp8_wgrad:
        qx, sx, _, _ = saved
        qg, sg = grad_q
        return fp8_gemm(qg.t(), sg, qx, sx, grad_output_2d.dtype)
    return grad_output_2d.t().matmul(total_input_2d.to(grad_output_2d.dtype))
