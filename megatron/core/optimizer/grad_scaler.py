"""Loss scalers for fp16 training (Megatron's grad_scaler.py semantics and state_dict keys).

The loss is multiplied by ``scale`` before backward so that small fp16 gradients do not underflow; the
optimizer multiplies the gradients by ``inv_scale`` before using them. The dynamic scaler halves the scale
(``backoff_factor``) once it has seen ``hysteresis`` overflowing steps (not necessarily consecutive: the
count is only restored when the scale grows), and doubles it (``growth_factor``) after
``growth_interval`` consecutive steps without overflow.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from megatron.core import device as _device


class MegatronGradScaler(ABC):
    def __init__(self, initial_scale: float):
        if initial_scale <= 0.0:
            raise ValueError(f"the initial loss scale must be positive, got {initial_scale}")
        self._scale = torch.tensor([float(initial_scale)], dtype=torch.float32, device=_device.current_device())

    @property
    def scale(self) -> torch.Tensor:
        return self._scale

    @property
    def inv_scale(self) -> torch.Tensor:
        return self._scale.double().reciprocal().float()

    @abstractmethod
    def update(self, found_inf: bool):
        ...

    @abstractmethod
    def state_dict(self) -> dict:
        ...

    @abstractmethod
    def load_state_dict(self, state_dict: dict):
        ...


class ConstantGradScaler(MegatronGradScaler):
    """``--loss-scale S``: the scale never changes (overflowing steps are still skipped)."""

    def update(self, found_inf: bool):
        pass

    def state_dict(self) -> dict:
        return dict()

    def load_state_dict(self, state_dict: dict):
        pass


class DynamicGradScaler(MegatronGradScaler):
    def __init__(self, initial_scale: float, min_scale: float, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 1000, hysteresis: int = 2):
        super().__init__(initial_scale)
        if not 0.0 < min_scale <= initial_scale:
            raise ValueError(f"--min-loss-scale ({min_scale}) must be positive and <= the initial loss scale "
                             f"({initial_scale})")
        if growth_factor <= 1.0:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if growth_interval <= 0:
            raise ValueError(f"--loss-scale-window must be positive, got {growth_interval}")
        if hysteresis <= 0:
            raise ValueError(f"--hysteresis must be positive, got {hysteresis}")
        self.min_scale = torch.tensor([float(min_scale)], dtype=torch.float32, device=self._scale.device)
        self.growth_factor = torch.tensor([float(growth_factor)], dtype=torch.float32, device=self._scale.device)
        self.backoff_factor = torch.tensor([float(backoff_factor)], dtype=torch.float32, device=self._scale.device)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis

    def update(self, found_inf: bool):
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = torch.max(self._scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._scale = self._scale * self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self._scale, "growth_tracker": self._growth_tracker,
                "hysteresis_tracker": self._hysteresis_tracker}

    def load_state_dict(self, state_dict: dict):
        self._scale = state_dict["scale"].to(self._scale.device)
        self._growth_tracker = state_dict["growth_tracker"]
        self._hysteresis_tracker = state_dict["hysteresis_tracker"]
