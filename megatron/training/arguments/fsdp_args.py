"""Megatron's checks of the fully sharded data parallelism flags (``--use-torch-fsdp2``, ``--use-megatron-fsdp``)
and the settings they imply.

The flags themselves are in the option registry (``head_implemented.py``, block "fully sharded data parallelism";
hybrid sharding and Megatron-FSDP version 2 are not available, the GPU buffer tuning options performance-only).
What they do: ``--use-torch-fsdp2`` is PyTorch FSDP2 on the DP x CP ranks
(megatron.core.distributed.torch_fully_sharded_data_parallel); ``--use-megatron-fsdp`` with
``--data-parallel-sharding-strategy`` is megatron.core.distributed.fsdp. Megatron's messages come first in each error,
then the fix.
"""
from __future__ import annotations

import os

from megatron.training.errors import ConfigurationError


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
    # torch_dist cuts each declared tensor to the rows of the FSDP2 shard; GroupedMLP's declared layout transposes
    # its weights (megatron/core/distributed/fsdp/sharded_state.py), so its rows are not the checkpoint's rows.
    _require(not (args.ckpt_format == "torch_dist" and args.moe_grouped_gemm and (args.save or args.load)),
             "--use-torch-fsdp2 with --moe-grouped-gemm and --ckpt-format torch_dist checkpoints is not available in "
             "this library: use --ckpt-format torch_dcp (or drop --moe-grouped-gemm)")
    if args.ckpt_format == "torch_dcp":
        _require(args.tensor_model_parallel_size <= 1 and args.pipeline_model_parallel_size <= 1,
                 "--ckpt-format torch_dcp supports only --tensor-model-parallel-size 1 and "
                 "--pipeline-model-parallel-size 1: use --ckpt-format torch_dist")


def _validate_megatron_fsdp(args) -> None:
    args.use_custom_fsdp = True  # Megatron's deprecated name of the same switch
    args.use_distributed_optimizer = True  # Megatron-FSDP version 1 always runs with it
    _require(args.ckpt_format == "fsdp_dtensor",
             "Megatron FSDP only supports fsdp_dtensor checkpoint format: add --ckpt-format fsdp_dtensor")
    _require(args.optimizer in ("adam", "sgd"),
             f"Megatron-FSDP supports --optimizer adam or sgd, got {args.optimizer}")
    _require(args.pipeline_model_parallel_size == 1,
             "--use-megatron-fsdp with pipeline parallelism is not implemented yet in this library (its fsdp_dtensor "
             "checkpoint holds one model chunk); use --pipeline-model-parallel-size 1")
    bf16_grads = [f"--{d.replace('_', '-')} bf16" for d in ("megatron_fsdp_main_grads_dtype",
                                                            "megatron_fsdp_grad_comm_dtype") if getattr(args, d) == "bf16"]
    if bf16_grads and not args.grad_reduce_in_bf16:
        args.grad_reduce_in_bf16 = True  # the gradients are reduced (and the DDP buffers kept) in bf16
        if args.rank == 0:
            print(f"{' and '.join(bf16_grads)}: gradients reduced in bf16 as with --grad-reduce-in-bf16 (FSDP2 "
                  "accumulates its sharded gradients in the fp32 of the main weights)", flush=True)
    if args.data_parallel_sharding_strategy in ("optim_grads", "optim_grads_params"):
        _require(not args.fp16, f"--data-parallel-sharding-strategy {args.data_parallel_sharding_strategy} with "
                                "--fp16 is not implemented yet in this library; use --bf16")
        if args.gradient_accumulation_fusion:
            args.gradient_accumulation_fusion = False
            if args.rank == 0:
                print(f"WARNING: --data-parallel-sharding-strategy {args.data_parallel_sharding_strategy}: gradient "
                      "accumulation fusion turned off (FSDP reduce-scatters .grad; pass "
                      "--no-gradient-accumulation-fusion)", flush=True)
