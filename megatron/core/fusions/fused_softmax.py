"""Scale + mask + softmax of attention scores ``[b, np, sq, sk]`` (Megatron's ``FusedScaleMaskSoftmax``).

Masks are boolean, True = masked; masked scores are set to -10000 before the softmax. Megatron's fused CUDA
softmax kernels are not built in this library: the PyTorch computation of the same function runs.
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron.core.utils import log_once
from megatron.core.enums import AttnMaskType


def attention_mask_func(attention_scores: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Megatron's masking: boolean mask, True = masked, filled with -10000 before the softmax."""
    attention_scores.masked_fill_(attention_mask, -10000.0)
    return attention_scores


def causal_mask(sq: int, sk: int, device_=None) -> torch.Tensor:
    """Boolean ``[1, 1, sq, sk]`` mask, True above the diagonal aligned to the last key (KV-cache aware)."""
    rows = torch.arange(sq, device=device_).unsqueeze(1) + (sk - sq)
    cols = torch.arange(sk, device=device_).unsqueeze(0)
    return (cols > rows).view(1, 1, sq, sk)


class FusedScaleMaskSoftmax(torch.nn.Module):
    """scale -> mask -> softmax over ``[b, np, sq, sk]`` scores (Megatron's class and arguments).

    Megatron's fused CUDA softmax kernels are not part of this library; with ``scaled_masked_softmax_fusion``
    requested the PyTorch path runs, which computes the same function (printed once).
    """

    def __init__(self, input_in_fp16, input_in_bf16, attn_mask_type, scaled_masked_softmax_fusion, mask_func,
                 softmax_in_fp32, scale):
        super().__init__()
        self.input_in_fp16 = input_in_fp16
        self.input_in_bf16 = input_in_bf16
        if self.input_in_fp16 and self.input_in_bf16:
            raise RuntimeError("both fp16 and bf16 flags cannot be active at the same time.")
        self.input_in_float16 = self.input_in_fp16 or self.input_in_bf16
        self.attn_mask_type = attn_mask_type
        self.scaled_masked_softmax_fusion = scaled_masked_softmax_fusion
        self.mask_func = mask_func
        self.softmax_in_fp32 = softmax_in_fp32
        self.scale = scale
        if not (self.scale is None or softmax_in_fp32):
            raise RuntimeError("softmax should be in fp32 when scaled")

    def forward(self, input: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        assert input.dim() == 4, "attention scores must be [b, np, sq, sk]"
        if self.scaled_masked_softmax_fusion:
            log_once("masked_softmax", "masked softmax: PyTorch implementation (Megatron's fused CUDA softmax "
                                       "kernels are not built in this library)")
        if self.input_in_float16 and self.softmax_in_fp32:
            input = input.float()
        if self.scale is not None:
            input = input * self.scale
        if mask is None and self.attn_mask_type == AttnMaskType.causal:
            mask = causal_mask(input.size(2), input.size(3), input.device)
        mask_output = self.mask_func(input, mask) if mask is not None else input
        probs = torch.nn.Softmax(dim=-1)(mask_output)
        if self.input_in_float16 and self.softmax_in_fp32:
            probs = probs.half() if self.input_in_fp16 else probs.bfloat16()
        return probs


__all__ = ["FusedScaleMaskSoftmax", "attention_mask_func", "causal_mask"]
