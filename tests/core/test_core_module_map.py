"""megatron-core's public module map, ours against the real megatron-core 0.16.1 (the oracle's installed files).

The oracle's modules are read with ``ast`` (never imported here): every module of the training sub-packages
(transformer, models/gpt, models/bert, models/T5, models/common, tensor_parallel, pipeline_parallel, distributed,
optimizer, dist_checkpointing, datasets) and the top-level modules of ``megatron.core``, and the public classes and
functions each defines at module level. Ours are imported: a module exists when ``import megatron.core.<name>``
works, a name when that module has the attribute. Modules that bind a GPU-only library (Transformer Engine, CUDA
graphs, NVRx, DeepEP, object storage) are left out of the target.

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
MODULES_PRESENT = 123
NAMES_PRESENT = 498


def _oracle_map(root):
    """{module: [public names]} of the oracle package under ``root`` (the directory holding ``megatron/``)."""
    core = os.path.join(root, "megatron", "core")
    files = [os.path.join(core, f) for f in os.listdir(core) if f.endswith(".py")]
    for sub in SUBPACKAGES:
        for dirpath, _, names in os.walk(os.path.join(core, sub)):
            files += [os.path.join(dirpath, f) for f in names if f.endswith(".py")]
    out = {}
    for path in sorted(files):
        module = os.path.relpath(path, root)[:-3].replace(os.sep, ".").removesuffix(".__init__")
        if any(tag in module.rsplit(".", 1)[-1] for tag in GPU_ONLY):
            continue
        tree = ast.parse(open(path, encoding="utf-8").read())
        out[module] = [node.name for node in tree.body
                       if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                       and not node.name.startswith("_")]
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
    oracle_map = _oracle_map(require_oracle())
    total_modules, total_names = len(oracle_map), sum(len(v) for v in oracle_map.values())
    assert total_modules > 150 and total_names > 700, "the walk of megatron-core found too little"
    modules, names, missing = _ours(oracle_map)
    print(f"megatron-core 0.16.1 public map (GPU-only bindings left out): {modules}/{total_modules} modules, "
          f"{names}/{total_names} names exist here")
    print("missing:\n  " + "\n  ".join(missing))
    assert modules >= MODULES_PRESENT and names >= NAMES_PRESENT, (
        f"the module map shrank: {modules} modules (was {MODULES_PRESENT}), {names} names (was {NAMES_PRESENT})")
