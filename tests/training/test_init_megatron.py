"""initialize_megatron: torchrun environment on 4 gloo ranks (groups, seeds, log lines, cross-rank timers), the
SLURM environment in one process, and the launcher-environment / SLURM nodelist parsing."""
import json
import os
import subprocess
import sys

import pytest
from helpers.args_test_helpers import BASE_ARGV, clean_env  # noqa: F401  (fixture)
from helpers.dist_harness import free_port, run_distributed

from megatron.training.errors import ConfigurationError
from megatron.training.launch_env import expand_slurm_nodelist, first_slurm_host, resolve_launch_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _RecordingWriter:
    def __init__(self):
        self.scalars = []

    def add_scalar(self, name, value, step):
        self.scalars.append((name, round(value, 6), step))


def _capture(fn, *args, **kwargs):
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        fn(*args, **kwargs)
    return buf.getvalue()


def _init_body(port):
    """Runs on each of 4 ranks: initialise like a torchrun-launched process, report what it sees."""
    import random

    import numpy as np
    import torch

    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.training.global_vars import destroy_global_vars, get_args, get_timers
    from megatron.training.initialize import initialize_megatron
    from megatron.training.timers import Timers

    # The harness made a process group; start without one, as torchrun does, on a fresh rendezvous port.
    torch.distributed.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port)
    argv = BASE_ARGV + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                        "--distributed-backend", "gloo", "--timing-log-level", "1"]
    out = {"stdout": _capture(initialize_megatron, argv=argv)}
    args = get_args()
    rank = torch.distributed.get_rank()
    out["rank"], out["dp_size"], out["backend"] = args.rank, args.data_parallel_size, torch.distributed.get_backend()
    out["coords"] = (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                     ps.get_data_parallel_rank())
    out["my_groups"] = {name: torch.distributed.get_process_group_ranks(group()) for name, group in (
        ("tensor", ps.get_tensor_model_parallel_group), ("pipeline", ps.get_pipeline_model_parallel_group),
        ("data", ps.get_data_parallel_group), ("model", ps.get_model_parallel_group))}
    summed = torch.tensor([float(rank)])
    torch.distributed.all_reduce(summed, group=ps.get_tensor_model_parallel_group())
    out["tp_sum"] = summed.item()
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, ps.get_all_group_ranks())
    out["layouts_agree"] = all(layout == everyone[0] for layout in everyone)
    out["all_groups"] = everyone[0]

    out["initial_seed"] = torch.initial_seed()
    out["python_random"] = random.random()
    out["numpy_random"] = float(np.random.random())
    with tensor_parallel.get_cuda_rng_tracker().fork():
        out["tracker_draw"] = torch.rand(3).tolist()

    # Timers with known per-rank times: phase-a takes 10 ms x (rank + 1); only rank 0 has "only-rank0".
    timers = get_timers()
    timers("phase-a", log_level=0)._elapsed = 0.010 * (rank + 1)
    if rank == 0:
        timers("only-rank0", log_level=1)._elapsed = 0.005
    out["fine_timer_is_dummy"] = type(timers("fine", log_level=2)).__name__
    writer = _RecordingWriter()
    timers.write(["phase-a", "only-rank0"], writer, 5)
    out["written"] = writer.scalars
    out["minmax"] = _capture(timers.log, ["phase-a", "only-rank0"], normalizer=2.0)
    for option in ("max", "all"):
        other = Timers(0, option)
        other("phase-a", log_level=0)._elapsed = 0.010 * (rank + 1)
        out[option] = _capture(other.log, ["phase-a"], rank=0)

    # Again in the same processes: the process group exists now. TP=1, PP=2, DP=2, per-DP-rank seeds.
    ps.destroy_model_parallel()
    destroy_global_vars()
    argv = BASE_ARGV + ["--pipeline-model-parallel-size", "2", "--data-parallel-random-init", "--seed", "77"]
    out["stdout2"] = _capture(initialize_megatron, argv=argv)
    out["coords2"] = (ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank())
    out["initial_seed2"] = torch.initial_seed()
    destroy_global_vars()
    return out


def _label(name):
    return (name + " ").ljust(48, ".")


