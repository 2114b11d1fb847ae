"""``initialize_megatron``: flags -> global state -> torch.distributed -> parallel groups -> seeds.

The order is that of Megatron-LM's ``megatron/training/initialize.py``: parse, validate (all configuration errors
surface here, before any process group exists), create the global singletons, initialise torch.distributed from
torchrun's or SLURM's environment, build the model-parallel groups, seed python/numpy/torch with ``seed + 100 *
pp_rank``.
"""
from __future__ import annotations

import atexit
import random
from datetime import timedelta

import numpy as np
import torch

from megatron.core import device, parallel_state, tensor_parallel
from megatron.training.arguments import parse_args, validate_args
from megatron.training.deterministic import apply_deterministic_mode
from megatron.training.errors import ConfigurationError
from megatron.training.global_vars import get_adlr_autoresume, get_args, set_global_variables
from megatron.training.launch_env import export_launch_env, resolve_launch_env
from megatron.training.numerical_checks import setup_rerun_state_machine


def initialize_megatron(extra_args_provider=None, args_defaults={}, ignore_unknown_args=False,  # noqa: B006
                        allow_no_cuda=False, argv=None):
    """Set up a Megatron process. ``argv`` (a list) replaces ``sys.argv[1:]``, for tests and notebooks.

    Returns None, or with ``--lazy-mpu-init`` the function that finishes the distributed setup later.
    ``allow_no_cuda`` is accepted for compatibility: without CUDA this library runs on CPU with gloo anyway.
    """
    args = parse_args(extra_args_provider, ignore_unknown_args, argv=argv)
    if not device.cuda_available() and args.rank == 0:
        print("> CUDA is not available: running on CPU with the gloo backend", flush=True)

    if args.use_checkpoint_args or args_defaults.get("use_checkpoint_args", False):
        if args.load is None:
            raise ConfigurationError("--use-checkpoint-args needs --load: pass the checkpoint directory")
        from megatron.training.checkpointing import load_args_from_checkpoint

        load_args_from_checkpoint(args)

    validate_args(args, args_defaults)
    _apply_process_settings(args)
    set_global_variables(args)
    setup_rerun_state_machine(args)
    _check_data_files(args)
    apply_deterministic_mode(args)  # before torch.distributed: NCCL reads NCCL_ALGO when it starts

    def finish_mpu_init():
        args = get_args()
        _initialize_distributed()
        if args.rank == 0:
            print("> setting random seeds to {} ...".format(args.seed), flush=True)
        _set_random_seed(args.seed, args.data_parallel_random_init)

    if args.lazy_mpu_init:
        # An external launcher owns torch.distributed: record the sizes now, finish when it says so.
        args.use_cpu_initialization = True
        parallel_state.set_tensor_model_parallel_world_size(args.tensor_model_parallel_size)
        parallel_state.set_tensor_model_parallel_rank(args.rank)
        return finish_mpu_init

    finish_mpu_init()
    _init_autoresume()
    return None


def _apply_process_settings(args):
    """--logging-level (the Python root logger's level) and --disable-bf16-reduced-precision-matmul."""
    import logging

    if getattr(args, "logging_level", None) is not None:
        logging.getLogger().setLevel(args.logging_level)
    if getattr(args, "disable_bf16_reduced_precision_matmul", False):
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False


def _check_data_files(args):
    """Every rank opens the datasets (and checks their token ids against the tokenizer) before any collective."""
    from megatron.training.data_checks import check_data_files
    from megatron.training.global_vars import get_tokenizer_or_none

    tokenizer = get_tokenizer_or_none()

    vocab_size = getattr(tokenizer, "vocab_size", None) if tokenizer is not None else None
    check_data_files(args, vocab_size)


def choose_backend(requested: str, rank: int = 0) -> str:
    """gloo when asked for or when CUDA is not available (with a one-line warning if nccl was asked for)."""
    if requested == "gloo":
        return "gloo"
    if device.cuda_available():
        return "nccl"
    if rank == 0:
        print("WARNING: --distributed-backend nccl needs CUDA, which is not available: using gloo "
              "(pass --distributed-backend gloo to silence this)", flush=True)
    return "gloo"


