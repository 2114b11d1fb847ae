"""Fully sharded data parallelism (--use-torch-fsdp2, --use-megatron-fsdp with its four strategies) against the
unsharded DDP run, on 4 gloo ranks in one launch.

For each layout (DP=4; TP=2 x DP=2 with sequence parallelism; CP=2 x DP=2, where FSDP shards over the 4 DP x CP
ranks; MoE: TP=2 x DP=2 with sequence parallelism, a dense gated-MLP layer then an MoE layer of 4 experts over EP=4,
expert TP 1, dropout on) the per-iteration losses and grad norms of 10 iterations of every sharded run (the bucketed
no_shard / optim at DP=4, --use-torch-fsdp2 at DP=4 and TP=2 x DP=2, the FSDP2 strategies of Megatron-FSDP at DP=4
and in the MoE layout, ZeRO-3 with CP) equal the plain DDP run's within 1e-6 relative (fp32, a small random-token
corpus). ``--use-torch-fsdp2`` is not allowed with expert parallelism (Megatron's rule). At EP=4 each expert's FSDP
mesh is one rank, where FSDP2 divides the gradients itself and the gloo reduction must not divide them again (EP=2,
2-rank expert meshes, trains in test_ckpt_fsdp.py).

The MoE layout also covers the two features that change how the model is built, against the same DDP run:
``--moe-grouped-gemm`` (the ZeRO-2 run has GroupedMLP experts, the DDP reference SequentialMLP ones) and
``--init-model-with-meta-device`` (the ZeRO-1 and ZeRO-3 runs build on the meta device and materialise whole
weights / DTensor shards). Its runs keep the library's own initialisation from --seed (the other layouts set
deterministic weights), so the meta-device runs must hold, after materialisation, bitwise the weights of the DDP
run without the flag; their dropout masks then agree too (the losses above).

The runs also record how the model was wrapped: the FSDP2 strategies hold DTensor parameters whose local blocks
add up to about a quarter (DP=4) / half (DP=2) of the unsharded parameter count, the bucketed strategies (no_shard,
optim) the whole model; optim really builds the distributed optimizer. Megatron's flag checks give their one-line
messages.
"""
import math
from types import SimpleNamespace

import pytest
import torch

from helpers.args_test_helpers import clean_env, validated  # noqa: F401 - fixture
from helpers.data_support import random_token_corpus
from helpers.dist_harness import run_distributed
from helpers.train_helpers import run_pretrain

REL_TOL = 1e-6
TINY = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--split", "100,0,0", "--num-layers", "2",
        "--seq-length", "16", "--max-position-embeddings", "16", "--train-iters", "10", "--log-interval", "1",
        "--eval-iters", "0", "--untie-embeddings-and-output-weights", "--no-gradient-accumulation-fusion"]
MOE = ["--swiglu", "--disable-bias-linear", "--num-experts", "4", "--moe-router-topk", "2",
       "--moe-aux-loss-coeff", "1e-2", "--expert-model-parallel-size", "4"]
TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
FSDP2 = ["--use-torch-fsdp2", "--ckpt-format", "torch_dist"]
GROUPED = ["--moe-grouped-gemm"]
META = ["--init-model-with-meta-device"]
MOE_LAYOUT = TP2 + MOE + ["--expert-tensor-parallel-size", "1", "--moe-layer-freq", "([0]*1+[1]*1)",
                          "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]


def _mfsdp(strategy):
    return ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor", "--data-parallel-sharding-strategy", strategy]


STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
LAYOUTS = {"dp4": [], "tp2_dp2": TP2, "cp2_dp2": ["--context-parallel-size", "2"], "moe": MOE_LAYOUT}
# no_shard and optim are our DDP and distributed optimizer (tests/training/test_train_layouts.py and
# test_train_moe_parity.py compare those at TP=2 and EP=2): here at DP=4 (and optim built on the meta device).
# Megatron-FSDP at TP=2 x DP=2 runs in the MoE layout (a dense gated MLP layer, then an MoE layer); the dense
# TP=2 layout has FSDP2's units (embedding and output layer sharded apart).
MEGATRON_FSDP = {"dp4": {s: [] for s in STRATEGIES}, "tp2_dp2": {},
                 "cp2_dp2": {"optim_grads_params": []},
                 "moe": {"optim": META, "optim_grads": GROUPED, "optim_grads_params": META}}
RUNS = []
for layout, extra in LAYOUTS.items():
    RUNS.append((layout, "ddp", extra))
    if layout in ("dp4", "tp2_dp2"):
        RUNS.append((layout, "torch_fsdp2", extra + FSDP2))
    RUNS += [(layout, s, extra + _mfsdp(s) + more) for s, more in MEGATRON_FSDP[layout].items()]

def _flag_value(extra, flag):
    return extra[extra.index(flag) + 1] if flag in extra else None


def _full_weights(chunk):
    """This rank's tensor-parallel-local weights, whole (FSDP2 shards gathered), by parameter name."""
    return {name.split("module.", 1)[-1]: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for name, p in chunk.named_parameters()}


def _run_recording(extra, data, layout):
    """run_pretrain, also recording the wrapper, the optimizer class and this rank's parameter elements."""
    from megatron.training import training as training_mod

    seen = {}
    original_get_model, original_setup = training_mod.get_model, training_mod.setup_model_and_optimizer

    def get_model(*args, **kwargs):
        model = original_get_model(*args, **kwargs)
        params = list(model[0].parameters())
        seen["wrapper"] = type(model[0]).__name__
        seen["dtensor"] = all(type(p).__name__ == "DTensor" or hasattr(p, "to_local") for p in params)
        seen["local_numel"] = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in params)
        seen["global_numel"] = sum(p.numel() for p in params)
        if layout == "moe":
            seen["weights"] = _full_weights(model[0])
        return model

    def setup(*args, **kwargs):
        model, optimizer, scheduler = original_setup(*args, **kwargs)
        seen["optimizer"] = type(optimizer).__name__
        seen["objects"] = (model, optimizer)
        return model, optimizer, scheduler

    training_mod.get_model, training_mod.setup_model_and_optimizer = get_model, setup
    try:
        records = run_pretrain("pretrain_gpt", TINY + ["--data-path", data] + list(extra),
                               deterministic=layout != "moe")
    finally:
        training_mod.get_model, training_mod.setup_model_and_optimizer = original_get_model, original_setup
    seen["curve"] = [(r["loss"]["lm loss"], r["grad_norm"]) for r in records]
    # What the parameters, gradients and optimizer hold after the last step, and the formula's bytes per parameter
    from megatron.core.distributed.memory import resident_state_bytes
    from megatron.training.theoretical_memory import bytes_per_parameter, sharding_strategy

    model, optimizer = seen.pop("objects")
    seen["memory"] = resident_state_bytes(model, optimizer)
    args = SimpleNamespace(fp16=False, bf16=False, optimizer="adam", sgd_momentum=0.0, data_parallel_size=4,
                           context_parallel_size=1, accumulate_allreduce_grads_in_fp32=False,
                           use_torch_fsdp2="--use-torch-fsdp2" in extra, use_megatron_fsdp="--use-megatron-fsdp" in extra,
                           data_parallel_sharding_strategy=_flag_value(extra, "--data-parallel-sharding-strategy"),
                           use_distributed_optimizer=False)
    seen["formula"] = {k: v * seen["global_numel"] for k, v in
                       bytes_per_parameter(args, False, sharding_strategy(args)).items()}
    return seen


def runs_body(runs, data):
    return {(layout, name): _run_recording(extra, data, layout) for layout, name, extra in runs}


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    data = random_token_corpus(str(tmp_path_factory.mktemp("fsdp_data") / "tokens"), 128)
    return run_distributed(runs_body, 4, RUNS, data, timeout=600)


def _worst(curve, ref):
    return max(max(abs(a - b) / abs(b), abs(ga - gb) / gb) for (a, ga), (b, gb) in zip(curve, ref))


@pytest.mark.timeout(700)
def test_sharded_losses_and_grad_norms_equal_ddp(fsdp_runs):
    last = fsdp_runs[-1]  # the last rank logs the losses
    report = []
    for layout in LAYOUTS:
        ref = last[(layout, "ddp")]["curve"]
        assert len(ref) == 10 and all(math.isfinite(x) for x, _ in ref)
        for (lay, name), run in last.items():
            if lay != layout or name == "ddp":
                continue
            worst = _worst(run["curve"], ref)
            report.append(f"{layout}/{name}: {worst:.1e}")
            assert len(run["curve"]) == 10 and worst <= REL_TOL, \
                f"{layout}/{name}: {worst:.2e}\n{run['curve']}\n{ref}"
    print("max relative difference to DDP (loss, grad norm):", "; ".join(report))


def test_meta_device_build_draws_the_weights_of_the_ordinary_build(fsdp_runs):
    """--init-model-with-meta-device: after materialisation every rank's weights (FSDP2 shards gathered) are bitwise
    those of the run without the flag (the same seed, the library's own initialisation)."""
    for rank in fsdp_runs:
        want = rank[("moe", "ddp")]["weights"]
        for name in ("optim", "optim_grads_params"):
            got = rank[("moe", name)]["weights"]
            assert got.keys() == want.keys(), (name, sorted(set(got) ^ set(want)))
            differ = [k for k in want if not torch.equal(got[k], want[k])]
            assert not differ, (name, differ)


