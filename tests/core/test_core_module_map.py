"""megatron-core's public module map, ours against the real megatron-core 0.16.1 (the oracle's installed files).

The oracle's modules are read with ``ast`` (never imported here): every module of the training sub-packages
(transformer, models/gpt, models/bert, models/T5, models/common, tensor_parallel, pipeline_parallel, distributed,
optimizer, dist_checkpointing, datasets) and the top-level modules of ``megatron.core``, and the public classes and
functions each defines at module level. Ours are imported: a module exists when ``import megatron.core.<name>``
works, a name when that module has the attribute. Modules that bind a GPU-only library (Transformer Engine, CUDA
graphs, NVRx, DeepEP, object storage) are left out of the target: by a fragment of the module's name (``GPU_ONLY``)
or listed one by one with the reason (``GPU_ONLY_MODULES``, ``GPU_ONLY_NAMES``; the test checks each listed entry
still exists in the oracle, so the lists cannot hide a typo).

The counts can only go up: ``MODULES_PRESENT`` / ``NAMES_PRESENT`` are the numbers reached so far; raise them when
more of megatron-core exists here. The test prints what is still missing.
"""
import ast
import importlib
import os

from helpers.mcore_oracle import require_oracle

SUBPACKAGES = ("transformer", "models/gpt", "models/bert", "models/T5", "models/common", "tensor_parallel",
               "pipeline_parallel", "distributed", "optimizer", "dist_checkpointing", "datasets")
# GPU-only bindings: not a target on a library that runs on CPU.
GPU_ONLY = ("transformer_engine", "te_", "cuda_graph", "full_cuda_graph", "nvrx", "fused_a2a", "deepep",
            "msc_utils", "nccl_allocator", "cpu_offload", "fsdp_dtensor", "hybrid_optimizer", "energy_monitor",
            "triton", "cutlass", "flashinfer", "gpu_", "_cuda")
# Modules and names of the oracle that only bind a GPU library, each with the reason; left out of the target too.
GPU_ONLY_MODULES = {
    "megatron.core.datasets.object_storage_utils": "object storage (S3 / multi-storage client)",
    "megatron.core.datasets.utils_s3": "object storage (S3)",
    "megatron.core.distributed.fsdp.src.megatron_fsdp.mixed_precision": "Transformer Engine FP8 tensor internals",
    "megatron.core.fp4_utils": "Transformer Engine NVFP4 tensors",
    "megatron.core.transformer.custom_layers.batch_invariant_kernels": "triton kernels",
    "megatron.core.transformer.moe.grouped_gemm_util": "the grouped_gemm CUDA library",
    "megatron.core.pipeline_parallel.fine_grained_activation_offload": "pinned-memory offload on CUDA streams",
    "megatron.core.tensor_parallel.inference_layers": "Transformer Engine layers with triton symmetric-memory collectives",
    "megatron.core.transformer.custom_layers": "a package holding only the triton batch-invariant kernels",
}
GPU_ONLY_NAMES = {
    **{f"megatron.core.fp8_utils.{n}": "Transformer Engine FP8 tensors" for n in (
        "is_float8tensor", "is_mxfp8tensor", "dequantize_fp8_tensor", "modify_underlying_storage",
        "quantize_param_shard", "correct_amax_history_if_needed", "post_all_gather_processing")},
    "megatron.core.models.bert.bert_layer_specs.get_bert_layer_with_transformer_engine_spec": "Transformer Engine",
    "megatron.core.models.bert.bert_model.get_te_version": "Transformer Engine",
    "megatron.core.transformer.moe.experts.TEGroupedMLP": "Transformer Engine",
    "megatron.core.transformer.moe.token_dispatcher.MoEFlexTokenDispatcher": "DeepEP / HybridEP kernels",
    "megatron.core.transformer.enums.CudaGraphScope": "CUDA graphs",
    "megatron.core.transformer.utils.init_cuda_graph_cache": "CUDA graphs",
    "megatron.core.transformer.utils.toggle_cuda_graphs": "CUDA graphs",
    "megatron.core.transformer.moe.moe_utils.MoECudaGraphPartialCaptureSignal": "CUDA graphs",
    "megatron.core.transformer.moe.moe_utils.MoECudaGraphTensorStore": "CUDA graphs",
    "megatron.core.transformer.moe.moe_utils.maybe_skip_or_early_return_by_cudagraph": "CUDA graphs",
    "megatron.core.tensor_parallel.random.convert_cuda_rng_state": "CUDA graph-safe RNG state",
    "megatron.core.tensor_parallel.random.is_graph_safe_cuda_rng_tracker": "CUDA graph-safe RNG state",
    "megatron.core.parallel_state.get_nccl_options": "NCCL communicator options",
    "megatron.core.parallel_state.get_global_symmetric_memory_buffer": "CUDA symmetric memory",
    "megatron.core.parallel_state.destroy_global_symmetric_memory_buffer": "CUDA symmetric memory",
    "megatron.core.utils.GlobalSymmetricMemoryBuffer": "CUDA symmetric memory",
    "megatron.core.utils.configure_nvtx_profiling": "NVTX",
    "megatron.core.models.gpt.gpt_layer_specs.get_gpt_layer_with_inference_spec":
        "Transformer Engine inference layers (InferenceSpecProvider)",
    "megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer.MultiGroupUBRAllocator":
        "NCCL user-buffer registration",
    **{f"megatron.core.pipeline_parallel.utils.{n}": "CUDA streams / GPU affinity" for n in (
        "set_ideal_affinity_for_current_gpu", "stream_acquire_context", "set_streams", "get_comp_stream",
        "get_comm_stream")},
}
MODULES_PRESENT = 154
NAMES_PRESENT = 695