def _initialize_distributed():
    """init_process_group from the launcher's environment, then the model-parallel groups."""
    args = get_args()
    if torch.distributed.is_initialized():
        if args.rank == 0:
            print("torch distributed is already initialized, skipping initialization ...", flush=True)
        args.rank = torch.distributed.get_rank()
        if torch.distributed.get_world_size() != args.world_size:
            raise RuntimeError(
                f"torch.distributed has {torch.distributed.get_world_size()} ranks but the arguments were validated "
                f"for a world size of {args.world_size} (from RANK/WORLD_SIZE or SLURM): make them agree")
        args.distributed_backend = torch.distributed.get_backend()
    else:
        launch = resolve_launch_env()
        export_launch_env(launch)
        if args.fake_process_group:  # this process plays rank RANK of WORLD_SIZE; collectives move nothing
            args.distributed_backend = "fake"
        else:
            args.distributed_backend = choose_backend(args.distributed_backend, args.rank)
        if args.rank == 0:
            print("> initializing torch distributed ...", flush=True)
        if args.local_rank is None:
            args.local_rank = launch.local_rank
        if args.distributed_backend == "nccl" or (args.fake_process_group and device.cuda_available()):
            device.set_device_for_local_rank(args.local_rank)
        from megatron.training.fault_handling import restart_safe_store
        timeout = timedelta(minutes=args.distributed_timeout_minutes)
        if args.fake_process_group:
            from megatron.core.fake_process_group import init_fake_process_group
            init_fake_process_group(args.rank, args.world_size, timeout)
            print(f"> --fake-process-group: this process is rank {args.rank} of {args.world_size} (collectives are "
                  "no-ops: values are meaningless, shapes and memory are real)", flush=True)
        else:
            torch.distributed.init_process_group(  # under torchrun: a store whose keys survive no restart
                backend=args.distributed_backend, world_size=args.world_size, rank=args.rank, timeout=timeout,
                store=restart_safe_store(timeout))
        atexit.register(_release_process_groups)

    if parallel_state.model_parallel_is_initialized():
        print("model parallel is already initialized", flush=True)
        return
    parallel_state.initialize_model_parallel(
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        args.virtual_pipeline_model_parallel_size,
        args.pipeline_model_parallel_split_rank,
        use_fp8=args.fp8 is not None,
        context_parallel_size=args.context_parallel_size,
        distributed_timeout_minutes=args.distributed_timeout_minutes,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
    )
    if args.rank == 0:
        print(f"> initialized tensor model parallel with size "
              f"{parallel_state.get_tensor_model_parallel_world_size()}", flush=True)
        print(f"> initialized pipeline model parallel with size "
              f"{parallel_state.get_pipeline_model_parallel_world_size()}", flush=True)
        if args.context_parallel_size > 1:
            print(f"> initialized context parallel with size {parallel_state.get_context_parallel_world_size()}",
                  flush=True)


def _release_process_groups():
    """At interpreter exit, destroy the process groups this process created, while Python is still whole.

    Left to interpreter finalisation, gloo's worker threads can be destroyed while still joinable and a run that
    finished normally aborts with "terminate called without an active exception" (SIGABRT, exit code -6 under
    torchrun; a two-rank gloo script that skips this aborted in 19 of 30 runs here, 0 of 30 with it). A failing
    rank leaves through ``os._exit`` (fault_handling.py), which runs no atexit handler, so this never waits on a
    dead peer. Process groups a caller created before ``initialize_megatron`` are the caller's to destroy.
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def _set_random_seed(seed_, data_parallel_random_init=False):
    """Seed python, numpy and torch with ``seed + 100 * pp_rank`` (``+ 10 * dp_rank`` with
    --data-parallel-random-init), and the model-parallel RNG tracker (``+ 2718 + tp_rank``)."""
    if seed_ is None or seed_ <= 0:
        raise ConfigurationError("--seed ({}) must be a positive integer".format(seed_))
    # Different pipeline stages hold different layers: give each its own stream of random numbers.
    seed = seed_ + 100 * parallel_state.get_pipeline_model_parallel_rank()
    if data_parallel_random_init:
        seed = seed + 10 * parallel_state.get_data_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def _init_autoresume():
    autoresume = get_adlr_autoresume()
    if autoresume:
        torch.distributed.barrier()
        autoresume.init()
        torch.distributed.barrier()


def set_jit_fusion_options():
    """TorchScript fuser settings Megatron uses on GPUs; nothing to set on CPU.

    nvFuser is gone from TorchScript in current PyTorch, so only the profiling executor is configured; the
    fused ops of this library use torch.compile where it helps.
    """
    if not device.cuda_available():
        return
    torch._C._jit_set_profiling_executor(True)
    torch._C._jit_set_profiling_mode(True)
    torch._C._jit_override_can_fuse_on_cpu(False)
    torch._C._jit_override_can_fuse_on_gpu(False)
    torch._C._jit_set_texpr_fuser_enabled(False)
    torch._C._debug_set_autodiff_subgraph_inlining(False)