def test_sharding_engines_and_optimizers(fsdp_runs):
    for rank in fsdp_runs:
        for (layout, name), run in rank.items():
            dp = 4 if layout == "dp4" else 2
            if name in ("torch_fsdp2", "optim_grads", "optim_grads_params"):
                assert run["dtensor"] and run["optimizer"] == "FullyShardedOptimizer", (layout, name, run)
                # Each DTensor holds its torch.chunk row block: about 1/DP of the rows (uneven blocks are allowed).
                share = run["local_numel"] / run["global_numel"]
                assert share < 1.5 / dp, (layout, name, share)
            else:
                assert not run["dtensor"] and run["local_numel"] == run["global_numel"], (layout, name)
                expected = "DistributedOptimizer" if name == "optim" else "FP32Optimizer"
                assert run["optimizer"] == expected, (layout, name, run["optimizer"])
            wrapper = {"ddp": "DistributedDataParallel", "torch_fsdp2": "TorchFullyShardedDataParallel"}.get(name)
            assert run["wrapper"] == (wrapper or ("_BucketedFSDP" if name in ("no_shard", "optim")
                                                  else "_FullyShardedFSDP")), (name, run["wrapper"])


def test_resident_memory_matches_the_formulas_at_dp4(fsdp_runs):
    """Weights, gradients and optimizer state each rank holds after the last step (storages, padding included)
    against megatron/training/theoretical_memory.py (fp32 Adam: no_shard 16 bytes per parameter, ZeRO-1 8 + 8/d,
    ZeRO-2 4 + 16/d, ZeRO-3 16/d with d = 4), within 5% (FSDP2's row blocks and the buckets are padded)."""
    for rank in fsdp_runs:
        for (layout, name), run in rank.items():
            if layout != "dp4" or name == "ddp":
                continue
            for kind in ("weights", "grads", "optimizer"):
                got, want = run["memory"][kind], run["formula"][kind]
                assert abs(got - want) <= 0.05 * want + 1, (name, kind, got, want)
    print({name: (run["memory"], {k: int(v) for k, v in run["formula"].items()})
           for (layout, name), run in fsdp_runs[0].items() if layout == "dp4"})


BAD_FLAGS = [
    ("--use-torch-fsdp2 --use-megatron-fsdp --ckpt-format fsdp_dtensor", "cannot be used together"),
    ("--use-torch-fsdp2 --untie-embeddings-and-output-weights", "not supported with gradient accumulation fusion"),
    ("--use-torch-fsdp2 --no-gradient-accumulation-fusion", "requires --untie-embeddings-and-output-weights"),
    ("--use-torch-fsdp2 --no-gradient-accumulation-fusion --untie-embeddings-and-output-weights --ckpt-format torch",
     "requires --ckpt-format torch_dist or torch_dcp"),
    ("--use-torch-fsdp2 --no-gradient-accumulation-fusion --untie-embeddings-and-output-weights "
     "--use-distributed-optimizer", "not supported with MCore's distributed optimizer"),
    ("--use-torch-fsdp2 --no-gradient-accumulation-fusion --untie-embeddings-and-output-weights --fp16",
     "not supported with fp16"),
    ("--use-megatron-fsdp", "Megatron FSDP only supports fsdp_dtensor checkpoint format"),
    ("--ckpt-format fsdp_dtensor", "only supported with Megatron FSDP"),
    ("--ckpt-format torch_dcp", "only supported with --use-torch-fsdp2"),
    ("--use-megatron-fsdp --ckpt-format fsdp_dtensor --megatron-fsdp-version 2", "not available in this library"),
    ("--use-megatron-fsdp --ckpt-format fsdp_dtensor --num-distributed-optimizer-instances 2",
     "hybrid sharded data parallelism"),
    ("--use-megatron-fsdp --ckpt-format fsdp_dtensor --megatron-fsdp-main-params-dtype bf16", "fp32 main weights"),
    ("--use-torch-fsdp2 --no-gradient-accumulation-fusion --untie-embeddings-and-output-weights --num-experts 2 "
     "--moe-grouped-gemm --disable-bias-linear --save /tmp/x", "--moe-grouped-gemm and --ckpt-format torch_dist checkpoints is not available"),
    ("--init-model-with-meta-device", "--init-model-with-meta-device needs --use-megatron-fsdp or --use-torch-fsdp2"),
    ("--use-megatron-fsdp --ckpt-format fsdp_dtensor --data-parallel-sharding-strategy no_shard "
     "--init-model-with-meta-device", "not supported for no_shard data parallel sharding strategy"),
]


@pytest.mark.parametrize("extra,message", BAD_FLAGS)
def test_fsdp_flag_checks(clean_env, extra, message):  # noqa: F811
    from megatron.training.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match=message):
        validated(extra, world_size=2)


def test_fsdp_defaults_and_derived_settings(clean_env):  # noqa: F811
    args = validated("", world_size=2)
    assert (args.use_torch_fsdp2, args.use_megatron_fsdp, args.data_parallel_sharding_strategy,
            args.torch_fsdp2_reshard_after_forward, args.strict_fsdp_dtensor_load, args.megatron_fsdp_version) == (
        False, False, "optim_grads_params", True, True, 1)
    args = validated("--use-megatron-fsdp --ckpt-format fsdp_dtensor --data-parallel-sharding-strategy optim_grads",
                     world_size=2)
    # Megatron-FSDP version 1 turns the distributed optimizer on; ZeRO-2/3 turn gradient accumulation fusion off.
    assert args.use_distributed_optimizer and args.use_custom_fsdp and not args.gradient_accumulation_fusion
