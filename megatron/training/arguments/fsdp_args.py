"""Fully sharded data parallelism flags (``--use-torch-fsdp2``, ``--use-megatron-fsdp`` and their options) and
Megatron's checks of them.

Spelling, types, defaults and choices are Megatron-LM HEAD's. What each flag does here:

* ``--use-torch-fsdp2``: PyTorch FSDP2 on the DP x CP ranks
  (megatron.core.distributed.torch_fully_sharded_data_parallel); ``--torch-fsdp2-no-reshard-after-forward``.
* ``--use-megatron-fsdp`` with ``--data-parallel-sharding-strategy no_shard|optim|optim_grads|optim_grads_params``
  (megatron.core.distributed.fsdp); Megatron-FSDP version 1 (the default) switches ``--use-distributed-optimizer``
  on, as Megatron does.
* GPU buffer tuning (``--fsdp-double-buffer``, ``--use-nccl-ub``, ``--fsdp-manual-registration``,
  ``--megatron-fsdp-max-pool-double-buffer``, ``--megatron-fsdp-enable-fine-grained-param-gather``,
  ``--fsdp-db-use-persist-buf-on-alloc-fail``, ``--suggested-communication-unit-size``) parses and changes nothing
  (FSDP2 allocates its own buffers); a line says so.
* Hybrid sharding (``--num-distributed-optimizer-instances`` > 1, ``--outer-dp-sharding-strategy optim``,
  ``--enable-full-sharding-in-hsdp``), ``--megatron-fsdp-version 2`` and main weights / gradients other than fp32
  stop with one line: not implemented.
"""
from __future__ import annotations

import os

from megatron.training.errors import ConfigurationError

SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
FSDP_DTYPES = ("fp32", "bf16", "fp16", "auto")
_BUFFER_TUNING = ("fsdp_double_buffer", "nccl_ub", "fsdp_manual_registration", "megatron_fsdp_max_pool_double_buffer",
                  "megatron_fsdp_enable_fine_grained_param_gather", "fsdp_db_use_persist_buf_on_alloc_fail")


def add_fsdp_args(group) -> None:
    """Add the FSDP flags to ``group`` (the distributed group, where Megatron lists them)."""
    group.add_argument("--use-torch-fsdp2", action="store_true",
                       help="Shard parameters, gradients and optimizer state over the data-parallel (x context-"
                            "parallel) ranks with PyTorch's FSDP2 (fully_shard): each transformer layer, the "
                            "embedding and the output layer is a unit. Needs --no-gradient-accumulation-fusion, "
                            "--untie-embeddings-and-output-weights, --ckpt-format torch_dist or torch_dcp.")
    group.add_argument("--torch-fsdp2-no-reshard-after-forward", action="store_false",
                       dest="torch_fsdp2_reshard_after_forward",
                       help="FSDP2: keep each unit's gathered weights from its forward to its backward pass.")
    group.add_argument("--use-megatron-fsdp", action="store_true",
                       help="Megatron-FSDP: shard what --data-parallel-sharding-strategy says over the data-parallel "
                            "(x context-parallel) ranks; checkpoints in --ckpt-format fsdp_dtensor.")
    group.add_argument("--data-parallel-sharding-strategy", type=str, default="optim_grads_params",
                       choices=list(SHARDING_STRATEGIES),
                       help="Megatron-FSDP: no_shard (DDP), optim (ZeRO-1: optimizer state), optim_grads (ZeRO-2: "
                            "also gradients), optim_grads_params (ZeRO-3: also weights).")
    group.add_argument("--megatron-fsdp-version", type=int, default=1, choices=[1, 2],
                       help="Megatron-FSDP version; 1 (which turns --use-distributed-optimizer on) is implemented.")
    group.add_argument("--num-distributed-optimizer-instances", type=int, default=1,
                       help="Hybrid sharding: copies of the sharded state over an outer data-parallel dimension "
                            "(only 1 is implemented).")
    group.add_argument("--outer-dp-sharding-strategy", type=str, default="no_shard", choices=["no_shard", "optim"],
                       help="Hybrid sharding: what the outer data-parallel dimension shards (only no_shard).")
    group.add_argument("--enable-full-sharding-in-hsdp", action="store_true",
                       help="Hybrid sharding: shard over the outer dimension too (not implemented).")
    group.add_argument("--init-model-with-meta-device", action="store_true",
                       help="FSDP: build the model on the meta device, then allocate and initialise only this "
                            "rank's shards.")
    group.add_argument("--fsdp-double-buffer", action="store_true", help="Megatron-FSDP GPU buffer tuning (no effect here).")
    group.add_argument("--use-nccl-ub", action="store_true", dest="nccl_ub",
                       help="NCCL user buffers for FSDP communication (no effect here).")
    group.add_argument("--fsdp-manual-registration", action="store_true", help="NCCL buffer registration (no effect here).")
    group.add_argument("--megatron-fsdp-max-pool-double-buffer", action="store_true",
                       help="Megatron-FSDP GPU buffer tuning (no effect here).")
    group.add_argument("--megatron-fsdp-enable-fine-grained-param-gather", action="store_true",
                       help="Megatron-FSDP MXFP8 parameter gather (no effect here).")
    group.add_argument("--fsdp-db-use-persist-buf-on-alloc-fail", action="store_true",
                       help="Megatron-FSDP double-buffer fallback (no effect here).")
    group.add_argument("--suggested-communication-unit-size", type=int, default=None,
                       help="Elements per Megatron-FSDP collective (FSDP2 communicates per unit: no effect here).")
    group.add_argument("--megatron-fsdp-main-params-dtype", type=str, default="fp32", choices=list(FSDP_DTYPES),
                       help="Megatron-FSDP main weights dtype (fp32 is implemented).")
    group.add_argument("--megatron-fsdp-main-grads-dtype", type=str, default="auto", choices=list(FSDP_DTYPES),
                       help="Megatron-FSDP main gradients dtype: auto or fp32 (gradients reduced as "
                            "--accumulate-allreduce-grads-in-fp32 says, fp32 with --bf16).")
    group.add_argument("--megatron-fsdp-grad-comm-dtype", type=str, default="auto",
                       choices=["fp32", "fp16", "bf16", "auto"],
                       help="Megatron-FSDP gradient communication dtype: auto or fp32 (as the main gradients).")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigurationError(message)


