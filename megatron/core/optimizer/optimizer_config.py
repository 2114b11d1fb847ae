"""OptimizerConfig: the optimizer flags of Megatron-LM as a dataclass (no global args)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch


@dataclass
class OptimizerConfig:
    """Settings of :func:`megatron.core.optimizer.get_megatron_optimizer`.

    Flag names in brackets: optimizer (--optimizer adam|sgd), lr / min_lr (--lr, --min-lr), weight_decay
    (--weight-decay), fp16 / bf16 (--fp16, --bf16), loss_scale (--loss-scale; None means dynamic for fp16),
    initial_loss_scale, min_loss_scale, loss_scale_window, hysteresis (the dynamic scaler), adam_beta1/2,
    adam_eps, sgd_momentum, use_distributed_optimizer (--use-distributed-optimizer), clip_grad
    (--clip-grad; 0 disables clipping), log_num_zeros_in_grad (--log-num-zeros-in-grad),
    barrier_with_L1_time and timers (Megatron's timers object, optional).
    """

    optimizer: str = "adam"
    lr: Optional[float] = None
    min_lr: Optional[float] = None
    # --decoupled-lr / --decoupled-min-lr: max / min lr of the parameters marked is_embedding_or_output_parameter
    # (min falls back to min_lr).
    decoupled_lr: Optional[float] = None
    decoupled_min_lr: Optional[float] = None
    # With --overlap-param-gather: dispatch the first model chunk's first parameter all-gather right after
    # the step (--overlap-param-gather-with-optimizer-step).
    overlap_param_gather_with_optimizer_step: bool = False
    weight_decay: float = 0.01

    fp16: bool = False
    bf16: bool = False
    params_dtype: torch.dtype = torch.float32

    loss_scale: Optional[float] = None
    initial_loss_scale: float = 2 ** 32
    min_loss_scale: float = 1.0
    loss_scale_window: float = 1000
    hysteresis: int = 2

    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-08
    sgd_momentum: float = 0.9

    use_distributed_optimizer: bool = False
    clip_grad: float = 1.0
    log_num_zeros_in_grad: bool = False
    barrier_with_L1_time: bool = False
    timers: Optional[Callable] = None

    def __post_init__(self):
        if self.fp16 and self.bf16:
            raise ValueError("OptimizerConfig: --fp16 and --bf16 cannot both be set")
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"OptimizerConfig: --optimizer must be 'adam' or 'sgd', got {self.optimizer!r}")
        if self.loss_scale is not None and self.loss_scale <= 0:
            raise ValueError(f"OptimizerConfig: --loss-scale must be positive, got {self.loss_scale}")
        if self.clip_grad < 0:
            raise ValueError(f"OptimizerConfig: --clip-grad must be >= 0 (0 disables clipping), got {self.clip_grad}")


@dataclass
class AdamOptimizerConfig(OptimizerConfig):
    """An :class:`OptimizerConfig` for Adam (``optimizer='adam'``; ``adam_beta1/2``, ``adam_eps``)."""

    optimizer: str = "adam"


@dataclass
class SGDOptimizerConfig(OptimizerConfig):
    """An :class:`OptimizerConfig` for SGD with momentum (``optimizer='sgd'``; ``sgd_momentum``)."""

    optimizer: str = "sgd"
