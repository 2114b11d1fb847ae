"""Where this process sits in the job: rank, world size, local rank and rendezvous address.

Two launchers are understood:

* torchrun (and ``torch.distributed.launch``): ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
  ``MASTER_PORT``;
* SLURM's ``srun`` without torchrun: ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID`` and the first host of
  ``SLURM_NODELIST`` (or ``SLURM_JOB_NODELIST``) as the rendezvous host.

torchrun's variables win when both are present (torchrun started inside an ``srun`` allocation). Without either
the process is a single rank 0 of a world of 1. Reading the environment needs no process group, so argument
validation can compute the data-parallel size before anything is initialised.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import re
from dataclasses import dataclass
from typing import List, Mapping, Optional

from megatron.training.errors import ConfigurationError

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 6000


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str  # "torchrun", "slurm" or "single process"


def _int_var(env: Mapping[str, str], name: str) -> Optional[int]:
    value = env.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigurationError(f"environment variable {name}={value!r} must be an integer") from None


def _split_top_level(text: str) -> List[str]:
    """Split on commas that are not inside brackets: ``a[1,2],b`` -> ``['a[1,2]', 'b']``."""
    parts, depth, current = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ConfigurationError(f"SLURM nodelist {text!r} has an unmatched ']'")
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    if depth != 0:
        raise ConfigurationError(f"SLURM nodelist {text!r} has an unmatched '['")
    parts.append("".join(current))
    return [p.strip() for p in parts if p.strip()]


def _expand_range_list(spec: str, nodelist: str) -> List[str]:
    """``01-03,07`` -> ``['01', '02', '03', '07']``, keeping the zero padding of the lower bound."""
    values = []
    for item in spec.split(","):
        item = item.strip()
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
        if match is None:
            raise ConfigurationError(f"SLURM nodelist {nodelist!r}: cannot read range {item!r}")
        low, high = match.group(1), match.group(2)
        if high is None:
            values.append(low)
            continue
        if int(high) < int(low):
            raise ConfigurationError(f"SLURM nodelist {nodelist!r}: range {item!r} goes backwards")
        width = len(low)
        values.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    return values


def expand_slurm_nodelist(nodelist: str) -> List[str]:
    """Expand SLURM's compressed host list, e.g. ``node[01-03,07],gpu-a[1-2]-b[1-2],login``.

    Each bracket holds comma-separated numbers or ranges; several brackets in one name multiply out
    (leftmost varies slowest), as ``scontrol show hostnames`` prints them.
    """
    hosts: List[str] = []
    for part in _split_top_level(nodelist):
        pieces = re.split(r"\[([^\]]*)\]", part)
        # pieces alternates literal text and bracket contents: lit, br, lit, br, ..., lit
        literals = pieces[0::2]
        choices = [_expand_range_list(spec, nodelist) for spec in pieces[1::2]]
        for combo in itertools.product(*choices):
            name = literals[0]
            for value, literal in zip(combo, literals[1:]):
                name += value + literal
            hosts.append(name)
    return hosts


def first_slurm_host(nodelist: str) -> str:
    hosts = expand_slurm_nodelist(nodelist)
    if not hosts:
        raise ConfigurationError(f"SLURM nodelist {nodelist!r} names no host")
    return hosts[0]


def resolve_launch_env(env: Optional[Mapping[str, str]] = None) -> LaunchEnv:
    """Read rank, world size, local rank and the rendezvous address from torchrun's or SLURM's variables."""
    env = os.environ if env is None else env
    master_port = _int_var(env, "MASTER_PORT") or DEFAULT_MASTER_PORT

    rank, world_size = _int_var(env, "RANK"), _int_var(env, "WORLD_SIZE")
    if rank is not None or world_size is not None:
        local_rank = _int_var(env, "LOCAL_RANK")
        return LaunchEnv(rank or 0, world_size or 1, local_rank if local_rank is not None else (rank or 0),
                         env.get("MASTER_ADDR") or DEFAULT_MASTER_ADDR, master_port, "torchrun")

    rank, world_size = _int_var(env, "SLURM_PROCID"), _int_var(env, "SLURM_NTASKS")
    if rank is not None:
        local_rank = _int_var(env, "SLURM_LOCALID")
        nodelist = env.get("SLURM_NODELIST") or env.get("SLURM_JOB_NODELIST")
        master_addr = env.get("MASTER_ADDR") or (first_slurm_host(nodelist) if nodelist else DEFAULT_MASTER_ADDR)
        return LaunchEnv(rank, world_size or 1, local_rank if local_rank is not None else 0,
                         master_addr, master_port, "slurm")

    return LaunchEnv(0, 1, 0, env.get("MASTER_ADDR") or DEFAULT_MASTER_ADDR, master_port, "single process")


def export_launch_env(launch: LaunchEnv) -> None:
    """Write the resolved values back as torchrun's variables, so ``env://`` rendezvous and any later reader
    of ``RANK`` / ``LOCAL_RANK`` see the same numbers whatever the launcher was."""
    os.environ["RANK"] = str(launch.rank)
    os.environ["WORLD_SIZE"] = str(launch.world_size)
    os.environ["LOCAL_RANK"] = str(launch.local_rank)
    os.environ["MASTER_ADDR"] = launch.master_addr
    os.environ["MASTER_PORT"] = str(launch.master_port)


@contextlib.contextmanager
def posing_as_rank(rank: int, world_size: int):
    """Within the block, torchrun's ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` (0) say this process is ``rank`` of
    ``world_size`` (a fake process group's rank, or argument validation for another world); restored after."""
    saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0")
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
