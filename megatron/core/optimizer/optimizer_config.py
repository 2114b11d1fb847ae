"""OptimizerConfig: the optimizer flags of Megatron-LM as a dataclass (no global args); ParamKey: which
parameters a per-group override (``ParamGroupOverride``) applies to."""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Callable, Optional, Tuple, Union

import torch


@dataclass(frozen=True)
class ParamPredicate:
    """A named test ``fn(param) -> bool`` that can sit in a :class:`ParamKey`: equality and hash use ``name``
    only (two predicates of one name are the same key), calling it calls ``fn``."""

    name: str
    fn: Callable[[torch.nn.Parameter], bool] = field(compare=False, hash=False)

    def __call__(self, param: torch.nn.Parameter) -> bool:
        return self.fn(param)


@dataclass(frozen=True)
class ParamWithNamePredicate:
    """Like :class:`ParamPredicate` for a test that also sees the parameter's name: ``fn(param, name) -> bool``
    (e.g. "1-D, but not a q/k layernorm weight"). Equality and hash use ``name`` only."""

    name: str
    fn: Callable[[torch.nn.Parameter, str], bool] = field(compare=False, hash=False)

    def __call__(self, param: torch.nn.Parameter, name: str) -> bool:
        return self.fn(param, name)


def _as_tuple(value) -> tuple:
    return value if isinstance(value, tuple) else (value,)


@dataclass(frozen=True, slots=True)
class ParamKey:
    """Selects parameters for a ``config_overrides`` entry; hashable, so it can key a dict.

    A parameter named ``param_name`` matches when ANY of these holds: it matches one of the shell-style patterns
    ``name`` (``fnmatch``, e.g. ``"*.bias"``); one of the attributes ``attr`` is truthy on it (e.g.
    ``"is_embedding_or_output_parameter"``); one of the ``predicate`` s returns True on it; one of the
    ``with_name_predicate`` s returns True on ``(param, param_name)``. Each field is one value or a tuple;
    an empty key matches nothing.
    """

    name: Union[str, Tuple[str, ...]] = field(default_factory=tuple)
    attr: Union[str, Tuple[str, ...]] = field(default_factory=tuple)
    predicate: Union[ParamPredicate, Tuple[ParamPredicate, ...]] = field(default_factory=tuple)
    with_name_predicate: Union[ParamWithNamePredicate, Tuple[ParamWithNamePredicate, ...]] = field(
        default_factory=tuple)

    def matches(self, param: torch.nn.Parameter, param_name: str) -> bool:
        """True if ``param`` (called ``param_name`` in its module) is selected by this key."""
        return (any(fnmatch.fnmatch(param_name, pattern) for pattern in _as_tuple(self.name))
                or any(getattr(param, attr, False) for attr in _as_tuple(self.attr))
                or any(predicate(param) for predicate in _as_tuple(self.predicate))
                or any(predicate(param, param_name) for predicate in _as_tuple(self.with_name_predicate)))


@dataclass
class OptimizerConfig:
    """Settings of :func:`megatron.core.optimizer.get_megatron_optimizer`.

    Flag names in brackets: optimizer (--optimizer adam|sgd; muon|dist_muon are built by
    ``megatron.core.optimizer.muon.get_megatron_muon_optimizer``), lr / min_lr (--lr, --min-lr), weight_decay
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
    # --apply-wd-to-qk-layernorm: the standard overrides (get_standard_config_overrides) keep weight decay on the
    # q/k layernorm weights while skipping it on the other 1-D parameters and biases.
    apply_wd_to_qk_layernorm: bool = False
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

    # Muon (megatron.core.optimizer.muon.get_megatron_muon_optimizer): momentum EMA coefficient, Nesterov, split
    # the fused QKV weight into its q / k / v blocks, update scale mode (spectral | unit_rms_norm |
    # shape_scaling), the fp32 matmul precision of the Newton-Schulz iteration (medium: bf16 products), its
    # number of steps, the TP mode (blockwise | duplicated | distributed) and an extra scale of the update.
    muon_momentum: float = 0.95
    muon_split_qkv: bool = True
    muon_use_nesterov: bool = False
    muon_scale_mode: str = "spectral"
    muon_fp32_matmul_prec: str = "medium"
    muon_num_ns_steps: int = 5
    muon_tp_mode: str = "blockwise"
    muon_extra_scale_factor: float = 1.0

    use_distributed_optimizer: bool = False
    clip_grad: float = 1.0
    log_num_zeros_in_grad: bool = False
    barrier_with_L1_time: bool = False
    timers: Optional[Callable] = None
    config_logger_dir: str = ""  # --config-logger-dir: the optimizer's constructor arguments are dumped there

    def __post_init__(self):
        if self.fp16 and self.bf16:
            raise ValueError("OptimizerConfig: --fp16 and --bf16 cannot both be set")
        if self.optimizer not in ("adam", "sgd", "muon", "dist_muon"):
            raise ValueError(f"OptimizerConfig: --optimizer must be 'adam', 'sgd', 'muon' or 'dist_muon', "
                             f"got {self.optimizer!r}")
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
