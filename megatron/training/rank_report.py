"""What one rank of a layout holds: its coordinates in the rank grid, its parameters against the closed-form count
of its pipeline stage, and the bytes of its weights, gradients and optimizer state measured from the tensors it
owns against ``tools/report_theoretical_memory.py``'s figures (megatron/training/theoretical_memory.py).

``--fake-process-group`` prints it after the first iteration (the process is then rank RANK of a WORLD_SIZE-rank
job, so the report is that rank's). :func:`build_rank` builds one rank of any layout in this process through the
library's own set-up (``initialize_megatron`` with a fake process group, ``setup_model_and_optimizer``), on the
meta device by default: real shapes and dtypes, no memory, so the full GPT-3 175B rank of a 1024-GPU job takes a
few seconds and no RAM; benchmarks/simulate_scale.py and the tests use it.
"""
from __future__ import annotations

import contextlib
import os
import re
import shlex
from typing import Dict, List, Optional

import torch

from megatron.core import device, parallel_state
from megatron.core.distributed.memory import resident_state_bytes
from megatron.training.launch_env import posing_as_rank
from megatron.training.theoretical_memory import GB, MB, report_theoretical_memory

STATE_KINDS = ("weights", "grads", "optimizer")


def rank_coordinates() -> Dict[str, tuple]:
    """(rank, size) of this process in each parallel dimension."""
    ps = parallel_state
    return {
        "tp": (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()),
        "pp": (ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()),
        "dp": (ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()),
        "cp": (ps.get_context_parallel_rank(), ps.get_context_parallel_world_size()),
        "ep": (ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()),
        "expert_dp": (ps.get_expert_data_parallel_rank(), ps.get_expert_data_parallel_world_size()),
    }


def rank_memory_report(args, model_chunks, optimizer) -> dict:
    """This rank's parameters and state bytes, measured and theoretical (module docstring)."""
    coords = rank_coordinates()
    stage = coords["pp"][0]
    theory = report_theoretical_memory(args)
    return {
        "rank": torch.distributed.get_rank(), "world": torch.distributed.get_world_size(), "coords": coords,
        "params": sum(p.numel() for chunk in model_chunks for p in chunk.parameters()),
        "formula_params": theory.params[stage],
        "measured": resident_state_bytes(model_chunks, optimizer),
        "theory": {kind: getattr(theory, kind)[stage] for kind in STATE_KINDS},
        "activations": theory.activations[stage], "recompute": theory.recompute,
    }


def format_rank_memory_report(report: dict) -> str:
    coords = " ".join(f"{name} {rank}/{size}" for name, (rank, size) in report["coords"].items())
    measured, theory = report["measured"], report["theory"]
    total_m, total_t = sum(measured.values()), sum(theory.values())
    unit, scale = ("GiB", GB) if total_t >= GB else ("MiB", MB)
    parts = lambda d: " + ".join(f"{d[k] / scale:.3f}" for k in STATE_KINDS)  # noqa: E731
    return "\n".join([
        f"[rank {report['rank']} of {report['world']}] {coords}",
        f"  parameters held: {report['params']} (closed-form count for pipeline stage {report['coords']['pp'][0]}: "
        f"{report['formula_params']})",
        f"  weights + grads + optimizer state ({unit}): measured {total_m / scale:.3f} = {parts(measured)} (the "
        f"storages this rank holds); theoretical {total_t / scale:.3f} = {parts(theory)} "
        f"(tools/report_theoretical_memory.py); measured / theoretical {total_m / max(total_t, 1):.4f}",
        f"  activations (theoretical, recompute {report['recompute']}): {report['activations'] / scale:.3f} {unit}",
    ])


def build_rank(argv: List[str], rank: int, world_size: int, model_provider, model_type, meta: bool = True,
               args_defaults=None) -> dict:
    """Build rank ``rank`` of a ``world_size``-rank job for the Megatron flags ``argv`` in this process (fake process
    group; on the meta device unless ``meta=False``) and return its :func:`rank_memory_report`. Leaves no process
    group or global state behind. With the distributed optimizer Adam's state is created as before a first step; on
    the meta device ``--load`` is ignored."""
    from megatron.training import global_vars
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import setup_model_and_optimizer

    if torch.distributed.is_initialized():
        raise RuntimeError("build_rank needs a process without torch.distributed (it creates a fake process group)")
    # On the meta device there are no values to initialise (and torch's meta normal_ pulls in torch._dynamo).
    extra = ["--fake-process-group"] + (["--no-initialization"] if meta else [])
    with posing_as_rank(rank, world_size):
        initialize_megatron(argv=list(argv) + extra, args_defaults=args_defaults or {})
    try:
        args = global_vars.get_args()
        if meta:
            args.load = args.pretrained_checkpoint = None  # nothing to load into tensors without data
        with device.build_on("meta") if meta else contextlib.nullcontext():
            model, optimizer, _ = setup_model_and_optimizer(model_provider, model_type)
            if hasattr(optimizer, "_ensure_state"):
                optimizer._ensure_state()
        report = rank_memory_report(args, model, optimizer)
        report["optimizer_state_complete"] = hasattr(optimizer, "_ensure_state") or not meta
        return report
    finally:
        global_vars.destroy_global_vars()
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def script_options(path: str, values: Optional[Dict[str, str]] = None) -> List[str]:
    """The flags a launch script of examples/ hands to its training script: the words of its ``options=( ... )``
    array, ``$VAR`` / ``"$VAR"`` replaced by ``values[VAR]`` (a missing variable is an error)."""
    text = open(path).read()
    found = re.search(r"^options=\(\n(.*?)^\)", text, re.S | re.M)
    if found is None:
        raise ValueError(f"{path}: no options=( ... ) array")
    values = values or {}

    def fill(match):
        if match.group(1) not in values:
            raise KeyError(f"{path} uses ${match.group(1)}: give its value")
        return shlex.quote(values[match.group(1)]) if values[match.group(1)] else ""

    return shlex.split(re.sub(r"\"?\$(\w+)\"?", fill, found.group(1)), comments=True)
