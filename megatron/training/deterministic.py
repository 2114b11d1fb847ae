"""``--deterministic-mode``: choose code paths whose results do not change from run to run (Megatron's flag).

On GPUs a run with the same seed, layout and data is bit-for-bit repeatable only when every kernel and every
collective is deterministic. The flag therefore

* refuses ``--use-flash-attn`` (its backward accumulates with atomics in an order that varies),
* requires ``NCCL_ALGO`` to name a fixed algorithm (one of ``Tree``, ``Ring``, ``CollnetDirect``,
  ``CollnetChain``, ``^NVLS``; NVLS all-reduces in switch hardware in a varying order) and sets it to ``Ring``
  when unset, before any NCCL communicator exists,
* sets ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (cuBLAS picks reduction splits by workspace otherwise) and
  ``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0`` (Transformer Engine) when unset,
* calls ``torch.use_deterministic_algorithms(True)`` (scatter-add style kernels, e.g. the embedding backward,
  switch to deterministic versions or raise) and sets ``torch.backends.cudnn.deterministic = True`` and
  ``torch.backends.cudnn.benchmark = False``.

All of it is applied on CPU as well (the settings are harmless there and keep one code path); CPU runs with the
gloo backend are already bit-identical run to run without the flag.
"""
from __future__ import annotations

import os
from typing import Dict

import torch

from megatron.training.errors import ConfigurationError

NCCL_ALGO_CHOICES = ("Tree", "Ring", "CollnetDirect", "CollnetChain", "^NVLS")
ENV_DEFAULTS = {"NCCL_ALGO": "Ring", "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}
_CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")


def check_deterministic_mode(args) -> None:
    """validate_args: the flag combinations and environment that cannot be deterministic."""
    if not getattr(args, "deterministic_mode", False):
        return
    if getattr(args, "use_flash_attn", False):
        raise ConfigurationError("--deterministic-mode cannot be used with --use-flash-attn (its backward is not "
                                 "deterministic): drop one of the two flags")
    algo = os.environ.get("NCCL_ALGO")
    if algo is not None and algo not in NCCL_ALGO_CHOICES:
        raise ConfigurationError(f"--deterministic-mode needs NCCL_ALGO to be one of {', '.join(NCCL_ALGO_CHOICES)} "
                                 f"(found NCCL_ALGO={algo}): export NCCL_ALGO=Ring or unset it")
    cublas = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if cublas is not None and cublas not in _CUBLAS_DETERMINISTIC:
        raise ConfigurationError(f"--deterministic-mode needs CUBLAS_WORKSPACE_CONFIG=:4096:8 or :16:8 (found "
                                 f"{cublas}): export CUBLAS_WORKSPACE_CONFIG=:4096:8 or unset it")


def apply_deterministic_mode(args) -> Dict[str, str]:
    """initialize_megatron, before torch.distributed and any GPU work: set what makes runs repeatable.

    Returns the environment variables this call set (those the user had set are kept)."""
    if not getattr(args, "deterministic_mode", False):
        return {}
    check_deterministic_mode(args)
    set_here = {}
    for name, value in ENV_DEFAULTS.items():
        if name not in os.environ:
            os.environ[name] = value
            set_here[name] = value
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    if getattr(args, "rank", 0) == 0:
        env = " ".join(f"{name}={os.environ[name]}" for name in ENV_DEFAULTS)
        print(f"> deterministic mode: torch.use_deterministic_algorithms(True), cudnn.deterministic=True, "
              f"cudnn.benchmark=False, {env}", flush=True)
    return set_here
