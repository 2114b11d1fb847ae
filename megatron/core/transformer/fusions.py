"""Element-wise fusions of the transformer, each with a plain-PyTorch fallback.

* bias + GeLU (Megatron's tanh approximation with a hand-written backward),
* bias + dropout + residual add,
* scale + mask + softmax of attention scores.

Megatron fuses the first two with TorchScript and the softmax with custom CUDA kernels. TorchScript is
deprecated in current PyTorch, so the fused variants here are ``torch.compile``d versions of the very same
functions, used on GPU (where compiling pays off); on CPU the eager functions run (compiling costs seconds
per shape and gains nothing measurable there). Which implementation runs is printed once per process.
"""
from __future__ import annotations

import os
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from megatron.core import device
from megatron.core.transformer.enums import AttnMaskType

_LOGGED = set()


def log_once(key: str, message: str) -> None:
    """Print ``message`` the first time ``key`` is seen in this process (on rank 0 only)."""
    if key in _LOGGED:
        return
    _LOGGED.add(key)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        if torch.distributed.get_rank() != 0:
            return
    print(f"> {message}", flush=True)


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


# ------------------------------------------------------------------------------------------ bias + GeLU

def bias_gelu(bias: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """GeLU(y + bias) with the tanh approximation (sqrt(2/pi) = 0.79788456) Megatron fuses."""
    x = bias + y
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


def bias_gelu_back(g: torch.Tensor, bias: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """d GeLU(x)/dx * g for x = y + bias, in closed form (0.1070322243 = 3 * 0.044715 * sqrt(2/pi))."""
    x = bias + y
    tanh_out = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
    ff = 0.5 * x * ((1 - tanh_out * tanh_out) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + tanh_out)
    return ff * g


class GeLUFunction(torch.autograd.Function):
    """bias-GeLU. Compiled: backward recomputes from (input, bias) instead of saving the intermediate sum. Eager:
    the sum ``bias + input`` is saved instead of ``input`` (the same size: nothing else keeps ``input``), so the
    backward does not add the bias a second time."""

    @staticmethod
    def forward(ctx, input, bias, use_compiled=False):
        ctx.use_compiled = use_compiled
        ctx.bias_is_vector = bias.dim() == 1
        if use_compiled:
            ctx.save_for_backward(input, bias)
            return compiled(bias_gelu)(bias, input)
        # Eager: aten's tanh-approximation GeLU is the same function in one native kernel, where the formula
        # above makes ~10 elementwise passes over [s, b, 4h/tp] (a third of a CPU training step's time).
        biased = bias + input
        ctx.save_for_backward(biased)
        return F.gelu(biased, approximate="tanh")

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.use_compiled:
            input, bias = ctx.saved_tensors
            tmp = compiled(bias_gelu_back)(grad_output, bias, input)
        else:
            (biased,) = ctx.saved_tensors
            tmp = torch.ops.aten.gelu_backward(grad_output, biased, approximate="tanh")
        grad_bias = tmp.reshape(-1, tmp.shape[-1]).sum(dim=0) if ctx.bias_is_vector else tmp
        return tmp, grad_bias, None


def bias_gelu_impl(input: torch.Tensor, bias: torch.Tensor, use_compiled: Optional[bool] = None) -> torch.Tensor:
    """Fused bias-GeLU (``--bias-gelu-fusion``); compiled where :func:`compile_blocker` allows, else eager."""
    if use_compiled is None:
        reason = compile_blocker(input.is_cuda)
        use_compiled = reason is None
        log_once(f"bias_gelu:{use_compiled}", "using torch.compile fused bias-GeLU" if use_compiled
                 else f"using plain bias-GeLU (hand-written backward): {reason}")
    return GeLUFunction.apply(input, bias, use_compiled)


def openai_gelu(x: torch.Tensor) -> torch.Tensor:
    """GeLU with the tanh approximation (``--openai-gelu``; GPT-2's ``gelu_new``)."""
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.044715 * torch.pow(x, 3.0))))


def erf_gelu(x: torch.Tensor) -> torch.Tensor:
    """Exact GeLU written with erf only (``--onnx-safe``)."""
    return x * 0.5 * (torch.erf(x / 1.41421).to(dtype=x.dtype) + torch.ones_like(x).to(dtype=x.dtype))


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    return torch.pow(F.relu(x), 2)


# --------------------------------------------------------------------------- bias + dropout + residual

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


# ------------------------------------------------------------------------------- scale + mask + softmax

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
