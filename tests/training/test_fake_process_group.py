"""--fake-process-group: one process is rank r of the 1024-GPU GPT-3 175B job of examples/pretrain_gpt3_175B.sh
(TP 8 x PP 16 x DP 8, 96 layers, hidden 12288, sequence 2048, bf16, plus the distributed optimizer).

* The full-size ranks 0, 511 and 1023 are built through initialize_megatron (fake process group, the real rank
  grid) and setup_model_and_optimizer on the meta device (shapes and dtypes, no memory: 10 GiB per rank would not
  fit this machine three times): their coordinates follow the rank formula, their parameters equal a count
  written here by hand from the architecture, and the bytes of weights + grads + optimizer state they hold equal
  tools/report_theoretical_memory.py's figure for their stage (within 5%; measured exactly equal).
* Rank 511 then trains: the script itself runs under a stand-in srun that starts that one task, with its flags
  overridden through MEGATRON_EXTRA_ARGS (the script's environment variable) to a sequence of 64, 2 micro-batches
  and hidden 768 (real memory and compute on CPU), every collective a no-op; it logs its iterations and its rank
  report, whose measured state bytes are within 5% of the theoretical ones. The full-width real run is
  benchmarks/simulate_scale.py --materialize.
"""
import os
import re

from helpers.examples_helpers import REPO, install_fake, run_script, script_env

GPT2 = os.path.join(REPO, "data", "tokenizers", "gpt2")


def script_options(tmp_path):
    """The ``options=( ... )`` array of examples/pretrain_gpt3_175B.sh, its variables filled in; mock data."""
    from megatron.training.rank_report import script_options as read_options

    words = read_options(os.path.join(REPO, "examples", "pretrain_gpt3_175B.sh"), {
        "DATASET": "", "VOCAB_FILE": f"{GPT2}/vocab.json", "MERGE_FILE": f"{GPT2}/merges.txt",
        "CHECKPOINT_PATH": str(tmp_path / "ckpt"), "TENSORBOARD_DIR": str(tmp_path / "tb")})
    words.remove("--data-path")
    # GPT-3's vocabulary of 50257 (the shipped GPT-2 files hold an 8192-token subset).
    return words + ["--mock-data", "--use-distributed-optimizer", "--tokenizer-type", "NullTokenizer",
                    "--vocab-size", "50257"]


def per_layer_params(h, tp):
    """One GPT-3 layer on one TP rank: QKV (3h x h / tp + bias), projection (h x h / tp + bias h), fc1
    (4h x h / tp + bias), fc2 (h x 4h / tp + bias h), two LayerNorms (2h each)."""
    return 12 * h * h // tp + 3 * h // tp + h + 4 * h // tp + h + 4 * h


def build_body(argv):
    from helpers.train_helpers import load_entry_point

    from megatron.training.rank_report import build_rank, format_rank_memory_report

    gpt = load_entry_point("pretrain_gpt")
    reports = {}
    for rank in (0, 511, 1023):
        reports[rank] = build_rank(argv, rank, 1024, gpt.model_provider, gpt.ModelType.encoder_or_decoder,
                                   args_defaults={"tokenizer_type": "GPT2BPETokenizer"})  # as pretrain_gpt.py does
        print(format_rank_memory_report(reports[rank]), flush=True)
    return reports


