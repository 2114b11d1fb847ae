"""OptimizerParamScheduler: learning-rate warmup/decay and weight-decay increment, as in Megatron-LM.

Steps are whatever the caller counts; Megatron's training loop counts *samples* (it calls
``step(increment=global_batch_size)`` after each successful iteration and passes warmup/decay lengths in
samples). With ``n`` = steps so far, ``W`` = warmup steps, ``D`` = decay steps:

* warmup (``W > 0`` and ``n <= W``): ``lr = init_lr + (max_lr - init_lr) * n / W``
* ``constant``: ``max_lr`` after warmup
* ``n > D``: ``min_lr``
* ``inverse-square-root``: ``max(min_lr, max_lr * sqrt(max(W, 1)) / sqrt(max(n, 1)))``
* otherwise, with ``r = (n - W) / (D - W)``: ``lr = min_lr + c * (max_lr - min_lr)`` where
  ``c = 1 - r`` (``linear``) or ``c = (cos(pi * r) + 1) / 2`` (``cosine``); ``WSD`` keeps ``c = 1`` until the
  last ``wsd_decay_steps`` steps before ``D`` and then anneals with ``lr_wsd_decay_style`` over them.

Weight decay, with ``I`` = increment steps and ``r = n / I``: ``end_wd`` once ``n > I``; otherwise
``start_wd + c * (end_wd - start_wd)`` with ``c = r`` (``linear``) or ``(cos(pi * (1 - r)) + 1) / 2``
(``cosine``); ``constant`` requires ``start_wd == end_wd``.

Each param group gets ``lr * group['lr_mult']`` and ``wd * group['wd_mult']`` (both default 1), where ``lr`` is
computed with the group's own ``max_lr`` / ``min_lr`` when it has them (``--decoupled-lr`` /
``--decoupled-min-lr`` groups of the embedding and output weights, or a ``ParamGroupOverride``) and the
scheduler's otherwise; warmup always starts from ``init_lr``. Likewise ``wd`` uses the group's own ``start_wd`` /
``end_wd`` when a ``ParamGroupOverride`` set them.
"""
from __future__ import annotations

import math
from typing import Any, List, Optional, Tuple, TypedDict

import torch

from megatron.core.utils import print_rank_0

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WD_INCR_STYLES = ("constant", "linear", "cosine")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")


class ParamGroupOverride(TypedDict, total=False):
    """Per-parameter-group settings that replace the optimizer's / scheduler's defaults for the parameters a
    :class:`~megatron.core.optimizer.optimizer_config.ParamKey` matches (``get_megatron_optimizer``'s
    ``config_overrides``). The scheduler reads ``max_lr`` / ``min_lr`` in ``get_lr``, ``start_wd`` / ``end_wd``
    in ``get_wd`` and multiplies the weight decay by ``wd_mult``; any other key (``lr_mult``, an optimizer
    hyper-parameter) is copied into the param group as well. A plain dict: ``ParamGroupOverride(wd_mult=0.0)``.
    """

    max_lr: float
    min_lr: float
    start_wd: float
    end_wd: float
    wd_mult: float


def get_canonical_lr_for_logging(param_groups: List[dict]) -> Optional[float]:
    """The ``lr`` of the first param group flagged ``default_config`` (the groups whose learning rate follows the
    scheduler's own max / min lr, which all share one value), or None when no group is flagged."""
    return next((group.get("lr") for group in param_groups if group.get("default_config", False)), None)


def param_group_override_to_tuple(param_group_override: Optional[ParamGroupOverride]
                                  ) -> Optional[Tuple[Tuple[str, Any], ...]]:
    """A hashable form of an override: its ``(key, value)`` items sorted by key, so that two dicts with the same
    entries in another order give the same tuple; None stays None."""
    if param_group_override is None:
        return None
    return tuple(sorted(param_group_override.items()))


def combine_param_group_overrides(param_group_overrides: List[Optional[ParamGroupOverride]]) -> ParamGroupOverride:
    """Merge the overrides of every ParamKey a parameter matched into one (None entries skipped).

    A key set by several overrides must have one value; different values raise ``ValueError`` naming the key.
    """
    combined: ParamGroupOverride = ParamGroupOverride()
    for override in param_group_overrides:
        for key, value in (override or {}).items():
            if key in combined and combined[key] != value:
                raise ValueError(f"Conflicting overrides for {key}: {combined[key]} and {value}")
            combined[key] = value
    return combined



