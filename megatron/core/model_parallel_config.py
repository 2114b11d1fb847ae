"""ModelParallelConfig: how a model is split and run, with Megatron's fields and defaults."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional

import torch

from megatron.core.config_cli import flag


@dataclass
class ModelParallelConfig:
    """Parallelism and precision settings shared by every megatron.core module.

    Fields and defaults follow megatron-core; ``__post_init__`` validates what can be validated without
    a process group.
    """

    # Model parallelism
    tensor_model_parallel_size: int = flag(1, "Tensor model parallel size.")
    pipeline_model_parallel_size: int = flag(1, "Pipeline model parallel size.")
    virtual_pipeline_model_parallel_size: Optional[int] = None
    sequence_parallel: bool = flag(False, "Shard layer-norm and dropout activations along the sequence over "
                                          "tensor-parallel ranks.")
    # Mixture of experts: experts split over EP ranks, each expert's weights over ETP ranks (None: = TP).
    expert_model_parallel_size: int = flag(1, "Expert model parallel size (EP).")
    expert_tensor_parallel_size: Optional[int] = flag(None, "Tensor parallel size of the experts "
                                                            "(--tensor-model-parallel-size if not given).")

    # Initialization
    perform_initialization: bool = flag(True, "Skip weight initialisation (weights come from a checkpoint).",
                                              arg_names=("--no-initialization",))
    use_cpu_initialization: bool = flag(False, "Initialise full weights on the CPU, then slice (same weights for "
                                               "every layout).", default=None)

    # Training
    fp16: bool = flag(False, "Run the model in fp16.")
    bf16: bool = flag(False, "Run the model in bfloat16.")
    params_dtype: torch.dtype = torch.float32
    timers: Optional[Callable] = None

    # Optimizations
    gradient_accumulation_fusion: bool = False
    async_tensor_model_parallel_allreduce: bool = False

    # Pipeline parallel
    pipeline_dtype: Optional[torch.dtype] = None
    grad_scale_func: Optional[Callable] = None
    enable_autocast: bool = False
    autocast_dtype: Optional[torch.dtype] = None
    variable_seq_lengths: bool = False
    num_microbatches_with_partial_activation_checkpoints: Optional[int] = None
    overlap_p2p_comm: bool = False
    batch_p2p_comm: bool = True
    batch_p2p_sync: bool = True
    use_ring_exchange_p2p: bool = flag(False, "Use ring exchange for pipeline communication (custom PyTorch builds "
                                              "only).")
    deallocate_pipeline_outputs: bool = False
    no_sync_func: Optional[Callable] = None
    # megatron-core's EP all-to-all overlap: forward_backward_no_pipelining runs the combined 1F1B schedule
    # (megatron.core.pipeline_parallel.combined_1f1b). The command line leaves it off (core_transformer_config_from_args).
    overlap_moe_expert_parallel_comm: bool = flag(
        False, "Accepted for Megatron's scripts: the plain schedule runs, with no overlap of the expert-parallel "
               "all-to-all. Set on the config by a megatron-core library user, forward_backward_no_pipelining runs "
               "the combined 1F1B schedule (the nodes in order on one stream: the same math).")
    grad_sync_func: Optional[Callable] = None
    param_sync_func: Optional[Callable] = None
    # Called by the schedules after the last backward pass of a step with the list of model chunks
    # (training sets it to megatron.core.distributed.finalize_model_grads).
    finalize_model_grads_func: Optional[Callable] = None
    # --calculate-per-token-loss: the loss function's (loss_sum, num_tokens) are not normalised per
    # micro-batch; finalize_model_grads divides the gradients by the step's global token count instead.
    calculate_per_token_loss: bool = flag(False, "Normalise the loss by the number of non-padded tokens of the whole "
                                                 "global batch (instead of averaging per-micro-batch token means).")

    # Context parallelism (--context-parallel-size): ranks of one CP group each hold 1/CP of every sequence (see
    # megatron/core/transformer/context_parallel.py). Hierarchical CP (a2a+p2p) is not implemented.
    context_parallel_size: int = flag(1, "Context parallel size: ranks that split each sequence "
                                         "(docs/context_parallel.md).")
    hierarchical_context_parallel_sizes: Optional[List[int]] = flag(
        None, "Sizes of the two context-parallel levels of a2a+p2p (their product is the CP size).")
    # Hybrid CP (megatron.core.pipeline_parallel.hybrid_cp_schedule): packed sub-samples scheduled over DP x CP ranks,
    # each on a power-of-two group sized so that no rank holds more than max_seqlen_per_dp_cp_rank tokens.
    max_seqlen_per_dp_cp_rank: Optional[int] = None
    hybrid_context_parallel: bool = False

    def __post_init__(self):
        if self.sequence_parallel:
            if self.tensor_model_parallel_size <= 1:
                raise ValueError("Can not use sequence parallelism without tensor parallelism "
                                 "(sequence_parallel=True needs tensor_model_parallel_size > 1)")
            # Sequence parallelism replaces the async input all-reduce by an all-gather.
            self.async_tensor_model_parallel_allreduce = False

        if self.context_parallel_size < 1:
            raise ValueError(f"context_parallel_size must be >= 1, got {self.context_parallel_size}")
        if self.hierarchical_context_parallel_sizes:
            raise NotImplementedError("hierarchical_context_parallel_sizes (a2a+p2p context parallelism) is not "
                                      "implemented in this library")

        if self.pipeline_model_parallel_size > 1 and self.pipeline_dtype is None:
            raise ValueError("When using pipeline parallelism, pipeline_dtype must be specified "
                             "(the dtype of tensors sent between stages)")

        if self.expert_model_parallel_size < 1:
            raise ValueError(f"expert_model_parallel_size must be >= 1, got {self.expert_model_parallel_size}")
        if self.expert_tensor_parallel_size is None:
            self.expert_tensor_parallel_size = self.tensor_model_parallel_size

        if self.autocast_dtype is None:
            self.autocast_dtype = self.params_dtype