def test_fake_pg_175b_ranks_hold_what_the_formulas_say(tmp_path):
    import multiprocessing as mp

    argv = script_options(tmp_path)
    with mp.get_context("spawn").Pool(1) as pool:  # a process without torch.distributed
        reports = pool.apply(build_body, (argv,))
    h, tp, layers_per_stage = 12288, 8, 96 // 16
    vocab = 51200  # GPT-2's 50257 padded to a multiple of 128 x TP
    layers = layers_per_stage * per_layer_params(h, tp)
    expected = {0: layers + vocab // tp * h + 2048 * h,  # + word and position embeddings
                511: layers,
                1023: layers + 2 * h + vocab // tp * h}  # + final LayerNorm and the tied output layer's copy
    for rank, report in reports.items():
        tp_rank, dp_rank, pp_rank = rank % 8, rank // 8 % 8, rank // 64  # rank = tp + 8 (dp + 8 pp)
        coords = report["coords"]
        assert (coords["tp"], coords["dp"], coords["pp"]) == ((tp_rank, 8), (dp_rank, 8), (pp_rank, 16)), coords
        assert report["params"] == report["formula_params"] == expected[rank], (rank, report["params"])
        for kind in ("weights", "grads", "optimizer"):
            measured, theory = report["measured"][kind], report["theory"][kind]
            assert abs(measured - theory) <= 0.05 * theory, (rank, kind, measured, theory)
        # bf16 weights, fp32 gradients, fp32 main parameters + Adam moments sharded over DP 8: 2 + 4 + 12/8 bytes
        assert abs(sum(report["measured"].values()) / report["params"] - 7.5) < 0.01
    assert sum(reports[r]["params"] for r in reports) > 4.2e9


FAKE_SRUN_ONE_TASK = r"""#!/bin/bash
# srun for one task of a large job: task $FAKE_SRUN_PROCID of $SLURM_NTASKS (options ignored).
while [ $# -gt 0 ]; do case "$1" in -*) ;; *) break ;; esac; shift; done
SLURM_PROCID=$FAKE_SRUN_PROCID SLURM_LOCALID=0 SLURM_NODEID=0 exec "$@"
"""

CUT = ("--fake-process-group --hidden-size 768 --seq-length 64 --max-position-embeddings 64 --global-batch-size 16 "
       "--rampup-batch-size 16 16 16 --train-samples 32 --lr-decay-samples 32 --lr-warmup-samples 0 --log-interval 1 "
       "--eval-iters 0 --save-interval 100000 --use-distributed-optimizer --mock-data "
       "--tokenizer-type GPT2BPETokenizer")


def test_fake_pg_175b_rank_511_trains_through_the_script(tmp_path):
    install_fake(tmp_path, "srun", FAKE_SRUN_ONE_TASK)
    env = script_env(tmp_path, SLURM_JOB_ID=7, SLURM_NTASKS=1024, SLURM_JOB_NUM_NODES=128, FAKE_SRUN_PROCID=511,
                     SLURM_JOB_NODELIST="127.0.0.1", SLURM_NODELIST="127.0.0.1", LOG_DIR=tmp_path / "logs",
                     CHECKPOINT_PATH=tmp_path / "ckpt", TENSORBOARD_DIR=tmp_path / "tb", MEGATRON_EXTRA_ARGS=CUT)
    env.pop("MASTER_ADDR", None)
    rc, out = run_script("pretrain_gpt3_175B.sh", env, timeout=240)
    log = out + "".join(p.read_text() for p in (tmp_path / "logs").glob("*.log"))  # the stand-in srun: stdout
    assert rc == 0, log[-5000:]
    assert "this process is rank 511 of 1024" in log
    assert "using world size: 1024, data-parallel-size: 8, tensor-model-parallel size: 8, pipeline-model-parallel " \
           "size: 16" in log, log[:3000]
    assert len(re.findall(r" iteration +\d+/ +2 \|", log)) == 2, log[-3000:]
    m = re.search(r"\[rank 511 of 1024\] tp 7/8 pp 7/16 dp 7/8 .*\n  parameters held: (\d+) \(closed-form count for "
                  r"pipeline stage 7: (\d+)\)\n.*measured / theoretical ([\d.]+)", log)
    assert m, log[-4000:]
    assert int(m.group(1)) == int(m.group(2)) == 6 * per_layer_params(768, 8)
    assert abs(float(m.group(3)) - 1) < 0.05
    print("\n".join(line for line in log.splitlines() if "iteration" in line or line.startswith(("[rank", "  "))))
