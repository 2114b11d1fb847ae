"""Megatron-LM options that only choose how the same math runs (kernels, streams, overlaps, buffers, placement, GPU
libraries): accepted with HEAD's type and default; when one is set, the log says once what ran instead.

See registry.py for the classes and how an option moves between the tables.
"""
from megatron.training.arguments.registry import Block, names, negated, no_or_disable, switch, value
from megatron.training.arguments.registry import OptionClass as C

PERFORMANCE = C.PERFORMANCE

BLOCKS = (
    Block(
        PERFORMANCE,
        "FSDP2 allocates its own communication buffers, one all-gather / reduce-scatter per FSDP unit (no double "
        "buffering, NCCL buffer registration or communication-unit sizing)",
        (
            switch("--fsdp-double-buffer"),
            switch("--fsdp-manual-registration"),
            value("--suggested-communication-unit-size", type=int),
            switch("--megatron-fsdp-enable-fine-grained-param-gather"),
            switch("--megatron-fsdp-max-pool-double-buffer"),
            switch("--fsdp-db-use-persist-buf-on-alloc-fail"),
        ),
        group="fsdp",
    ),
    Block(
        PERFORMANCE,
        "Transformer Engine's userbuffer overlap of tensor-parallel communication with GEMMs is not used; each "
        "tensor-parallel collective runs next to its GEMM",
        (
            switch("--tp-comm-overlap"),
            no_or_disable("tp-comm-bulk-wgrad"),
            no_or_disable("tp-comm-bulk-dgrad"),
            no_or_disable("tp-comm-overlap-ag"),
            no_or_disable("tp-comm-overlap-rs"),
            switch("--tp-comm-overlap-rs-dgrad"),
            no_or_disable("tp-comm-split-ag"),
            no_or_disable("tp-comm-split-rs"),
            value("--tp-comm-bootstrap-backend", default="nccl", choices=("nccl", "mpi", "gloo")),
            value("--tp-comm-overlap-cfg"),
        ),
        group="performance",
    ),
    Block(
        PERFORMANCE,
        "CUDA graphs are not captured: every layer runs eagerly",
        names("""--enable-cuda-graph --external-cuda-graph""") + (
            value("--cuda-graph-warmup-steps", type=int, default=3),
            value("--cuda-graph-impl", default="none", choices=("none", "local", "transformer_engine",
                "full_iteration")),
            value("--cuda-graph-scope", nargs="+", dest="cuda_graph_scope_deprecated"),
            value("--cuda-graph-modules", default=[], nargs="*"),
            switch("--optimizer-cuda-graph"),
            switch("--moe-pad-experts-for-cuda-graph-inference"),
            switch("--delay-offload-until-cuda-graph"),
        ),
        group="performance",
    ),
    Block(
        PERFORMANCE,
        "the DeepEP / HybridEP / NCCL-EP dispatch kernels are not used: tokens go through the alltoall or allgather "
        "dispatcher",
        (
            switch("--moe-enable-deepep"),
            value("--moe-flex-dispatcher-backend", default="deepep", choices=("deepep", "hybridep", "ncclep")),
            switch("--moe-permute-fusion-into-hybridep"),
            switch("--moe-hybridep-pad-uneven-dispatch-inputs"),
            value("--moe-flex-dispatcher-num-sms", type=int),
            value("--moe-deepep-num-sms", type=int),
            value("--moe-hybridep-num-sms", type=int),
            value("--moe-hybridep-num-blocks-permute", type=int),
            value("--moe-hybridep-num-blocks-unpermute", type=int),
            value("--moe-hybridep-num-sms-preprocessing", type=int, default=108),
            switch("--moe-ncclep-zero-copy"),
        ),
        group="performance",
    ),
    Block(
        PERFORMANCE,
        "no overlap of the expert-parallel all-to-all or of deferred weight-gradient GEMMs: each runs in order on one "
        "stream",
        names("""--moe-shared-expert-overlap --overlap-moe-expert-parallel-comm""") + (
            switch("--delay-wgrad-compute"),
            switch("--overlap-dispatch-backward-with-experts-wgrad"),
            switch("--ep-overlap-early-attn-memory-release"),
            switch("--defer-embedding-wgrad-compute"),
            value("--wgrad-deferral-limit", type=int, default=0),
            switch("--high-priority-a2a-comm-stream"),
            value("--high-priority-stream-groups", default=[], nargs="*"),
        ),
        group="performance",
    ),
    Block(
        PERFORMANCE,
        "the fused Transformer Engine / Triton kernel is not used: this library's PyTorch (or torch.compile'd) kernel "
        "ran",
        names("""--moe-router-fusion --moe-permute-fusion --no-persist-layer-norm""") + (
            value("--cross-entropy-fusion-impl", default="native", choices=("native", "te")),
            switch("--fused-residual-rmsnorm"),
            switch("--use-transformer-engine-op-fuser"),
            switch("--use-te-activation-func"),
            switch("--use-fused-weighted-squared-relu"),
            value("--flash-attention-version", type=int, choices=(2, 3, 4)),
            switch("--disable-jit-fuser"),
            negated("--no-gradient-reduce-div-fusion", dest="gradient_reduce_div_fusion"),
            switch("--use-grouped-gemm-for-shared-expert"),
            switch("--use-grouped-gemm-for-dense-mlp"),
            switch("--moe-use-grouped-tensor"),
            switch("--moe-router-padding-for-quantization"),
        ),
        group="performance",
    ),
    Block(
        PERFORMANCE,
        "activations and optimizer state stay where they are computed (no CPU offloading, no paged stash)",
        (
            value("--cpu-offloading-num-layers", type=int, default=0),
            switch("--cpu-offloading-retain-pinned-cpu-buffers"),
            switch("--fine-grained-activation-offloading"),
            value("--offload-modules", default=[], nargs="*"),
            value("--min-offloaded-tensor-size", type=int, default=1048576),
            value("--delta-offload-bytes-across-pp-ranks", type=int, default=0),
            value("--activation-offload-fraction", type=float, default=1.0),
            value("--fine-grained-offloading-max-inflight-offloads", type=int),
            switch("--moe-paged-stash"),
            value("--moe-paged-stash-page-size", type=int, default=64),
            value("--moe-paged-stash-buffer-size-factor-cuda", type=float, default=1.1),
            value("--moe-paged-stash-buffer-size-factor-cpu", type=float, default=0.0),
            switch("--optimizer-cpu-offload"),
            value("--optimizer-offload-fraction", type=float, default=1.0),
            switch("--use-torch-optimizer-for-cpu-offload"),
            switch("--overlap-cpu-optimizer-d2h-h2d"),
            negated("--no-pin-cpu-grads", dest="pin_cpu_grads"),
            negated("--no-pin-cpu-params", dest="pin_cpu_params"),
            value("--mlp-chunks-for-training", type=int, default=1),
            no_or_disable("clone-scatter-output-in-embedding"),
        ),
        group="performance",
    ),
    Block(
        PERFORMANCE,
        "pipeline and data-parallel communication use this library's defaults (batched isend/irecv, the process-group "
        "backend of --distributed-backend, gradients reduced bucket by bucket)",
        names("""--use-ring-exchange-p2p""") + (
            value("--pipeline-model-parallel-comm-backend", choices=("nccl", "ucc")),
            switch("--overlap-p2p-communication-warmup-flush", dest="overlap_p2p_comm_warmup_flush"),
            value("--microbatch-group-size-per-virtual-pipeline-stage", type=int,
                dest="microbatch_group_size_per_vp_stage"),
            value("--ddp-num-buckets", type=int),
            switch("--ddp-pad-buckets-for-high-nccl-busbw"),
            switch("--ddp-average-in-collective"),
            no_or_disable("align-grad-reduce"),
            switch("--use-nccl-ub", dest="nccl_ub"),
            switch("--disable-symmetric-registration"),
            value("--nccl-communicator-config-path"),
            switch("--use-sharp"),
            value("--sharp-enabled-group", choices=("dp", "dp_replica")),
            negated("--disable-gloo-process-groups", dest="use_gloo_process_groups"),
            switch("--create-all-gather-group"),
            value("--symmetric-ar-type", choices=("two_shot", "one_shot", "multimem_all_reduce")),
            switch("--use-tp-pp-dp-mapping"),
            negated("--no-use-layer-wise-param-layout", dest="use_layer_wise_param_layout"),
            value("--train-sync-interval", type=int),
            switch("--te-rng-tracker"),
            switch("--inference-rng-tracker"),
        ),
        group="performance",
    ),
    Block(
        PERFORMANCE,
        "torch_dist checkpoints are written by this library's saver: each distinct chunk once, by one rank holding "
        "it, in a background thread with --async-save; plans are recomputed every save",
        names("""--no-ckpt-fully-parallel-save --ckpt-fully-parallel-load --ckpt-assume-constant-structure
              --dist-ckpt-optim-fully-reshardable --use-persistent-ckpt-worker""") + (
            value("--async-strategy", default="nvrx", choices=("nvrx", "mcore")),
            value("--async-ckpt-cpu-priority", type=int, default=10),
            value("--async-ckpt-io-priority", type=int, default=3),
            switch("--async-ckpt-use-cpu-shm"),
            value("--ckpt-fully-parallel-load-exchange-algo", default="broadcast", choices=("broadcast",
                "gather_rounds", "gather_object")),
            switch("--ckpt-fully-parallel-load-per-rank-objects"),
            value("--ckpt-fully-parallel-save-process-group", default="dp", choices=("dp", "ep_dp")),
            value("--ckpt-fully-parallel-load-process-group", default="dp", choices=("dp", "ep_dp")),
            value("--ckpt-pg-tensors-cache-path"),
            switch("--ckpt-pg-tensors-cache-create"),
            no_or_disable("ckpt-load-validate-sharding-integrity"),
            switch("--distrib-optim-fully-reshardable-mem-efficient"),
            value("--dist-ckpt-workers", type=int, default=1),
            switch("--ckpt-drop-redundant-extra-state"),
            no_or_disable("save-tokenizer-assets"),
            switch("--disable-msc", dest="disable_msc_deprecated"),
        ),
        group="performance",
    ),
    Block(
        PERFORMANCE,
        "the dataset indices are built and memory-mapped as usual (no fast cache, deferred mmap or builder threads)",
        (
            switch("--dataloader-fast-cache-load"),
            switch("--dataloader-defer-npy-index-mmap"),
            value("--num-dataset-builder-threads", type=int, default=1),
            switch("--tokenizer-hf-no-use-fast"),
        ),
        group="performance",
    ),
    Block(
        PERFORMANCE,
        "no NCCL flight recorder, NVTX ranges or experimental code paths (gloo on CPU; a hung rank is named by the "
        "hang detector)",
        (
            value("--flight-recorder-dump-path"),
            value("--flight-recorder-trace-buffer-size", type=int, default=2000),
            no_or_disable("flight-recorder-dump-on-timeout"),
            switch("--flight-recorder-include-stack-trace"),
            no_or_disable("flight-recorder-include-only-active"),
            no_or_disable("flight-recorder-extra-dump-on-exec"),
            switch("--nvtx-ranges"),
            switch("--enable-experimental"),
        ),
        group="performance",
    ),
    Block(
        PERFORMANCE,
        "text generation runs the whole batch at once on the static engine (the only one here)",
        names("""--inference-batch-times-seqlen-threshold""") + (
            switch("--use-legacy-static-engine"),
        ),
        group="performance",
    ),
    Block(
        PERFORMANCE,
        "kept for 2023 scripts: the data-parallel gradients always live in one contiguous buffer, pipeline stages "
        "send whole tensors, the index is always memory-mapped, GroupedMLP is the one grouped-GEMM expert module",
        names("""--no-contiguous-buffers-in-local-ddp --no-scatter-gather-tensors-in-pipeline --data-impl
              --mmap-warmup --moe-use-legacy-grouped-gemm"""),
        group="performance", head=False,
    ),
)
