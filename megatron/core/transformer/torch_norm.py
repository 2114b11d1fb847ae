"""PyTorch's own norms as spec entries (megatron-core's ``megatron.core.transformer.torch_norm``).

``WrappedTorchNorm(config, hidden_size, eps=1e-5, ...)`` builds ``torch.nn.LayerNorm`` or ``torch.nn.RMSNorm`` of
``config.normalization`` (plain torch modules: no zero-centred gamma, no sequence-parallel marking — refused with one
line when the config asks for them). ``L2Norm``: ``x / sqrt(mean(x^2) + eps)`` over the last dimension, computed in
fp32 and returned in the input's dtype (no weight).
"""
from __future__ import annotations

import torch


class WrappedTorchNorm:
    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm"):
        unsupported = [flag for flag, on in (("--apply-layernorm-1p", config.layernorm_zero_centered_gamma),
                                             ("--sequence-parallel", config.sequence_parallel)) if on]
        if unsupported:
            raise ValueError(f"WrappedTorchNorm (torch.nn norms) does not support {', '.join(unsupported)}: use the "
                             "local spec's FusedLayerNorm")
        if config.normalization == "LayerNorm":
            norm_cls = torch.nn.LayerNorm
        elif config.normalization == "RMSNorm":
            norm_cls = torch.nn.RMSNorm
        elif config.normalization == "L2Norm":
            return L2Norm(hidden_size, eps)
        else:
            raise ValueError(f"normalization must be LayerNorm, RMSNorm or L2Norm, got {config.normalization!r}")
        return norm_cls(normalized_shape=hidden_size, eps=eps, dtype=config.params_dtype)


class L2Norm(torch.nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)
