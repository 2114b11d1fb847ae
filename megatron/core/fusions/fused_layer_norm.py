"""LayerNorm and RMSNorm with Megatron's options (zero-centred gamma, sequence-parallel marking), and
megatron-core's ``FusedLayerNorm`` spec entry (this is megatron-core's module path for it).

``LayerNorm`` takes the place of Megatron's ``MixedFusedLayerNorm``: apex's fused kernel when apex is
installed and the input is on a GPU, ``torch.nn.functional.layer_norm`` otherwise (printed once). Both
compute in fp32 when the input and weight dtypes differ (``--fp32-residual-connection``) and return the
weight's dtype, as the "mixed" apex kernel does. ``megatron.core.transformer.norms`` re-exports these.
"""
from __future__ import annotations

import functools
import numbers

import torch
import torch.nn.functional as F
from torch.nn.parameter import Parameter

from megatron.core import device
from megatron.core.device import init_device, param_device, weights_on_meta  # noqa: F401 (their old home)
from megatron.core.fusions import fused_kernels
from megatron.core.utils import log_once

@functools.lru_cache(maxsize=None)
def _apex_layer_norm():
    """apex's FusedLayerNormAffineFunction when apex is importable and a GPU is present, else None."""
    if device.cuda_available():
        try:
            from apex.normalization.fused_layer_norm import FusedLayerNormAffineFunction  # type: ignore

            return FusedLayerNormAffineFunction
        except ImportError:
            pass
    return None


def _mark_sequence_parallel(module: torch.nn.Module, sequence_parallel: bool) -> None:
    # With sequence parallelism each TP rank normalises different tokens, so the gradients of these
    # replicated parameters are partial and must be all-reduced over the TP group (done by the trainer).
    for p in module.parameters(recurse=False):
        setattr(p, "sequence_parallel", sequence_parallel)


class LayerNorm(torch.nn.Module):
    """``MixedFusedLayerNorm(normalized_shape, eps, no_persist_layer_norm, sequence_parallel, apply_layernorm_1p)``.

    With ``apply_layernorm_1p`` the weight is stored zero-centred (initialised to 0, used as ``1 + w``),
    which lets weight decay pull it towards 1.
    """

    def __init__(self, normalized_shape, eps: float = 1e-5, no_persist_layer_norm: bool = True,
                 sequence_parallel: bool = False, apply_layernorm_1p: bool = False, *, params_dtype=None,
                 param_device_=None):
        super().__init__()
        if isinstance(normalized_shape, numbers.Integral):
            normalized_shape = (normalized_shape,)
        self.normalized_shape = torch.Size(normalized_shape)
        self.eps = eps
        self.apply_layernorm_1p = apply_layernorm_1p
        self.no_persist_layer_norm = no_persist_layer_norm
        self.sequence_parallel = sequence_parallel
        kwargs = {"dtype": params_dtype or torch.float32, "device": param_device_}
        self.weight = Parameter(torch.empty(*normalized_shape, **kwargs))
        self.bias = Parameter(torch.empty(*normalized_shape, **kwargs))
        self.reset_parameters()
        _mark_sequence_parallel(self, sequence_parallel)

    def reset_parameters(self):
        with torch.no_grad():
            if self.apply_layernorm_1p:
                self.weight.zero_()
            else:
                self.weight.fill_(1.0)
            self.bias.zero_()

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = self.weight + 1 if self.apply_layernorm_1p else self.weight
        apex_ln = _apex_layer_norm() if input.is_cuda else None
        if apex_ln is not None:
            log_once("layernorm", "LayerNorm: apex FusedLayerNormAffineFunction")
            return apex_ln.apply(input, weight, self.bias, self.normalized_shape, self.eps)
        if len(self.normalized_shape) != 1:
            return F.layer_norm(input, self.normalized_shape, weight, self.bias, self.eps)
        # Megatron always runs a fused norm kernel; without apex the torch.compile'd one where available.
        return fused_kernels.LAYER_NORM(input, weight, self.bias, self.eps, flag_hint="no apex")


class RMSNorm(torch.nn.Module):
    """``x / sqrt(mean(x^2) + eps) * w`` computed in fp32 (Megatron's legacy ``RMSNorm(dim, eps, sequence_parallel)``)."""

    def __init__(self, dim: int, eps: float = 1e-6, sequence_parallel: bool = False,
                 apply_layernorm_1p: bool = False, *, params_dtype=None, param_device_=None):
        super().__init__()
        self.eps = eps
        self.apply_layernorm_1p = apply_layernorm_1p
        self.sequence_parallel = sequence_parallel
        self.weight = Parameter(torch.empty(dim, dtype=params_dtype or torch.float32, device=param_device_))
        self.reset_parameters()
        _mark_sequence_parallel(self, sequence_parallel)

    def reset_parameters(self):
        with torch.no_grad():
            self.weight.fill_(0.0 if self.apply_layernorm_1p else 1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight + 1 if self.apply_layernorm_1p else self.weight
        return fused_kernels.RMS_NORM(x, weight, self.eps)


def get_norm(config, hidden_size=None, eps=None):
    """The norm ``config.normalization`` asks for, with Megatron's options taken from ``config``."""
    hidden_size = hidden_size if hidden_size is not None else config.hidden_size
    eps = config.layernorm_epsilon if eps is None else eps
    common = dict(sequence_parallel=config.sequence_parallel, apply_layernorm_1p=config.layernorm_zero_centered_gamma,
                  params_dtype=config.params_dtype, param_device_=param_device(config))
    if config.normalization == "LayerNorm":
        return LayerNorm(hidden_size, eps=eps, no_persist_layer_norm=not config.persist_layer_norm, **common)
    if config.normalization == "RMSNorm":
        return RMSNorm(hidden_size, eps=eps, **common)
    raise ValueError(f"normalization must be 'LayerNorm' or 'RMSNorm' (--normalization), got {config.normalization!r}")


class FusedLayerNorm:
    """megatron-core spec entry for the layer's norms: ``FusedLayerNorm(config, hidden_size, eps=None,
    persist_layer_norm=True, zero_centered_gamma=None, normalization=None)`` builds :func:`get_norm` — a
    :class:`LayerNorm` or :class:`RMSNorm` — with the config's ``normalization`` / ``layernorm_zero_centered_gamma`` /
    ``layernorm_epsilon`` unless given (megatron-core's later ``LNImpl``/``TENorm`` behave the same way).
    ``persist_layer_norm`` picks one of apex's kernels on GPUs; the result does not depend on it.
    """

    def __new__(cls, config, hidden_size, eps=None, persist_layer_norm: bool = True, zero_centered_gamma=None,
                normalization=None):
        changes = {}
        if normalization is not None and normalization != config.normalization:
            changes["normalization"] = normalization
        if zero_centered_gamma is not None and zero_centered_gamma != config.layernorm_zero_centered_gamma:
            changes["layernorm_zero_centered_gamma"] = zero_centered_gamma
        if changes:
            import dataclasses

            config = dataclasses.replace(config, **changes)
        return get_norm(config, hidden_size, eps)
