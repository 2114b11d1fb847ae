"""Activation functions selected by flags: ``--openai-gelu`` (tanh GeLU), ``--onnx-safe`` (erf GeLU),
``--squared-relu``, ``--quick-geglu`` (quick GeLU, gated)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def openai_gelu(x: torch.Tensor) -> torch.Tensor:
    """GeLU with the tanh approximation (``--openai-gelu``; GPT-2's ``gelu_new``)."""
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.044715 * torch.pow(x, 3.0))))


def erf_gelu(x: torch.Tensor) -> torch.Tensor:
    """Exact GeLU written with erf only (``--onnx-safe``)."""
    return x * 0.5 * (torch.erf(x / 1.41421).to(dtype=x.dtype) + torch.ones_like(x).to(dtype=x.dtype))


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    return torch.pow(F.relu(x), 2)


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(1.702 x)``, the sigmoid approximation of GeLU (gpt-oss's gate, ``--quick-geglu``)."""
    return x * torch.sigmoid(1.702 * x)



# megatron-core's name for the same tanh approximation.
fast_gelu = openai_gelu
