"""Fused bias + dropout + residual add: ``residual + dropout(x + bias)`` (``--bias-dropout-fusion``).

Megatron fuses it with TorchScript; here the fused variant is ``torch.compile`` of the same function, used on
GPU. Dropout draws from the current generator in both, so masks are identical.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from megatron.core import device
from megatron.core.fusions.fused_kernels import compile_blocker, compiled
from megatron.core.utils import log_once


def bias_dropout_add(x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor, prob: float,
                     training: bool) -> torch.Tensor:
    """residual + dropout(x + bias)."""
    if bias is not None:
        x = x + bias
    out = F.dropout(x, p=prob, training=training)
    return residual + out


def _bias_dropout_add_train(x, bias, residual, prob: float):
    return bias_dropout_add(x, bias, residual, prob, True)


def _bias_dropout_add_inference(x, bias, residual, prob: float):
    return bias_dropout_add(x, bias, residual, prob, False)


def get_bias_dropout_add_func(training: bool, fused: bool, on_cuda: bool = False) -> Callable:
    """The function ``f(x, bias, residual, prob)`` for a layer (legacy calling convention).

    ``fused`` (``--bias-dropout-fusion``, Megatron's default) selects the compiled function on GPU; the
    eager one runs otherwise. Dropout draws from the current generator in both, so masks are identical.
    """
    fn = _bias_dropout_add_train if training else _bias_dropout_add_inference
    reason = compile_blocker(on_cuda) if fused else "--no-bias-dropout-fusion"
    use_compiled = reason is None
    log_once("bias_dropout_add", "bias-dropout-add fusion: "
             + ("torch.compile" if use_compiled else f"plain PyTorch (eager): {reason}"))
    return compiled(fn) if use_compiled else fn


def get_bias_dropout_add(training: bool, fused: bool) -> Callable:
    """megatron-core convention: ``f((x, bias), residual, prob)``."""
    inner = get_bias_dropout_add_func(training, fused, on_cuda=device.cuda_available())

    def _bda(x_with_bias, residual, prob):
        x, bias = x_with_bias
        return inner(x, bias, residual, prob)

    return _bda


__all__ = ["bias_dropout_add", "get_bias_dropout_add_func", "get_bias_dropout_add"]