def _not_implemented(what: str, fix: str) -> ConfigurationError:
    return ConfigurationError(f"{what} is not implemented yet in this library; {fix}")


def validate_fully_sharded(args) -> None:
    """Megatron's checks of the FSDP flags (with Megatron's messages, then the fix), the derived settings, and the
    not-implemented stops. Called in validate_args before the precision and parameter-gather checks."""
    torch_fsdp2, megatron_fsdp = args.use_torch_fsdp2, args.use_megatron_fsdp
    _require(not (torch_fsdp2 and megatron_fsdp),
             "--use-megatron-fsdp and --use-torch-fsdp2 cannot be used together: pick one")
    _validate_hybrid_sharding(args)
    if args.init_model_with_meta_device:
        _require(torch_fsdp2 or megatron_fsdp, "--init-model-with-meta-device needs --use-megatron-fsdp or "
                                               "--use-torch-fsdp2 (a model on the meta device has no weights)")
        _require(not (megatron_fsdp and args.data_parallel_sharding_strategy == "no_shard"),
                 "Meta device initialization (init_model_with_meta_device=True) is not supported for no_shard "
                 "data parallel sharding strategy: pick another --data-parallel-sharding-strategy")
    if not (torch_fsdp2 or megatron_fsdp):
        _require(args.ckpt_format != "fsdp_dtensor", "fsdp_dtensor checkpoint format is only supported with "
                                                     "Megatron FSDP: add --use-megatron-fsdp")
        _require(args.ckpt_format != "torch_dcp", "--ckpt-format torch_dcp is only supported with --use-torch-fsdp2")
        return
    _require(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1",
             "FSDP always requires CUDA_DEVICE_MAX_CONNECTIONS value large than one: unset it or set it above 1")
    flag = "--use-torch-fsdp2" if torch_fsdp2 else "--use-megatron-fsdp"
    _require(not getattr(args, "use_legacy_models", False),
             f"{flag} needs the megatron-core models: drop --use-legacy-models")
    _require(args.DDP_impl == "local", f"{flag} replaces the data-parallel wrapper: drop --DDP-impl {args.DDP_impl}")
    if torch_fsdp2:
        _validate_torch_fsdp2(args)
    else:
        _validate_megatron_fsdp(args)


def _validate_hybrid_sharding(args) -> None:
    if args.num_distributed_optimizer_instances != 1:
        raise _not_implemented(f"--num-distributed-optimizer-instances {args.num_distributed_optimizer_instances} "
                               "(hybrid sharded data parallelism)", "use 1")
    if args.outer_dp_sharding_strategy != "no_shard":
        raise _not_implemented("--outer-dp-sharding-strategy optim (hybrid sharding)", "drop it")
    if args.enable_full_sharding_in_hsdp:
        raise _not_implemented("--enable-full-sharding-in-hsdp (hybrid sharding)", "drop it")


