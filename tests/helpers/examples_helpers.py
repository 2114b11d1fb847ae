"""Run the shell scripts of examples/ as a user would, with overrides that make them a tiny CPU job.

Every script appends ``$MEGATRON_EXTRA_ARGS`` last, and argparse keeps the last value of a repeated flag, so
the 345M / 175B settings of a script are replaced by a 2-layer model, 3 iterations and gloo.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

from helpers.dist_harness import free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ITERATION_LINE = re.compile(r" iteration +(\d+)/ +(\d+) \| consumed samples: +(\d+) \|.*\| global batch size: +(\d+) \|.*")

TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
        "--micro-batch-size 2 --log-interval 1 --eval-iters 1 --eval-interval 1000 "
        "--distributed-backend gloo --num-workers 0 --split 80,10,10 --initial-loss-scale 4096")
ITERS = "--global-batch-size 4 --train-iters 3 --lr-decay-iters 3 --save-interval 3"

FAKE_SRUN = r"""#!/bin/bash
# A stand-in for SLURM's srun on one machine: starts SLURM_NTASKS copies of the command with the variables
# srun gives each task (SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID); --output=FILE (with %x and %j) collects
# every task's output like srun does; other options are ignored.
output=""
while [ $# -gt 0 ]; do
    case "$1" in
        --output=*) output=${1#--output=} ;;
        -*) ;;
        *) break ;;
    esac
    shift
done
echo "fake srun: $SLURM_NTASKS tasks: $*" >&2
output=${output//%x/$SLURM_JOB_NAME}
output=${output//%j/$SLURM_JOB_ID}
pids=()
for ((i = 0; i < SLURM_NTASKS; i++)); do
    if [ -n "$output" ]; then
        SLURM_PROCID=$i SLURM_LOCALID=$i SLURM_NODEID=0 "$@" >>"$output" 2>&1 &
    else
        SLURM_PROCID=$i SLURM_LOCALID=$i SLURM_NODEID=0 "$@" &
    fi
    pids+=($!)
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
exit $rc
"""


def script_env(tmp_path, **overrides) -> dict:
    """A clean environment: the venv's python/torchrun first on PATH, CPU forced, no launcher variables."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_", "PYTHONPATH"))}
    env["PATH"] = os.pathsep.join([str(tmp_path / "bin"), os.path.dirname(sys.executable), env.get("PATH", "")])
    env["MEGATRON_FORCE_CPU"] = "1"
    env["MASTER_PORT"] = str(free_port())
    env["OMP_NUM_THREADS"] = "1"
    env.update({k: str(v) for k, v in overrides.items()})
    (tmp_path / "bin").mkdir(exist_ok=True)
    return env


def run_script(name, env, timeout=150):
    proc = subprocess.run(["bash", os.path.join(REPO, "examples", name)], env=env, cwd=str(env.get("RUN_DIR", REPO)),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    return proc.returncode, proc.stdout


def iteration_lines(output: str):
    return [(m.group(0), tuple(int(m.group(i)) for i in range(1, 5))) for m in ITERATION_LINE.finditer(output)]


def install_fake(tmp_path, name, text):
    path = tmp_path / "bin" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path
