"""tools/check_parallel_equivalence.py: a fixed-seed sample of random parallel compositions trains like one rank,
and a failure is shrunk to a minimal set of options printed as a one-line reproducer.

The sample (seed 40, at most 4 ranks, 2 iterations) draws TP with and without SP, PP 1F1B and interleaved, CP (p2p,
a2a, all_gather), DP with the distributed optimizer and overlapped reduction, Megatron-FSDP, recompute, MoE with EP
and the routing options, multi-latent attention with multi-token prediction, FP8; each
combination's losses and grad norms are compared with the single-rank run from the same torch_dist checkpoint
(relative 1e-4; 2e-2 with FP8). The longer run is reported in docs/parallelism.md.
"""
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(REPO, "tools", "check_parallel_equivalence.py")
sys.path.insert(0, os.path.join(REPO, "tools"))

import check_parallel_equivalence as fuzz  # noqa: E402


def test_fixed_seed_sample_trains_like_one_rank():
    proc = subprocess.run([sys.executable, TOOL, "--seed", "40", "--num-combinations", "10", "--max-world", "4",
                           "--iterations", "2", "--no-shrink"],
                          capture_output=True, text=True, timeout=900, env=dict(os.environ, PYTHONPATH=REPO))
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert "10 combinations, 0 failing," in proc.stdout and ", 0 refused by the flags" in proc.stdout
    drawn = proc.stdout
    for feature in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--num-experts",
                    "--context-parallel-size", "--multi-latent-attention", "--use-megatron-fsdp", "--fp8-format",
                    "--num-layers-per-virtual-pipeline-stage"):
        assert feature in drawn, f"the fixed sample no longer draws {feature}: pick another seed"


class _FakeChecker(fuzz.Checker):
    """A checker whose 'training' fails exactly when TP > 1 runs with sequence parallelism and MoE."""

    def __init__(self):
        self.runs, self.last_error = 0, ""

    def check(self, combo):
        self.runs += 1
        o = combo.options
        if combo.size("--tensor-model-parallel-size") > 1 and "--sequence-parallel" in o and "--num-experts" in o:
            return "iteration 1 loss: 2.0 vs one rank 1.0"
        return None


def test_shrinking_finds_the_minimal_failing_options():
    line = ("--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2 --fuzz-dp 2 "
            "--use-distributed-optimizer --recompute-granularity full --recompute-method uniform "
            "--recompute-num-layers 1 --num-experts 4 --expert-model-parallel-size 2 --moe-ffn-hidden-size 48 "
            "--moe-router-topk 2 --moe-token-dispatcher-type alltoall")
    checker = _FakeChecker()
    combo = fuzz.parse_line(line)
    small, why = checker.shrink(combo, checker.check(combo))
    assert small.options == {"--tensor-model-parallel-size": ("2",), "--sequence-parallel": (),
                             "--num-experts": ("4",)}, small.line()  # (the fake check needs nothing else)
    assert small.world() == 2 and why.startswith("iteration 1 loss")
    assert fuzz.reproducer(small) == ("python tools/check_parallel_equivalence.py --repro "
                                      "'--tensor-model-parallel-size 2 --sequence-parallel --num-experts 4'")
    # Dropping --num-experts drops every MoE option with it; dropping TP drops --sequence-parallel.
    assert "--moe-router-topk" not in combo.without("--num-experts").options
    assert "--sequence-parallel" not in combo.without("--tensor-model-parallel-size").options
