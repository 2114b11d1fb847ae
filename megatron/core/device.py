"""The one place that decides device, distributed backend and RNG for CUDA or CPU.

Nothing here touches CUDA at import time: every query is a function call. The rest of the library asks
this module instead of calling ``torch.cuda`` directly, so the same code runs on GPUs with NCCL and on
CPU with gloo (our tests and CI).
"""
from __future__ import annotations

import contextlib
import os

import torch


def cuda_available() -> bool:
    """True when a CUDA device can be used (and the user did not force CPU with MEGATRON_FORCE_CPU=1)."""
    if os.environ.get("MEGATRON_FORCE_CPU", "0") == "1":
        return False
    return torch.cuda.is_available()


def _backend_in_use() -> str | None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_backend()
    return None


def default_backend() -> str:
    """NCCL when CUDA is available, gloo otherwise."""
    return "nccl" if cuda_available() else "gloo"


_BUILD_DEVICE: list = []  # the innermost ``build_on`` device, while one is active


@contextlib.contextmanager
def build_on(dev):
    """Inside the block :func:`current_device` is ``dev``: ``build_on("meta")`` builds models, gradient buffers and
    optimizer state with their real shapes and dtypes but no memory (nothing built there can run). Used to check
    what one rank of a huge layout holds (--fake-process-group, benchmarks/simulate_scale.py)."""
    _BUILD_DEVICE.append(torch.device(dev))
    try:
        yield
    finally:
        _BUILD_DEVICE.pop()


def current_device() -> torch.device:
    """The device that tensors and collectives of this process should use.

    With a gloo process group every buffer lives on the CPU even if a GPU is present, because gloo's
    collectives are CPU collectives.
    """
    if _BUILD_DEVICE:
        return _BUILD_DEVICE[-1]
    backend = _backend_in_use()
    if backend == "gloo" or not cuda_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


# --------------------------------------------------------------------------- where a model's weights are created
def param_device(config) -> torch.device:
    """Where a layer's parameters are created: the meta device with --init-model-with-meta-device (no storage, nothing
    drawn; get_model materialises them, see megatron/core/distributed/fsdp/meta_init.py), CPU with
    --use-cpu-initialization, else the current device."""
    if config is not None and getattr(config, "init_model_with_meta_device", False):
        return torch.device("meta")
    return init_device(config)


def weights_on_meta(module: torch.nn.Module) -> bool:
    """Whether ``module`` was built on the meta device: its ``reset_parameters`` then draws nothing (no generator
    advances, nothing is allocated); the materialisation calls it again on real tensors."""
    return any(p.is_meta for p in module.parameters())


def init_device(config) -> torch.device:
    """Where weights are drawn: CPU with --use-cpu-initialization, else the current device (the meta-device
    materialisation draws there too, so that the same generators produce the same values)."""
    if config is not None and getattr(config, "use_cpu_initialization", False):
        return torch.device("cpu")
    return current_device()


def set_device_for_local_rank(local_rank: int) -> None:
    """Bind this process to its GPU (``local_rank % device_count``); a no-op on CPU."""
    if cuda_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())


def on_gpu() -> bool:
    return current_device().type == "cuda"


# --------------------------------------------------------------------------- RNG
# The default RNG whose state the model-parallel tracker forks from: the CUDA generator of the current
# device on GPU, torch's CPU generator otherwise.

def get_rng_state() -> torch.Tensor:
    if on_gpu():
        return torch.cuda.get_rng_state()
    return torch.get_rng_state()


def set_rng_state(state: torch.Tensor) -> None:
    if on_gpu():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def manual_seed(seed: int) -> None:
    """Seed the default device generator (CUDA on GPU, CPU otherwise)."""
    if on_gpu():
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


def device_name() -> str:
    """The accelerator's marketing name (e.g. ``NVIDIA H100 80GB HBM3``), or ``cpu``."""
    return torch.cuda.get_device_name() if cuda_available() else "cpu"


def synchronize() -> None:
    if on_gpu():
        torch.cuda.synchronize()


def memory_allocated() -> int:
    return torch.cuda.memory_allocated() if on_gpu() else 0


def empty_cache() -> None:
    if on_gpu():
        torch.cuda.empty_cache()


def memory_stats_mb() -> dict:
    """Allocated / max allocated / reserved / max reserved accelerator memory in MB (empty on CPU)."""
    if not on_gpu():
        return {}
    mb = 1024.0 * 1024.0
    return {
        "allocated": torch.cuda.memory_allocated() / mb,
        "max allocated": torch.cuda.max_memory_allocated() / mb,
        "reserved": torch.cuda.memory_reserved() / mb,
        "max reserved": torch.cuda.max_memory_reserved() / mb,
    }


def cuda_profiler_start() -> bool:
    """Open the CUDA profiler capture range (nsys ``--capture-range=cudaProfilerApi``); False on CPU."""
    if not on_gpu():
        return False
    torch.cuda.cudart().cudaProfilerStart()
    return True


def cuda_profiler_stop() -> None:
    if on_gpu():
        torch.cuda.cudart().cudaProfilerStop()


def fp8_tensor_cores_available() -> bool:
    """True on a CUDA device of compute capability >= 8.9 (Ada, Hopper and later), where torch._scaled_mm runs."""
    if not on_gpu():
        return False
    return torch.cuda.get_device_capability() >= (8, 9)
