"""A run that finishes normally exits 0: ``initialize_megatron`` destroys the process groups it created at exit.

Without that, gloo's worker threads are torn down during interpreter finalisation and a successful job aborts with
"terminate called without an active exception" (SIGABRT, torchrun reports exit code -6) in a random fraction of
runs: a two-rank gloo script without ``destroy_process_group`` aborted in 19 of 30 runs on the 2-core machine.
"""
import os
import subprocess
import sys
import textwrap

from helpers.args_test_helpers import BASE_ARGV
from helpers.dist_harness import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# An atexit handler registered before initialize_megatron runs after its handler (atexit is last in, first out):
# it reports whether the default process group was still alive when Python began to finalise.
CHILD = textwrap.dedent("""
    import atexit, sys, torch
    atexit.register(lambda: print(f"rank {rank[0]}: initialized at exit = {torch.distributed.is_initialized()}",
                                  flush=True))
    rank = [None]
    from megatron.core import parallel_state as ps
    from megatron.training.initialize import initialize_megatron
    initialize_megatron(argv=sys.argv[1:])
    rank[0] = torch.distributed.get_rank()
    x = torch.ones(4096)
    for _ in range(20):  # traffic on the world group and on a model-parallel subgroup
        torch.distributed.all_reduce(x)
        torch.distributed.all_reduce(x, group=ps.get_tensor_model_parallel_group())
""")


def _run_once(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                     "MASTER_"))}
    env.update(MEGATRON_FORCE_CPU="1", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    (tmp_path / "child.py").write_text(CHILD)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port", str(free_port()),
           str(tmp_path / "child.py"), *BASE_ARGV, "--tensor-model-parallel-size", "2", "--distributed-backend", "gloo"]
    return subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=120)


def test_normal_exit_destroys_process_groups_and_exits_zero(tmp_path):
    # Without the handler the check of the exit state fails every time; the abort itself comes in some runs only.
    for attempt in range(2):
        proc = _run_once(tmp_path)
        assert proc.returncode == 0, f"attempt {attempt}:\n{proc.stdout[-4000:]}"
        assert "terminate called" not in proc.stdout
        for rank in range(4):
            assert f"rank {rank}: initialized at exit = False" in proc.stdout, proc.stdout[-4000:]
