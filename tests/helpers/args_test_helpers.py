"""Shared pieces of the training-framework tests: a clean launcher environment and a small valid command line."""
import pytest

from megatron.training.arguments import parse_args, validate_args
from megatron.training.global_vars import destroy_global_vars

# The smallest command line validate_args accepts.
BASE_ARGV = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
             "--max-position-embeddings 32 --micro-batch-size 2").split()

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS",
               "SLURM_LOCALID", "SLURM_NODELIST", "SLURM_JOB_NODELIST", "CUDA_DEVICE_MAX_CONNECTIONS")


@pytest.fixture
def clean_env(monkeypatch):
    """No launcher variables (a plain single process), and no global state left behind."""
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    destroy_global_vars()
    yield monkeypatch
    destroy_global_vars()


def parse(extra="", world_size=1, base=BASE_ARGV):
    """parse_args on BASE_ARGV + ``extra`` (later flags win), as if launched with ``world_size`` ranks."""
    args = parse_args(argv=list(base) + extra.split())
    args.world_size = world_size
    return args


def validated(extra="", world_size=1, defaults=None, base=BASE_ARGV):
    return validate_args(parse(extra, world_size, base), defaults or {})
