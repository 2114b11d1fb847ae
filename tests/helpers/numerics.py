"""The one relative-error measure of the tests: ``max |actual - expected| / max |expected|``."""
from __future__ import annotations

import torch


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |a - e| / max |e| over all elements, in float64 (the absolute difference when ``expected`` is all 0)."""
    actual = torch.as_tensor(actual).detach().double()
    expected = torch.as_tensor(expected).detach().double()
    scale = expected.abs().max().item()
    diff = (actual - expected).abs().max().item()
    return diff / scale if scale > 0 else diff
