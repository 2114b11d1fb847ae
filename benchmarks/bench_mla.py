"""CPU benchmark: our multi-latent attention layer vs megatron-core 0.16.1's ``MLASelfAttention``, side by side.

    python benchmarks/bench_mla.py [--seq 1024] [--batch 1] [--hidden 1024] [--heads 16] [--q-lora-rank 384]
                                   [--kv-lora-rank 256] [--qk-head-dim 64] [--qk-pos-emb-head-dim 32]
                                   [--v-head-dim 64] [--iters 5] [--threads 2] [--oracle DIR]

One forward + backward of one MLA layer (query compression, latent norms, YaRN, causal attention) over
``--batch x --seq`` tokens, fp32, one process, TP = 1. Both rows use the same weights and input (their outputs are
compared: "max |diff|"). The megatron-core row runs in a subprocess with the oracle install (``--oracle``, default
``$MCORE_ORACLE_DIR`` or ``.venv/mcore-oracle``) as its only ``PYTHONPATH`` entry. Its local spec cannot build MLA on
CPU as it is (its DotProductAttention refuses MLA's ``k_channels`` / ``v_channels``; Transformer Engine's is the one
that takes them, and MLASelfAttention tests ``isinstance(..., TELinear)``), so that row gets a core attention of
``torch.nn.functional.scaled_dot_product_attention`` with MLA's scale (the kernel our row uses too) and a stand-in
TELinear class: the comparison measures the projections, norms, RoPE and plumbing around the same attention kernel.
The rows are timed in ``--rounds`` alternating rounds (the megatron-core layer waits in its subprocess), each the median
of ``--iters`` steps after 2 warm-up steps; the table gives the median round, tokens/s and the ratio to ours.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Runs under the oracle's PYTHONPATH: megatron-core's MLASelfAttention on the given weights and input.
ORACLE = r"""
import json, os, statistics, sys, time, torch
spec = json.load(open(sys.argv[1]))
torch.set_num_threads(spec["threads"])
torch.cuda.current_device = lambda: "cpu"
torch.cuda.is_available = lambda: False
torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
torch.cuda.set_rng_state = lambda *a, **k: None
torch.cuda.manual_seed = lambda *a, **k: None
torch.distributed.init_process_group("gloo", init_method="file://" + spec["init"], rank=0, world_size=1)
from megatron.core import parallel_state as ps, tensor_parallel
ps.initialize_model_parallel(1, 1)
tensor_parallel.model_parallel_cuda_manual_seed(1)
import megatron.core.transformer.multi_latent_attention as mla
from megatron.core.transformer.transformer_config import MLATransformerConfig
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import build_module

class SDPAttention(torch.nn.Module):
    def __init__(self, config, layer_number, attn_mask_type, attention_type=None, softmax_scale=None,
                 k_channels=None, v_channels=None, cp_comm_type=None, pg_collection=None):
        super().__init__()
        self.scale = softmax_scale
    def forward(self, q, k, v, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None):
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)

if not isinstance(mla.TELinear, type):
    mla.TELinear = type("TELinearStandIn", (), {})
config = MLATransformerConfig(**spec["config"], params_dtype=torch.float32, bias_activation_fusion=False,
                              masked_softmax_fusion=False, bias_dropout_fusion=False, persist_layer_norm=False,
                              gradient_accumulation_fusion=False, apply_rope_fusion=False)
attn_spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True,
                                     normalization="RMSNorm").submodules.self_attention
attn_spec.submodules.core_attention = SDPAttention
layer = build_module(attn_spec, config=config, layer_number=1)
state = torch.load(spec["weights"])
missing = layer.load_state_dict(state, strict=False)
assert not missing.missing_keys, missing.missing_keys
x = torch.load(spec["input"]).requires_grad_(True)
out = layer(x, None)[0]
torch.save(out.detach(), spec["output"])
print("ready", flush=True)
for line in sys.stdin:  # one timing round per line, interleaved with the parent's rounds of our layer
    times = []
    for i in range(spec["iters"] + 2):
        x.grad = None
        t0 = time.perf_counter()
        out = layer(x, None)[0]
        out.sum().backward()
        if i >= 2:
            times.append((time.perf_counter() - t0) * 1e3)
    print(json.dumps({"ms": statistics.median(times)}), flush=True)