def _validate_torch_fsdp2(args) -> None:
    _require(args.pipeline_model_parallel_size == 1,
             "--use-torch-fsdp2 is not supported with pipeline parallelism: use --pipeline-model-parallel-size 1")
    _require(args.expert_model_parallel_size == 1,
             "--use-torch-fsdp2 is not supported with expert parallelism: use --expert-model-parallel-size 1 (or "
             "--use-megatron-fsdp, which shards experts over the expert data-parallel ranks)")
    _require(not args.use_distributed_optimizer,
             "--use-torch-fsdp2 is not supported with MCore's distributed optimizer: drop --use-distributed-optimizer")
    _require(not args.gradient_accumulation_fusion,
             "--use-torch-fsdp2 is not supported with gradient accumulation fusion: add "
             "--no-gradient-accumulation-fusion")
    _require(args.ckpt_format in ("torch_dist", "torch_dcp"),
             f"--use-torch-fsdp2 requires --ckpt-format torch_dist or torch_dcp, got --ckpt-format {args.ckpt_format}")
    _require(args.untie_embeddings_and_output_weights,
             "--use-torch-fsdp2 requires --untie-embeddings-and-output-weights")
    _require(not args.fp16, "--use-torch-fsdp2 not supported with fp16 yet: use --bf16")
    if args.ckpt_format == "torch_dcp":
        _require(args.tensor_model_parallel_size <= 1 and args.pipeline_model_parallel_size <= 1,
                 "--ckpt-format torch_dcp supports only --tensor-model-parallel-size 1 and "
                 "--pipeline-model-parallel-size 1: use --ckpt-format torch_dist")


def _validate_megatron_fsdp(args) -> None:
    args.use_custom_fsdp = True  # Megatron's deprecated name of the same switch
    if args.megatron_fsdp_version != 1:
        raise _not_implemented("--megatron-fsdp-version 2", "use --megatron-fsdp-version 1 (the default)")
    args.use_distributed_optimizer = True  # Megatron-FSDP version 1 always runs with it
    _require(args.ckpt_format == "fsdp_dtensor",
             "Megatron FSDP only supports fsdp_dtensor checkpoint format: add --ckpt-format fsdp_dtensor")
    _require(args.optimizer in ("adam", "sgd"),
             f"Megatron-FSDP supports --optimizer adam or sgd, got {args.optimizer}")
    if args.megatron_fsdp_main_params_dtype != "fp32":
        raise _not_implemented(f"--megatron-fsdp-main-params-dtype {args.megatron_fsdp_main_params_dtype}",
                               "use fp32 (the default)")
    for dest in ("megatron_fsdp_main_grads_dtype", "megatron_fsdp_grad_comm_dtype"):
        value = getattr(args, dest)
        if value not in ("auto", "fp32"):
            raise _not_implemented(f"--{dest.replace('_', '-')} {value}", "use auto or fp32")
    sharded = args.data_parallel_sharding_strategy in ("optim_grads", "optim_grads_params")
    if sharded:
        _require(args.pipeline_model_parallel_size == 1,
                 f"--data-parallel-sharding-strategy {args.data_parallel_sharding_strategy} with pipeline parallelism "
                 "is not implemented yet in this library; use --pipeline-model-parallel-size 1 or no_shard / optim")
        _require(not args.fp16, f"--data-parallel-sharding-strategy {args.data_parallel_sharding_strategy} with "
                                "--fp16 is not implemented yet in this library; use --bf16")
        if args.gradient_accumulation_fusion:
            args.gradient_accumulation_fusion = False
            if args.rank == 0:
                print(f"WARNING: --data-parallel-sharding-strategy {args.data_parallel_sharding_strategy}: gradient "
                      "accumulation fusion turned off (FSDP reduce-scatters .grad; pass "
                      "--no-gradient-accumulation-fusion)", flush=True)
    tuned = [f"--{d.replace('_', '-')}" for d in _BUFFER_TUNING if getattr(args, d)]
    if args.suggested_communication_unit_size is not None:
        tuned.append("--suggested-communication-unit-size")
    if tuned and args.rank == 0:
        print(f"NOTE: {', '.join(tuned)}: GPU buffer tuning of Megatron-FSDP; FSDP2 allocates its own buffers, so "
              "this has no effect here", flush=True)
