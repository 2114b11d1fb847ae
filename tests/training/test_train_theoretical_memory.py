"""tools/report_theoretical_memory.py against what a built model and optimizer really hold on CPU.

Each configuration is set up the way pretrain_gpt.py does it (initialize_megatron + setup_model_and_optimizer)
on 2 gloo ranks, one optimizer step materialises Adam's state, and the storage of every tensor the model, the
DDP gradient buffers and the optimizer own is summed (each storage once). The theoretical numbers come from the
same validated args through megatron.training.theoretical_memory (the storages are counted by
megatron.core.distributed.memory).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers.dist_harness import run_distributed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "1", "--train-iters", "10", "--lr", "1e-3",
        "--vocab-size", "1000", "--tokenizer-type", "NullTokenizer", "--distributed-backend", "gloo"]

CONFIGS = {
    "fp32": [],
    "fp32 distributed optimizer": ["--use-distributed-optimizer"],
    "bf16 distributed optimizer": ["--bf16", "--use-distributed-optimizer"],
    "fp16": ["--fp16"],
    "fp16 distributed optimizer": ["--fp16", "--use-distributed-optimizer"],
    "bf16 TP2 swiglu GQA untied RMSNorm no bias": [
        "--bf16", "--tensor-model-parallel-size", "2", "--swiglu", "--group-query-attention", "--num-query-groups",
        "2", "--untie-embeddings-and-output-weights", "--normalization", "RMSNorm", "--disable-bias-linear"],
    "fp32 PP2": ["--pipeline-model-parallel-size", "2"],
    # MoE: 4 experts on 2 EP ranks in layers 0 and 2 (dense MLP in 1 and 3), a shared expert; the distributed
    # optimizer shards the dense state over DP=2 and the expert state over expert DP=1.
    "fp32 MoE EP2 shared expert distributed optimizer": [
        "--num-experts", "4", "--expert-model-parallel-size", "2", "--moe-layer-freq", "2", "--swiglu",
        "--disable-bias-linear", "--moe-ffn-hidden-size", "48", "--moe-shared-expert-intermediate-size", "32",
        "--use-distributed-optimizer"],
    # DeepSeek-V3's ingredients: multi-latent attention (q and kv LoRA, latent norms), a dense first layer then MoE
    # with a shared expert, one multi-token-prediction depth on the last stage (which also holds an embedding).
    "bf16 PP2 MLA MoE MTP distributed optimizer": [
        "--bf16", "--pipeline-model-parallel-size", "2", "--multi-latent-attention", "--q-lora-rank", "24",
        "--kv-lora-rank", "16", "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "8",
        "--qk-layernorm", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
        "--position-embedding-type", "rope", "--num-experts", "4", "--moe-layer-freq", "[0]+[1]*3",
        "--moe-ffn-hidden-size", "16", "--moe-shared-expert-intermediate-size", "16", "--mtp-num-layers", "1",
        "--use-distributed-optimizer"],
}


def measure_body(configs):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed.memory import resident_state_bytes
    from megatron.training import global_vars
    from megatron.training.initialize import initialize_megatron
    from megatron.training.theoretical_memory import report_theoretical_memory
    from megatron.training.training import setup_model_and_optimizer
    from helpers.train_helpers import load_entry_point

    gpt = load_entry_point("pretrain_gpt")
    results = {}
    for name, extra in configs.items():
        initialize_megatron(argv=BASE + extra, args_defaults={"tokenizer_type": "NullTokenizer"})
        args = global_vars.get_args()
        model, optimizer, _ = setup_model_and_optimizer(gpt.model_provider, gpt.ModelType.encoder_or_decoder)
        for chunk in model:
            for p in chunk.parameters():
                p.main_grad.add_(1e-3)  # any gradient: the step only has to create Adam's state
        optimizer.step()
        params = list(p for chunk in model for p in chunk.parameters())
        held = resident_state_bytes(model, optimizer)  # every storage once: weights, grads, optimizer
        weights, grads, optimizer_bytes = held["weights"], held["grads"], held["optimizer"]
        stage = ps.get_pipeline_model_parallel_rank()
        args.model_name = "gpt"
        report = report_theoretical_memory(args)
        results[name] = {
            "measured": (weights, grads, optimizer_bytes),
            "numel": sum(p.numel() for p in params),
            "theory": (report.weights[stage], report.grads[stage], report.optimizer[stage]),
            "theory_numel": report.params[stage], "bytes_per_param": report.bytes_per_param,
        }
        global_vars.destroy_global_vars()
        ps.destroy_model_parallel()
    return results


def test_theoretical_memory_matches_built_model_and_optimizer():
    per_rank = run_distributed(measure_body, 2, CONFIGS, timeout=240)
    for rank, results in enumerate(per_rank):
        for name, r in results.items():
            assert r["numel"] == r["theory_numel"], (rank, name, r)
            for what, measured, theory in zip(("weights", "grads", "optimizer"), r["measured"], r["theory"]):
                assert abs(measured - theory) <= 0.10 * theory, (rank, name, what, measured, theory)
            print(f"rank {rank} {name}: measured {r['measured']} theory {tuple(int(x) for x in r['theory'])} "
                  f"bytes/param {r['bytes_per_param']}")
    # Megatron's published bytes per parameter (README: 20 -> 4 + 16/d, 18 -> 6 + 12/d, 16 -> 8 + 8/d), d = 2
    bpp = {name: sum(r["bytes_per_param"].values()) for name, r in per_rank[0].items()}
    assert bpp["fp32"] == 16 and bpp["fp16"] == 20
    assert bpp["fp32 distributed optimizer"] == 8 + 8 / 2
    assert bpp["bf16 distributed optimizer"] == 6 + 12 / 2
    assert bpp["fp16 distributed optimizer"] == 4 + 16 / 2


def test_report_theoretical_memory_cli_for_gpt3_175B():
    flags = ["--world-size", "1024", "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "16",
             "--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96", "--seq-length", "2048",
             "--max-position-embeddings", "2048", "--micro-batch-size", "1", "--global-batch-size", "1536",
             "--train-samples", "146484375", "--lr", "6e-5", "--vocab-size", "50257", "--bf16",
             "--sequence-parallel", "--recompute-activations", "--use-distributed-optimizer"]
    out = subprocess.run([sys.executable, os.path.join(REPO, "tools", "report_theoretical_memory.py"), *flags],
                         capture_output=True, text=True, check=True).stdout
    assert "world 1024 = TP 8 x PP 16 x DP 8" in out, out
    assert "~175.4" in out, out  # GPT-3's 175B parameters
    # bf16 with the distributed optimizer over DP 8: 2 + 4 + 12/8 bytes per parameter
    assert "weights 2 + grads 4 + optimizer 1.5" in out, out
    # selective recompute + SP (Korthikanti et al. 2022): 34 s b h / t bytes per layer x 6 layers x 16
    # micro-batches in flight on stage 0, plus the embedding output (2 + 1 bytes per element) of those 16
    sbh_t = 2048 * 12288 / 8
    expected = (34 * sbh_t * 6 * 16 + 3 * sbh_t * 16) / 2**30
    rows = [line.split() for line in out.splitlines() if line.startswith("True") and "selective" in line]
    assert rows and abs(float(rows[0][3]) - expected) < 0.01, (expected, out)


def test_report_theoretical_memory_cli_errors():
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tools", "report_theoretical_memory.py"),
                           "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                           "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1"],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "--vocab-size" in proc.stderr