"""


def _config(args) -> dict:
    return dict(num_layers=1, hidden_size=args.hidden, num_attention_heads=args.heads, q_lora_rank=args.q_lora_rank,
                kv_lora_rank=args.kv_lora_rank, qk_head_dim=args.qk_head_dim,
                qk_pos_emb_head_dim=args.qk_pos_emb_head_dim, v_head_dim=args.v_head_dim, rotary_scaling_factor=40.0,
                mscale=1.0, mscale_all_dim=1.0, qk_layernorm=True, normalization="RMSNorm", add_bias_linear=False,
                hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True)


def _ours(args, work):
    """(a function timing one round of our layer's forward + backward, its output); writes its weights and input
    for the other row."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_mla_self_attention_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    torch.distributed.init_process_group("gloo", init_method="file://" + os.path.join(work, "ours_init"), rank=0,
                                         world_size=1)
    ps.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    layer = build_module(get_mla_self_attention_spec(qk_layernorm=True), config=MLATransformerConfig(**_config(args)),
                         layer_number=1)
    with torch.no_grad():  # norms away from 1, so a missing norm would show in the comparison
        for name, p in layer.named_parameters():
            if "layernorm" in name:
                p.uniform_(0.5, 1.5)
    x = torch.randn(args.seq, args.batch, args.hidden, generator=torch.Generator().manual_seed(0)).requires_grad_(True)
    torch.save(layer.state_dict(), os.path.join(work, "weights.pt"))
    torch.save(x.detach(), os.path.join(work, "input.pt"))
    out = layer(x, None)[0]

    def round_ms():
        times = []
        for i in range(args.iters + 2):
            x.grad = None
            t0 = time.perf_counter()
            y = layer(x, None)[0]
            y.sum().backward()
            if i >= 2:
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return round_ms, out.detach()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("--seq", 1024), ("--batch", 1), ("--hidden", 1024), ("--heads", 16),
                          ("--q-lora-rank", 384), ("--kv-lora-rank", 256), ("--qk-head-dim", 64),
                          ("--qk-pos-emb-head-dim", 32), ("--v-head-dim", 64), ("--iters", 5), ("--threads", 2)):
        parser.add_argument(flag, type=int, default=default)
    parser.add_argument("--rounds", type=int, default=3,
                        help="alternating timing rounds of the two rows (a busy machine's load drifts)")
    parser.add_argument("--oracle", default=os.environ.get("MCORE_ORACLE_DIR",
                                                           os.path.join(REPO, ".venv", "mcore-oracle")))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    sys.path.insert(0, REPO)
    with tempfile.TemporaryDirectory() as work:
        ours_round, ours_out = _ours(args, work)
        spec = dict(config=_config(args), threads=args.threads, iters=args.iters, init=os.path.join(work, "init"),
                    weights=os.path.join(work, "weights.pt"), input=os.path.join(work, "input.pt"),
                    output=os.path.join(work, "oracle_out.pt"))
        with open(os.path.join(work, "spec.json"), "w") as f:
            json.dump(spec, f)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env.update(PYTHONPATH=args.oracle, OMP_NUM_THREADS=str(args.threads))
        proc = subprocess.Popen([sys.executable, "-c", ORACLE, os.path.join(work, "spec.json")], cwd=work, env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if proc.stdout.readline().strip() != "ready":
            raise SystemExit(f"megatron-core row failed (is {args.oracle} the megatron-core 0.16.1 install?):\n"
                             f"{proc.communicate()[1][-3000:]}")
        ours_rounds, oracle_rounds = [], []
        for _ in range(args.rounds):
            ours_rounds.append(ours_round())
            proc.stdin.write("time\n")
            proc.stdin.flush()
            oracle_rounds.append(json.loads(proc.stdout.readline())["ms"])
        proc.stdin.close()
        proc.wait()
        ours_ms, oracle_ms = statistics.median(ours_rounds), statistics.median(oracle_rounds)
        diff = float((torch.load(spec["output"]) - ours_out).abs().max())
    tokens = args.seq * args.batch
    print(f"MLA layer forward+backward, {tokens} tokens (seq {args.seq} x batch {args.batch}), hidden {args.hidden}, "
          f"{args.heads} heads, q_lora {args.q_lora_rank}, kv_lora {args.kv_lora_rank}, qk {args.qk_head_dim}+"
          f"{args.qk_pos_emb_head_dim}, v {args.v_head_dim}; fp32, {args.threads} threads; median of {args.rounds} "
          f"alternating rounds, each the median of {args.iters} steps")
    print(f"{'implementation':<50} {'ms':>9} {'tokens/s':>10} {'vs ours':>8}")
    for name, ms in (("ours (MLASelfAttention)", ours_ms), ("megatron-core 0.16.1 MLASelfAttention (SDPA core)",
                                                              oracle_ms)):
        print(f"{name:<50} {ms:>9.1f} {tokens / ms * 1e3:>10.0f} {ours_ms / ms:>8.2f}")
    print(f"outputs: max |diff| {diff:.2e}")


if __name__ == "__main__":
    main()