class OptimizerParamScheduler:
    def __init__(self, optimizer, init_lr: float, max_lr: float, min_lr: float, lr_warmup_steps: int,
                 lr_decay_steps: int, lr_decay_style: str, start_wd: float, end_wd: float, wd_incr_steps: int,
                 wd_incr_style: str, use_checkpoint_opt_param_scheduler: bool = True,
                 override_opt_param_scheduler: bool = False, *, wsd_decay_steps: Optional[int] = None,
                 lr_wsd_decay_style: Optional[str] = None):
        self.optimizer = optimizer

        self.init_lr = init_lr
        self.max_lr = float(max_lr)
        self.min_lr = min_lr
        if self.min_lr < 0.0:
            raise ValueError(f"--min-lr must be >= 0, got {self.min_lr}")
        if self.max_lr < self.min_lr:
            raise ValueError(f"--lr ({self.max_lr}) must be >= --min-lr ({self.min_lr})")
        if self.init_lr > self.max_lr:
            raise ValueError(f"--lr-warmup-init ({self.init_lr}) must be <= --lr ({self.max_lr})")

        self.lr_warmup_steps = lr_warmup_steps
        self.num_steps = 0
        self.lr_decay_steps = lr_decay_steps
        if self.lr_decay_steps <= 0:
            raise ValueError(f"the number of learning-rate decay steps must be positive, got {self.lr_decay_steps} "
                             f"(set --lr-decay-iters / --lr-decay-samples or --train-iters / --train-samples)")
        if self.lr_warmup_steps >= self.lr_decay_steps:
            raise ValueError(f"learning-rate warmup ({self.lr_warmup_steps} steps) must be shorter than the decay "
                             f"({self.lr_decay_steps} steps): check --lr-warmup-* and --lr-decay-*")
        if lr_decay_style not in LR_DECAY_STYLES:
            raise ValueError(f"--lr-decay-style {lr_decay_style!r} is not supported; choose from {LR_DECAY_STYLES}")
        self.lr_decay_style = lr_decay_style
        self.wsd_decay_steps = wsd_decay_steps
        self.lr_wsd_decay_style = lr_wsd_decay_style
        if lr_decay_style == "WSD":
            if not wsd_decay_steps or wsd_decay_steps <= 0 or wsd_decay_steps > lr_decay_steps:
                raise ValueError("--lr-decay-style WSD needs 0 < wsd_decay_steps <= lr_decay_steps "
                                 "(--lr-wsd-decay-iters / --lr-wsd-decay-samples)")
            if lr_wsd_decay_style not in WSD_DECAY_STYLES:
                raise ValueError(f"--lr-wsd-decay-style must be one of {WSD_DECAY_STYLES}, got {lr_wsd_decay_style!r}")

        self.start_wd = start_wd
        self.end_wd = end_wd
        if self.start_wd < 0.0:
            raise ValueError(f"--start-weight-decay must be >= 0, got {self.start_wd}")
        if self.end_wd < self.start_wd:
            raise ValueError(f"--end-weight-decay ({self.end_wd}) must be >= --start-weight-decay ({self.start_wd})")
        if wd_incr_style not in WD_INCR_STYLES:
            raise ValueError(f"--weight-decay-incr-style {wd_incr_style!r} is not supported; "
                             f"choose from {WD_INCR_STYLES}")
        self.wd_incr_steps = wd_incr_steps
        self.wd_incr_style = wd_incr_style

        self.override_opt_param_scheduler = override_opt_param_scheduler
        self.use_checkpoint_opt_param_scheduler = use_checkpoint_opt_param_scheduler
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            raise ValueError("both --override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler are set")

        self.step(0)
        print_rank_0(f"> learning rate decay style: {self.lr_decay_style}")

    # ------------------------------------------------------------------------------ schedules
    def get_wd(self, param_group: Optional[dict] = None) -> float:
        """The weight decay after ``num_steps`` steps, for ``param_group``'s start / end wd if it sets them."""
        start_wd = param_group.get("start_wd", self.start_wd) if param_group else self.start_wd
        end_wd = param_group.get("end_wd", self.end_wd) if param_group else self.end_wd
        if self.num_steps > self.wd_incr_steps:
            return end_wd
        if self.wd_incr_style == "constant":
            if start_wd != end_wd:
                raise ValueError("constant weight decay needs --start-weight-decay == --end-weight-decay")
            return end_wd
        incr_ratio = float(self.num_steps) / float(self.wd_incr_steps)
        if self.wd_incr_style == "linear":
            coeff = incr_ratio
        else:  # cosine
            coeff = 0.5 * (math.cos(math.pi * (1 - incr_ratio)) + 1.0)
        return start_wd + coeff * (end_wd - start_wd)

    def get_lr(self, param_group: Optional[dict] = None) -> float:
        """The learning rate after ``num_steps`` steps, for ``param_group``'s max/min lr if it sets them."""
        max_lr = param_group.get("max_lr", self.max_lr) if param_group else self.max_lr
        min_lr = param_group.get("min_lr", self.min_lr) if param_group else self.min_lr
        if self.lr_warmup_steps > 0 and self.num_steps <= self.lr_warmup_steps:
            return self.init_lr + (max_lr - self.init_lr) * float(self.num_steps) / float(self.lr_warmup_steps)
        if self.lr_decay_style == "constant":
            return max_lr
        if self.num_steps > self.lr_decay_steps:
            return min_lr
        if self.lr_decay_style == "inverse-square-root":
            warmup_steps = max(self.lr_warmup_steps, 1)
            num_steps = max(self.num_steps, 1)
            return max(min_lr, max_lr * warmup_steps ** 0.5 / num_steps ** 0.5)

        decay_ratio = float(self.num_steps - self.lr_warmup_steps) / float(self.lr_decay_steps - self.lr_warmup_steps)
        delta_lr = max_lr - min_lr
        if self.lr_decay_style == "linear":
            coeff = 1.0 - decay_ratio
        elif self.lr_decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
        else:  # WSD: warmup, stable at max_lr, then anneal over the last wsd_decay_steps steps
            anneal_start = self.lr_decay_steps - self.wsd_decay_steps
            if self.num_steps <= anneal_start:
                coeff = 1.0
            else:
                ratio = float(self.num_steps - anneal_start) / float(self.wsd_decay_steps)
                if self.lr_wsd_decay_style == "linear":
                    coeff = 1.0 - ratio
                elif self.lr_wsd_decay_style == "cosine":
                    coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
                elif self.lr_wsd_decay_style == "exponential":
                    coeff = 2.0 * math.pow(0.5, ratio) - 1.0
                else:  # minus_sqrt
                    coeff = 1.0 - math.sqrt(ratio)
        return min_lr + coeff * delta_lr

    def step(self, increment: int):
        """Advance by ``increment`` steps and write lr / weight decay into every param group."""
        self.num_steps += increment
        for group in self.optimizer.param_groups:
            group["lr"] = self.get_lr(group) * group.get("lr_mult", 1.0)
            group["weight_decay"] = self.get_wd(group) * group.get("wd_mult", 1.0)

    # ------------------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        return {
            "max_lr": self.max_lr,
            "lr_warmup_steps": self.lr_warmup_steps,
            "num_steps": self.num_steps,
            "lr_decay_style": self.lr_decay_style,
            "lr_decay_steps": self.lr_decay_steps,
            "min_lr": self.min_lr,
            "start_wd": self.start_wd,
            "end_wd": self.end_wd,
            "wd_incr_style": self.wd_incr_style,
            "wd_incr_steps": self.wd_incr_steps,
        }

    def _check_and_set(self, cls_value, sd_value, name: str):
        """Which of the constructor's value and the checkpoint's to keep (see the two flags)."""
        if self.override_opt_param_scheduler:
            print_rank_0(f" > overriding {name} value to {cls_value}")
            return cls_value
        if not self.use_checkpoint_opt_param_scheduler and cls_value != sd_value:
            raise ValueError(
                f"OptimizerParamScheduler: class input value {cls_value} and checkpoint value {sd_value} for {name} "
                f"do not match; pass --override-opt_param-scheduler to use the command-line value or "
                f"--use-checkpoint-opt_param-scheduler to use the checkpoint's")
        print_rank_0(f" > using checkpoint value {sd_value} for {name}")
        return sd_value

    def load_state_dict(self, state_dict: dict):
        sd = state_dict
        # Older checkpoints used other key names; read whichever is there.
        max_lr = sd["start_lr"] if "start_lr" in sd else sd["max_lr"]
        self.max_lr = self._check_and_set(self.max_lr, max_lr, "learning rate")
        self.min_lr = self._check_and_set(self.min_lr, sd["min_lr"], "minimum learning rate")
        warmup = sd.get("warmup_iter", sd.get("warmup_steps", sd.get("lr_warmup_steps")))
        self.lr_warmup_steps = self._check_and_set(self.lr_warmup_steps, warmup, "warmup iterations")
        decay = sd.get("end_iter", sd.get("decay_steps", sd.get("lr_decay_steps")))
        self.lr_decay_steps = self._check_and_set(self.lr_decay_steps, decay, "total number of iterations")
        style = sd["decay_style"] if "decay_style" in sd else sd["lr_decay_style"]
        self.lr_decay_style = self._check_and_set(self.lr_decay_style, style, "learning rate decay style")
        if "start_wd" in sd:
            self.start_wd = self._check_and_set(self.start_wd, sd["start_wd"], "start weight decay")
            self.end_wd = self._check_and_set(self.end_wd, sd["end_wd"], "end weight decay")
            self.wd_incr_steps = self._check_and_set(self.wd_incr_steps, sd["wd_incr_steps"],
                                                     "total number of weight decay iterations")
            self.wd_incr_style = self._check_and_set(self.wd_incr_style, sd["wd_incr_style"],
                                                     "weight decay incr style")
        num_steps = sd["num_iters"] if "num_iters" in sd else sd["num_steps"]
        # Set (not add to) the step count, then write the resulting lr / wd into the param groups.
        self.num_steps = 0
        self.step(increment=num_steps)
