"""Fused element-wise kernels produced by ``torch.compile`` (inductor), each with its plain PyTorch version.

Every op here is ONE plain PyTorch function; the fused kernel is ``torch.compile`` of that same function
(inductor generates Triton on CUDA, C++/OpenMP on CPU), so there is a single definition of the math and
autograd derives the backward of both. :class:`FusedOp` picks per call:

* compiled when the caller's flag asks for fusion (``config.bias_activation_fusion``,
  ``config.apply_rope_fusion``, ...; norms are always fused where possible, as Megatron always uses its
  fused norm kernels) AND the input is on CUDA AND ``torch.compile`` works;
* plain otherwise, with the reason. On CPU compiling costs seconds per shape and buys little, so plain is
  the CPU default; ``MEGATRON_COMPILE_FUSIONS_ON_CPU=1`` compiles on CPU too (the tests use it to run the
  compiled kernels), ``MEGATRON_NO_COMPILE_FUSIONS=1`` disables every compiled fusion.

The choice is printed once per op and choice: ``using torch.compile fused RMSNorm`` or
``using plain RMSNorm: <reason>``. If compiling fails (no C++ compiler, no Triton) the op logs why and
stays plain for the rest of the process.
"""
from __future__ import annotations

import os
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from megatron.core.utils import log_once

NO_COMPILE_ENV = "MEGATRON_NO_COMPILE_FUSIONS"
COMPILE_ON_CPU_ENV = "MEGATRON_COMPILE_FUSIONS_ON_CPU"


def compile_blocker(on_cuda: bool) -> Optional[str]:
    """Why a compiled fusion cannot be used for an input on this device (None when it can): every fusion
    (here and in megatron.core.fusions) asks this one function."""
    if os.environ.get(NO_COMPILE_ENV, "0") == "1":
        return f"{NO_COMPILE_ENV}=1"
    if not hasattr(torch, "compile"):
        return "torch.compile is not available in this PyTorch"
    if not on_cuda and os.environ.get(COMPILE_ON_CPU_ENV, "0") != "1":
        return f"input on CPU (compiled fusions run on CUDA; {COMPILE_ON_CPU_ENV}=1 compiles on CPU too)"
    return None


_COMPILED = {}


def compiled(fn: Callable) -> Callable:
    """``torch.compile(fn)``, built once per function (dynamic shapes, so sequence lengths may vary).

    ``fallback_random`` makes compiled dropout draw exactly the numbers eager dropout draws, so the fused
    bias-dropout-add equals the plain one bit for bit and activation recompute reproduces its masks.
    """
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=True, options={"fallback_random": True})
    return _COMPILED[fn]


class FusedOp:
    """``fn`` and ``torch.compile(fn)``, chosen per call; ``last_choice`` says which ran ('compiled'/'plain')."""

    def __init__(self, label: str, fn: Callable):
        self.label = label
        self.fn = fn
        self._compiled = None
        self._broken: Optional[str] = None  # why compiling failed; then plain for the rest of the process
        self.last_choice: Optional[str] = None

    def _compiled_fn(self) -> Callable:
        if self._compiled is None:
            # Default (automatic) dynamic shapes: the first shape compiles static; a second one compiles a
            # dynamic kernel instead of recompiling for every sequence length.
            self._compiled = torch.compile(self.fn)
        return self._compiled

    def choose(self, fused: bool, on_cuda: bool, flag_hint: str = "") -> Optional[str]:
        """None to compile, else the reason for running plain."""
        if not fused:
            return f"fusion disabled{' (' + flag_hint + ')' if flag_hint else ''}"
        if self._broken is not None:
            return self._broken
        return compile_blocker(on_cuda)

    def __call__(self, *args, fused: bool = True, flag_hint: str = "", on_cuda: Optional[bool] = None):
        if on_cuda is None:
            on_cuda = any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)
        reason = self.choose(fused, on_cuda, flag_hint)
        if reason is None:
            try:
                out = self._compiled_fn()(*args)
            except Exception as exc:  # compile-time failure (no compiler / Triton): fall back, say why
                if self.last_choice == "compiled":
                    raise  # it compiled and ran before, so this is a real error of the computation
                self._broken = f"torch.compile failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                reason = self._broken
            else:
                self.last_choice = "compiled"
                log_once(f"fused:{self.label}:compiled", f"using torch.compile fused {self.label}")
                return out
        self.last_choice = "plain"
        log_once(f"fused:{self.label}:plain:{reason}", f"using plain {self.label}: {reason}")
        return self.fn(*args)


# ------------------------------------------------------------------------------------------------ norms

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * w`` with fp32 statistics, returned in the weight's dtype."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return out.to(weight.dtype) * weight


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim; in fp32 when input and weight dtypes differ (returns the weight dtype)."""
    shape = (x.shape[-1],)
    if x.dtype != weight.dtype:
        return F.layer_norm(x.float(), shape, weight.float(), bias.float(), eps).to(weight.dtype)
    return F.layer_norm(x, shape, weight, bias, eps)


# -------------------------------------------------------------------------------------- bias + SwiGLU

def bias_swiglu(y: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``silu(a) * b`` for ``[a; b] = y + bias`` split in two along the last dim (bias may be None)."""
    if bias is not None:
        y = y + bias
    a, b = torch.chunk(y, 2, dim=-1)
    return F.silu(a) * b


# -------------------------------------------------------------------------------------------------- RoPE

def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary(t: torch.Tensor, freqs: torch.Tensor, mscale: float = 1.0) -> torch.Tensor:
    """Rotate the first ``freqs.shape[-1]`` channels of ``t`` ("rotate half" layout); pass the rest through.
    ``mscale`` multiplies cos and sin (YaRN's attention concentration; 1 otherwise)."""
    rot_dim = freqs.shape[-1]
    t_rot, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    cos = (torch.cos(freqs) * mscale).to(t.dtype)
    sin = (torch.sin(freqs) * mscale).to(t.dtype)
    t_rot = (t_rot * cos) + (_rotate_half(t_rot) * sin)
    return torch.cat((t_rot, t_pass), dim=-1)


def _rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """RoFormer's interleaved layout: ``(x[2i], x[2i+1]) -> (-x[2i+1], x[2i])``."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def rotary_interleaved(t: torch.Tensor, freqs: torch.Tensor, mscale: float = 1.0) -> torch.Tensor:
    """:func:`rotary` for the interleaved layout (``freqs`` holds each angle twice in adjacent channels)."""
    rot_dim = freqs.shape[-1]
    t_rot, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    cos = (torch.cos(freqs) * mscale).to(t.dtype)
    sin = (torch.sin(freqs) * mscale).to(t.dtype)
    t_rot = (t_rot * cos) + (_rotate_pairs(t_rot) * sin)
    return torch.cat((t_rot, t_pass), dim=-1)


RMS_NORM = FusedOp("RMSNorm", rms_norm)
LAYER_NORM = FusedOp("LayerNorm", layer_norm)
BIAS_SWIGLU = FusedOp("bias-SwiGLU", bias_swiglu)
ROTARY = FusedOp("rotary embedding", rotary)
ROTARY_INTERLEAVED = FusedOp("interleaved rotary embedding", rotary_interleaved)

ALL_OPS = [RMS_NORM, LAYER_NORM, BIAS_SWIGLU, ROTARY, ROTARY_INTERLEAVED]
