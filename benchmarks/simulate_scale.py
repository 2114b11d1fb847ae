"""Benchmark: one rank of a 1024-GPU job on this machine (--fake-process-group), per distinct rank role: parameter
bytes, activation bytes and communication per iteration, measured, side by side with the closed forms of
docs/performance.md ("Scaling on paper", "Memory").

    python benchmarks/simulate_scale.py [--config gpt3-175b] [--probe-hidden 768] [--probe-seq 64] [--materialize]

For every role (GPT-3 175B, TP 8 x PP 16 x DP 8: the first stage, rank 0; a middle stage, rank 511; the last stage,
rank 1023) two child processes run, each as that rank of the 1024-rank job with a fake process group (every
collective a no-op), built by the library's own set-up:

* **structure**, at full size: ``initialize_megatron`` + ``setup_model_and_optimizer`` on the meta device (real
  shapes and dtypes, no memory). Parameters held and the bytes of weights + gradient buffer + optimizer state
  (the storages the rank owns), against tools/report_theoretical_memory.py.
* **probe**: ``pretrain`` for one iteration with real tensors (``--materialize``: at full width, about 10 GiB of
  RAM per rank; otherwise at ``--probe-hidden``), the sequence cut to ``--probe-seq`` and the global batch to 2
  micro-batches per data-parallel rank. ``megatron.core.comm_accounting.CommAccountant`` counts every collective
  and point-to-point payload of the iteration per process group; a saved-tensor hook measures the peak bytes of
  activations held for backward over the 1F1B schedule. Both are printed next to the closed forms evaluated at the
  probe's sizes (the check), and the closed forms at full size (the prediction: sequence 2048, 192 micro-batches).

The closed forms are the dense-GPT ones of docs/performance.md (tied embeddings, no sequence parallelism, 1F1B,
the distributed optimizer), written out here; activations are Korthikanti et al.'s ``s b h (34 + 5 a s / h)`` bytes
per layer and micro-batch in flight (megatron/training/theoretical_memory.py). ``--config deepseek-v3``: DeepSeek-V3
(MLA, 256-expert MoE, one MTP depth) with EP 64 on the same 1024 ranks: parameters and state bytes against the
closed forms, the probe's communication per group measured (docs/performance.md has no MoE closed form).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import weakref

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

MiB, GiB = 2.0 ** 20, 2.0 ** 30
WORLD = 1024
ROLES = {"first stage": 0, "middle stage": 511, "last stage": 1023}  # GPT-3 175B, TP 8 x PP 16 x DP 8


def gpt3_175b_flags(tmp):
    from megatron.training.rank_report import script_options

    gpt2 = os.path.join(REPO, "data", "tokenizers", "gpt2")
    words = script_options(os.path.join(REPO, "examples", "pretrain_gpt3_175B.sh"), {
        "DATASET": "", "VOCAB_FILE": f"{gpt2}/vocab.json", "MERGE_FILE": f"{gpt2}/merges.txt",
        "CHECKPOINT_PATH": os.path.join(tmp, "ckpt"), "TENSORBOARD_DIR": os.path.join(tmp, "tb")})
    words.remove("--data-path")
    return words + ["--mock-data", "--use-distributed-optimizer", "--tokenizer-type", "NullTokenizer",
                    "--vocab-size", "50257"]


def _entry():
    import importlib.util

    spec = importlib.util.spec_from_file_location("pretrain_gpt", os.path.join(REPO, "pretrain_gpt.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------------------- children
def child_structure(flags, rank):
    from megatron.training.rank_report import build_rank

    gpt = _entry()
    report = build_rank(flags, rank, WORLD, gpt.model_provider, gpt.ModelType.encoder_or_decoder,
                        args_defaults={"tokenizer_type": "NullTokenizer"})
    return {k: report[k] for k in ("params", "formula_params", "measured", "theory", "activations", "coords")}


class SavedActivations:
    """Peak bytes of the tensors autograd keeps for backward (each storage once, released when autograd drops it)."""

    def __init__(self):
        self.live, self.peak, self.refs = 0, 0, {}

    def _release(self, key, nbytes):
        self.refs[key] -= 1
        if self.refs[key] == 0:
            del self.refs[key]
            self.live -= nbytes

    def pack(self, tensor):
        import torch

        if isinstance(tensor, torch.nn.Parameter) or (tensor.requires_grad and tensor.grad_fn is None):
            return tensor  # a parameter (a leaf): memory of the weights, not an activation (and kept as is)
        holder = _Holder(tensor)
        storage = tensor.untyped_storage()
        key, nbytes = storage._cdata, storage.nbytes()
        if key not in self.refs:
            self.refs[key] = 0
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        self.refs[key] += 1
        weakref.finalize(holder, self._release, key, nbytes)
        return holder

    @staticmethod
    def unpack(packed):
        return packed.tensor if isinstance(packed, _Holder) else packed


class _Holder:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


def child_probe(flags, rank):
    import torch

    from megatron.core.comm_accounting import CommAccountant
    from megatron.training import global_vars, training
    from megatron.training.rank_report import _launch_env

    gpt = _entry()
    result = {}
    original = training.train_step

    def measured_step(*args, **kwargs):
        if result:
            return original(*args, **kwargs)
        saved, accountant = SavedActivations(), CommAccountant()
        with accountant, torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            out = original(*args, **kwargs)
        result.update(comm=accountant.summary(), activation_peak=saved.peak)
        from megatron.training.theoretical_memory import report_theoretical_memory

        a = global_vars.get_args()
        stage = __import__("megatron.core.parallel_state", fromlist=["x"]).get_pipeline_model_parallel_rank()
        report = report_theoretical_memory(a)
        result.update(activations_theory=report.activations[stage], params=report.params[stage],
                      padded_vocab=a.padded_vocab_size, micro_batches=a.global_batch_size // (a.micro_batch_size
                                                                                             * a.data_parallel_size))
        return out

    training.train_step = measured_step
    sys.argv = ["pretrain_gpt.py", *flags, "--fake-process-group"]
    with _launch_env(rank, WORLD):
        gpt.pretrain(gpt.train_valid_test_datasets_provider, gpt.model_provider, gpt.ModelType.encoder_or_decoder,
                     gpt.forward_step, args_defaults={"tokenizer_type": "NullTokenizer"})
    return result


def run_child(kind, flags, rank, materialize=False):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, "--rank", str(rank),
           "--flags", json.dumps(flags)] + (["--materialize"] if materialize else [])
    env = dict(os.environ, MEGATRON_FORCE_CPU=os.environ.get("MEGATRON_FORCE_CPU", "1"), OMP_NUM_THREADS="2")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("SIMULATE_SCALE_RESULT "):
            return json.loads(line[len("SIMULATE_SCALE_RESULT "):])
    raise RuntimeError(f"{kind} child for rank {rank} failed (exit code {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                       f"{proc.stderr[-3000:]}")


# ------------------------------------------------------------------------------------------- closed forms
def closed_form_comm(s, b, h, L, V, t, p, d, m, stage, n_params, E=2, P=2, G=4):
    """Payload bytes per iteration per (group, op) of one rank: dense GPT, tied embeddings, no SP, 1F1B, the
    distributed optimizer, bf16 (docs/performance.md, "Scaling on paper")."""
    first, last = stage == 0, stage == p - 1
    layers = L // p
    act = s * b * h * E
    out = {("tp", "all_reduce"): m * ((4 * layers + first + last) * act + last * 3 * 4 * s * b)}
    out[("tp", "broadcast")] = m * (160 + 28 * s * b) if t > 1 else m * 28 * s * b
    if p > 1:
        out[("pp", "send")] = out[("pp", "recv")] = m * (2 - first - last) * s * b * h * P
        if first or last:
            out[("embedding", "all_reduce")] = V * h // t * G
    out[("dp", "reduce_scatter")] = n_params * G
    out[("dp", "all_gather")] = n_params * P
    return out


def measured_comm(summary):
    out = {}
    for group, ops in summary.items():
        for op, stats in ops.items():
            out[(group, op)] = stats["bytes"]
    return out


def fmt(x, unit=GiB):
    return f"{x / unit:10.3f}"


# ------------------------------------------------------------------------------------------- configurations
# DeepSeek-V3 (HEAD's conf/deepseek-ai/DeepSeek-R1.sh architecture, plus the V3 recipe's one MTP depth), on 1024
# ranks: TP 2 with sequence parallelism, EP 64 with expert TP 1 (expert DP 16), DP 512. PP 1: the 61 layers divide by
# no pipeline size without uneven first / last stages (--decoder-first/last-pipeline-num-layers, not available), so
# every rank holds every layer and has one role; rank 1023 is shown as the last expert-parallel rank.
DEEPSEEK_V3 = """--micro-batch-size 1 --bf16 --disable-bias-linear --untie-embeddings-and-output-weights
    --position-embedding-type rope --normalization RMSNorm --swiglu --num-layers 61 --hidden-size 7168
    --ffn-hidden-size 18432 --num-attention-heads 128 --kv-channels 128 --multi-latent-attention --kv-lora-rank 512
    --v-head-dim 128 --q-lora-rank 1536 --qk-head-dim 128 --qk-layernorm --qk-pos-emb-head-dim 64 --num-experts 256
    --moe-layer-freq [0]*3+[1]*58 --moe-ffn-hidden-size 2048 --moe-router-dtype fp32 --moe-router-score-function
    sigmoid --moe-router-bias-update-rate 1e-3 --moe-router-enable-expert-bias --moe-router-topk 8
    --moe-router-num-groups 8 --moe-router-group-topk 4 --moe-router-pre-softmax --moe-router-topk-scaling-factor 2.5
    --moe-shared-expert-intermediate-size 2048 --moe-aux-loss-coeff 1e-4 --moe-router-load-balancing-type
    seq_aux_loss --moe-token-dispatcher-type alltoall --moe-grouped-gemm --seq-length 4096
    --max-position-embeddings 4096 --make-vocab-size-divisible-by 1280 --rotary-base 10000 --rotary-percent 1.0
    --rotary-scaling-factor 40 --mscale 1.0 --mscale-all-dim 1.0 --mtp-num-layers 1 --mtp-loss-scaling-factor 0.1
    --tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 64
    --expert-tensor-parallel-size 1 --use-distributed-optimizer --global-batch-size 8192 --train-iters 10 --lr 1e-4
    --tokenizer-type NullTokenizer --vocab-size 129280 --mock-data""".split()
DEEPSEEK_PROBE = ["--hidden-size", "256", "--ffn-hidden-size", "512", "--num-attention-heads", "16",
                  "--kv-channels", "16", "--q-lora-rank", "64", "--kv-lora-rank", "32", "--qk-head-dim", "16",
                  "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16", "--moe-ffn-hidden-size", "64",
                  "--moe-shared-expert-intermediate-size", "64", "--vocab-size", "1280"]


def _probe_batch(dp, seq):
    return ["--seq-length", str(seq), "--global-batch-size", str(2 * dp), "--eval-iters", "0", "--log-interval", "1"]


def gpt3_config(opts, tmp):
    flags = gpt3_175b_flags(tmp)
    h = 12288 if opts.materialize else opts.probe_hidden
    probe = flags + ["--hidden-size", str(h), "--rampup-batch-size", "16", "16", "0", "--train-samples", "16",
                     "--lr-decay-samples", "16", "--lr-warmup-samples", "0"] + _probe_batch(8, opts.probe_seq)
    dims = dict(s=2048, h=12288, L=96, t=8, p=16, d=8, m=1536 // 8, probe_h=h)
    title = ("GPT-3 175B (examples/pretrain_gpt3_175B.sh + --use-distributed-optimizer): world 1024 = TP 8 x PP 16 "
             f"x DP 8, 96 layers, hidden 12288, 96 heads, sequence 2048, bf16, vocabulary 50257\nprobe run: hidden "
             f"{h}, sequence {opts.probe_seq}, 2 micro-batches per DP rank")
    return title, flags, probe, ROLES, dims


def deepseek_config(opts, tmp):
    probe = DEEPSEEK_V3 + ([] if opts.materialize else DEEPSEEK_PROBE) + _probe_batch(512, opts.probe_seq) + \
        ["--train-iters", "1"]  # (the GPT-3 script counts samples: its probe sets --train-samples instead)
    title = ("DeepSeek-V3 (61 layers: MLA, 3 dense + 58 MoE layers of 256 experts top-8 with a shared expert, 1 MTP "
             "depth): world 1024 = TP 2 (SP) x DP 512, EP 64, expert TP 1, sequence 4096, bf16, distributed "
             f"optimizer\nprobe run: {'full width' if opts.materialize else 'hidden 256, 16 heads, narrow MLA and '}"
             f"{'' if opts.materialize else 'experts'}, sequence {opts.probe_seq}, 2 micro-batches per DP rank")
    return title, DEEPSEEK_V3, probe, {"expert-parallel rank 0": 0, "expert-parallel rank 63": 1023}, None


CONFIGS = {"gpt3-175b": gpt3_config, "deepseek-v3": deepseek_config}


# ------------------------------------------------------------------------------------------- main
def report_role(role, rank, flags, probe_flags, dims, probe_seq, materialize):
    t0 = time.time()
    structure = run_child("structure", flags, rank)
    probe = run_child("probe", probe_flags, rank, materialize)
    coords = structure["coords"]
    stage = coords["pp"][0]
    print(f"\n== {role}: rank {rank} (tp {coords['tp'][0]}, pp {stage}, dp {coords['dp'][0]}, ep {coords['ep'][0]}, "
          f"expert dp {coords['expert_dp'][0]}), {time.time() - t0:.0f} s")
    print(f"   parameters held {structure['params']:,} (closed form {structure['formula_params']:,})")
    print("   memory (GiB)                          measured   closed form")
    for kind in ("weights", "grads", "optimizer"):
        print(f"   {kind:<36}{fmt(structure['measured'][kind])}  {fmt(structure['theory'][kind])}")
    print(f"   {'activations, full size (estimate)':<36}{'':>10}  {fmt(structure['activations'])}")
    print(f"   {'activations, probe run (peak saved)':<36}{fmt(probe['activation_peak'], MiB)}  "
          f"{fmt(probe['activations_theory'], MiB)}   (MiB)")
    got = measured_comm(probe["comm"])
    if dims is None:
        print("   communication per iteration, payload (probe run, measured; no closed form for MoE / MLA)")
        for key in sorted(got):
            print(f"   {key[0] + ' ' + key[1]:<36}{got[key] / MiB:12.2f} MiB")
        return
    V = probe["padded_vocab"]
    args = (dims["L"], V, dims["t"], dims["p"], dims["d"])
    at_probe = closed_form_comm(probe_seq, 1, dims["probe_h"], *args, probe["micro_batches"], stage, probe["params"])
    at_full = closed_form_comm(dims["s"], 1, dims["h"], *args, dims["m"], stage, structure["params"])
    print("   communication per iteration, payload  probe measured   probe closed form   full size closed form")
    for key in sorted(set(at_probe) | {k for k in got if k[0] in ("tp", "pp", "dp", "embedding")}):
        print(f"   {key[0] + ' ' + key[1]:<36}{got.get(key, 0) / MiB:12.2f} MiB "
              f"{at_probe.get(key, 0) / MiB:12.2f} MiB {at_full.get(key, 0) / GiB:14.2f} GiB")
    others = {k: v for k, v in got.items() if k[0] not in ("tp", "pp", "dp", "embedding")}
    print(f"   other groups (measured): {', '.join(f'{g} {o} {v} B' for (g, o), v in sorted(others.items()))}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="all", choices=["all", *CONFIGS])
    parser.add_argument("--probe-hidden", type=int, default=768, help="GPT-3's hidden size in the real run")
    parser.add_argument("--probe-seq", type=int, default=64, help="sequence length of the real run")
    parser.add_argument("--materialize", action="store_true",
                        help="run the probe at full width (about 10 GiB of RAM per GPT-3 175B rank)")
    parser.add_argument("--roles", default=None, help="comma-separated roles to simulate (default: all)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--flags", default=None, help=argparse.SUPPRESS)
    opts = parser.parse_args()

    if opts.child:
        if opts.child == "structure" or not opts.materialize:  # a safety net on a shared machine: meta and probe
            import resource                                      # runs need a few GiB; never take the machine down

            resource.setrlimit(resource.RLIMIT_AS, (8 * 2 ** 30, resource.RLIM_INFINITY))
        flags = json.loads(opts.flags)
        result = (child_structure if opts.child == "structure" else child_probe)(flags, opts.rank)
        print("SIMULATE_SCALE_RESULT " + json.dumps(result), flush=True)
        return
    tmp = tempfile.mkdtemp(prefix="simulate_scale_")
    print(f"this machine: {os.cpu_count()} CPUs; every rank below is one process with a fake process group")
    for name in (CONFIGS if opts.config == "all" else [opts.config]):
        title, flags, probe_flags, roles, dims = CONFIGS[name](opts, tmp)
        print(f"\n### {title}")
        for role, rank in roles.items():
            if opts.roles is None or role in opts.roles.split(","):
                report_role(role, rank, flags, probe_flags, dims, opts.probe_seq, opts.materialize)


if __name__ == "__main__":
    main()