def _oracle_map(root, leave_out_gpu=True):
    """{module: [public names]} of the oracle package under ``root`` (the directory holding ``megatron/``)."""
    core = os.path.join(root, "megatron", "core")
    files = [os.path.join(core, f) for f in os.listdir(core) if f.endswith(".py")]
    for sub in SUBPACKAGES:
        for dirpath, _, names in os.walk(os.path.join(core, sub)):
            files += [os.path.join(dirpath, f) for f in names if f.endswith(".py")]
    out = {}
    for path in sorted(files):
        module = os.path.relpath(path, root)[:-3].replace(os.sep, ".").removesuffix(".__init__")
        if leave_out_gpu and (any(tag in module.rsplit(".", 1)[-1] for tag in GPU_ONLY) or module in GPU_ONLY_MODULES):
            continue
        tree = ast.parse(open(path, encoding="utf-8").read())
        out[module] = [node.name for node in tree.body
                       if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                       and not node.name.startswith("_")
                       and not (leave_out_gpu and f"{module}.{node.name}" in GPU_ONLY_NAMES)]
    return out


def _ours(oracle_map):
    present_modules, present_names, missing = 0, 0, []
    for module, names in oracle_map.items():
        try:
            ours = importlib.import_module(module)
        except Exception:  # noqa: BLE001 - any failure means the module is missing here
            missing.append(f"{module} (module)")
            continue
        present_modules += 1
        for name in names:
            if hasattr(ours, name):
                present_names += 1
            else:
                missing.append(f"{module}.{name}")
    return present_modules, present_names, missing


def test_public_module_map_only_grows():
    root = require_oracle()
    whole = _oracle_map(root, leave_out_gpu=False)
    stale = [m for m in GPU_ONLY_MODULES if m not in whole]
    stale += [n for n in GPU_ONLY_NAMES if n.rsplit(".", 1)[-1] not in whole.get(n.rsplit(".", 1)[0], ())]
    assert not stale, f"left out as GPU-only but not in megatron-core 0.16.1: {stale}"
    oracle_map = _oracle_map(root)
    total_modules, total_names = len(oracle_map), sum(len(v) for v in oracle_map.values())
    assert total_modules > 140 and total_names > 650, "the walk of megatron-core found too little"
    modules, names, missing = _ours(oracle_map)
    print(f"megatron-core 0.16.1 public map (GPU-only bindings left out): {modules}/{total_modules} modules, "
          f"{names}/{total_names} names exist here")
    print("missing:\n  " + "\n  ".join(missing))
    assert modules >= MODULES_PRESENT and names >= NAMES_PRESENT, (
        f"the module map shrank: {modules} modules (was {MODULES_PRESENT}), {names} names (was {NAMES_PRESENT})")
