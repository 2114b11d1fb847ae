"""Weight-gradient GEMMs into ``param.main_grad`` (gradient-accumulation fusion).

With ``gradient_accumulation_fusion`` a linear layer ``y = x W^T`` does not return ``dL/dW`` to autograd: it adds
``grad_output_2d^T @ input_2d`` (``[out, tokens] @ [tokens, in]``) into ``W.main_grad``, the fp32 (or bf16 / fp16)
gradient buffer that DistributedDataParallel allocates. On CUDA with apex installed this is apex's
``fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32/fp16`` kernel; everywhere else ``main_grad.addmm_`` in the
buffer's dtype. The implementation chosen is printed once.
"""
from __future__ import annotations

import functools

import torch

from megatron.core import device


@functools.lru_cache(maxsize=None)
def fused_wgrad_module():
    """apex's fused weight-gradient accumulation kernel if installed (CUDA only), else None. Logged once."""
    module = None
    if device.cuda_available():
        try:
            import fused_weight_gradient_mlp_cuda  # type: ignore

            module = fused_weight_gradient_mlp_cuda
        except ImportError:
            pass
    impl = "apex fused_weight_gradient_mlp_cuda" if module else "torch addmm_"
    print(f"> gradient accumulation fusion: using {impl}", flush=True)
    return module


def checked_main_grad(weight):
    """``weight.main_grad``; a clear error when DistributedDataParallel allocated none."""
    if not hasattr(weight, "main_grad") or weight.main_grad is None:
        raise RuntimeError(
            "gradient_accumulation_fusion adds weight gradients into param.main_grad, but this parameter has "
            "none: wrap the model in megatron's DistributedDataParallel (which allocates grad buffers) or pass "
            "--no-gradient-accumulation-fusion"
        )
    return weight.main_grad


def add_into_main_grad(weight, grad_weight) -> None:
    """``main_grad += grad_weight`` (a weight gradient computed elsewhere, e.g. in FP8)."""
    main_grad = checked_main_grad(weight)
    main_grad.add_(grad_weight.to(main_grad.dtype))


def accumulate_into_main_grad(weight, total_input_2d, grad_output_2d) -> None:
    """``main_grad += grad_output_2d^T @ total_input_2d`` (``[tokens, out]``, ``[tokens, in]``)."""
    main_grad = checked_main_grad(weight)
    fused = fused_wgrad_module()
    if fused is not None and total_input_2d.is_cuda:
        if main_grad.dtype == torch.float32:
            fused.wgrad_gemm_accum_fp32(total_input_2d, grad_output_2d, main_grad)
            return
        if main_grad.dtype in (torch.float16, torch.bfloat16):
            fused.wgrad_gemm_accum_fp16(total_input_2d, grad_output_2d, main_grad)
            return
    main_grad.addmm_(grad_output_2d.t().to(main_grad.dtype), total_input_2d.to(main_grad.dtype))