def test_initialize_megatron_four_ranks_tp2_pp2():
    import random

    import numpy as np
    import torch

    results = run_distributed(_init_body, 4, free_port(), timeout=90)
    expected_groups = {"tensor": [[0, 1], [2, 3]], "pipeline": [[0, 2], [1, 3]], "data": [[0], [1], [2], [3]],
                       "model": [[0, 1, 2, 3]], "embedding": [[0, 2], [1, 3]], "position_embedding": [[0], [1]]}
    for rank, r in enumerate(results):
        tp, pp = rank % 2, rank // 2
        assert (r["rank"], r["dp_size"], r["backend"]) == (rank, 1, "gloo")
        assert r["coords"] == (tp, pp, 0)
        assert r["my_groups"] == {"tensor": [2 * pp, 2 * pp + 1], "pipeline": [tp, tp + 2], "data": [rank],
                                  "model": [0, 1, 2, 3]}
        assert r["tp_sum"] == 4 * pp + 1  # (2pp) + (2pp + 1)
        assert r["layouts_agree"]
        for kind, groups in expected_groups.items():
            assert r["all_groups"][kind] == groups

        seed = 1234 + 100 * pp
        assert r["initial_seed"] == seed
        assert r["python_random"] == random.Random(seed).random()
        assert r["numpy_random"] == np.random.RandomState(seed).random_sample()
        tracker_seed = seed + 2718 + tp
        assert r["tracker_draw"] == torch.rand(3, generator=torch.Generator().manual_seed(tracker_seed)).tolist()

        assert r["fine_timer_is_dummy"] == "DummyTimer"
        assert r["written"] == [("phase-a-time", 0.040, 5), ("only-rank0-time", 0.005, 5)]
        # Second initialisation: rank = dp + 2 * pp, seed 77 + 100 * pp + 10 * dp.
        pp2, dp2 = rank // 2, rank % 2
        assert r["coords2"] == (pp2, dp2)
        assert r["initial_seed2"] == 77 + 100 * pp2 + 10 * dp2

    lines = results[0]["stdout"].split("\n")
    for line in ("using world size: 4, data-parallel-size: 1, tensor-model-parallel size: 2, "
                 "pipeline-model-parallel size: 2 ",
                 "> initializing torch distributed ...", "> initialized tensor model parallel with size 2",
                 "> initialized pipeline model parallel with size 2", "> setting random seeds to 1234 ...",
                 "------------------------ arguments ------------------------"):
        assert line in lines
    assert lines.index("> initializing torch distributed ...") < lines.index("> setting random seeds to 1234 ...")
    assert "torch distributed is already initialized, skipping initialization ..." in results[0]["stdout2"]
    for r in results[1:]:
        assert "> initializing torch distributed" not in r["stdout"] and "arguments" not in r["stdout"]

    # Timer reports are printed once: on the last rank by default, on the rank asked for otherwise.
    assert [bool(r["minmax"]) for r in results] == [False, False, False, True]
    assert results[3]["minmax"] == ("(min, max) time across ranks (ms):\n"
                                    f"    {_label('phase-a')}: (5.00, 20.00)\n"  # 10..40 ms / normalizer 2
                                    f"    {_label('only-rank0')}: (2.50, 2.50)\n")
    assert results[0]["max"] == f"max time across ranks (ms):\n    {_label('phase-a')}: 40.00\n"
    assert results[0]["all"] == ("times across ranks (ms):\n  phase-a:\n     rank  0: 10.00\n     rank  1: 20.00\n"
                                 "     rank  2: 30.00\n     rank  3: 40.00\n")
    assert not any(r["max"] or r["all"] for r in results[1:])


_SLURM_SCRIPT = """
import json, os, torch
from megatron.core import parallel_state as ps
from megatron.training.global_vars import get_args
from megatron.training.initialize import initialize_megatron
initialize_megatron(argv={argv!r})
args = get_args()
print("RESULT " + json.dumps(dict(
    rank=args.rank, world_size=args.world_size, local_rank=args.local_rank, backend=torch.distributed.get_backend(),
    master_addr=os.environ["MASTER_ADDR"], env_rank=os.environ["RANK"], env_local_rank=os.environ["LOCAL_RANK"],
    tp=ps.get_tensor_model_parallel_world_size(), dp=ps.get_data_parallel_world_size(), seed=torch.initial_seed())))
"""


def test_slurm_environment_single_process():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env.update(PYTHONPATH=ROOT, MEGATRON_FORCE_CPU="1", SLURM_PROCID="0", SLURM_NTASKS="1", SLURM_LOCALID="0",
               SLURM_NODELIST="localhost,node[01-04]", MASTER_PORT=str(free_port()))
    script = _SLURM_SCRIPT.format(argv=BASE_ARGV)  # no --distributed-backend: nccl asked for, no CUDA here
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert result == dict(rank=0, world_size=1, local_rank=0, backend="gloo", master_addr="localhost", env_rank="0",
                          env_local_rank="0", tp=1, dp=1, seed=1234)
    warnings = [line for line in proc.stdout.split("\n") if "WARNING: --distributed-backend nccl" in line]
    assert warnings == ["WARNING: --distributed-backend nccl needs CUDA, which is not available: using gloo "
                        "(pass --distributed-backend gloo to silence this)"]


@pytest.mark.parametrize("nodelist,hosts", [
    ("node01", ["node01"]),
    ("node[01-04,07],other", ["node01", "node02", "node03", "node04", "node07", "other"]),
    ("n[008-011]", ["n008", "n009", "n010", "n011"]),
    ("a[9-10]", ["a9", "a10"]),
    ("gpu-a[1-2]-b[3-4]", ["gpu-a1-b3", "gpu-a1-b4", "gpu-a2-b3", "gpu-a2-b4"]),
    ("x[1,3],y[2], z", ["x1", "x3", "y2", "z"]),
    ("rack1-[5]", ["rack1-5"]),
])
def test_expand_slurm_nodelist(nodelist, hosts):
    assert expand_slurm_nodelist(nodelist) == hosts
    assert first_slurm_host(nodelist) == hosts[0]


@pytest.mark.parametrize("bad", ["node[01-04", "node01]", "node[a-b]", "node[5-3]", ""])
def test_bad_slurm_nodelist(bad):
    with pytest.raises(ConfigurationError, match="SLURM nodelist"):
        first_slurm_host(bad)


def test_resolve_launch_env():
    torchrun = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
                "SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURM_NODELIST": "n[1-2]"}
    got = resolve_launch_env(torchrun)  # torchrun inside an allocation: torchrun's variables win
    assert (got.rank, got.world_size, got.local_rank, got.master_addr, got.master_port, got.source) == \
        (5, 8, 1, "10.0.0.1", 29500, "torchrun")
    slurm = {"SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_LOCALID": "2", "SLURM_JOB_NODELIST": "gpu[003-004]"}
    got = resolve_launch_env(slurm)
    assert (got.rank, got.world_size, got.local_rank, got.master_addr, got.master_port, got.source) == \
        (6, 8, 2, "gpu003", 6000, "slurm")
    got = resolve_launch_env({})
    assert (got.rank, got.world_size, got.local_rank, got.master_port, got.source) == (0, 1, 0, 6000, "single process")
    with pytest.raises(ConfigurationError, match="RANK='x' must be an integer"):
        resolve_launch_env({"RANK": "x"})


def test_global_singletons(clean_env, capsys, tmp_path):
    """Tensorboard writer (or the warning when tensorboard is missing), signal handler, lazy MPU init."""
    import importlib.util
    import signal

    from megatron.core import parallel_state as ps
    from megatron.training import global_vars
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.initialize import initialize_megatron

    args = validate_args(parse_args(argv=BASE_ARGV + ["--tensorboard-dir", str(tmp_path), "--exit-signal-handler"]))
    original_sigterm = signal.getsignal(signal.SIGTERM)
    global_vars.set_global_variables(args, build_tokenizer=False)
    out = capsys.readouterr().out
    if importlib.util.find_spec("tensorboard") is None:
        assert global_vars.get_tensorboard_writer() is None
        assert "WARNING: TensorBoard writing requested but is not available" in out
    else:
        assert global_vars.get_tensorboard_writer() is not None and "> setting tensorboard ..." in out
    handler = global_vars.get_signal_handler()
    assert handler.signals_received() == [0]
    os.kill(os.getpid(), signal.SIGTERM)  # caught: the run saves and exits at the next check
    assert handler.signals_received() == [1]
    with pytest.raises(AssertionError, match="args is already initialized"):
        global_vars.set_global_variables(args, build_tokenizer=False)
    global_vars.destroy_global_vars()
    assert signal.getsignal(signal.SIGTERM) == original_sigterm  # restored
    with pytest.raises(AssertionError, match="args is not initialized"):
        global_vars.get_args()

    try:
        finish = initialize_megatron(argv=BASE_ARGV + ["--lazy-mpu-init", "--tensor-model-parallel-size", "1"])
        assert callable(finish) and global_vars.get_args().use_cpu_initialization is True
        assert ps.get_tensor_model_parallel_world_size() == 1
    finally:
        ps.destroy_model_parallel()
